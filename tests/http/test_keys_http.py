"""Typed PRNG keys over raw HTTP: JSON bodies as any language writes them, keys in the
answers, and every malformed or misplaced key a 4xx problem naming the field and the fix
(the keep-alive connection still serving the next request). Never a 5xx.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jax
import numpy as np
import pytest

import dxserve
from dxcontract import codec
from dxserve.examples import noisy
from tests import key_functions
from tests.conftest import ServerProcess, start_server, stop_server
from tests.references import noisy_gradient

PROBLEM = "application/problem+json"
X = [1.0, 2.0, 3.0]
MODULES = ("dxserve.examples", "tests.key_functions")


def key(data: Any, dtype: str = "key<threefry2x32>", shape: list | None = None) -> dict:
    return {"__ndarray__": data, "dtype": dtype, "shape": [] if shape is None else shape}


def words(k: jax.Array) -> list:
    return np.asarray(jax.random.key_data(k)).tolist()


def draws(k: jax.Array) -> np.ndarray:
    with dxserve.float64_scope():
        return np.asarray(jax.random.normal(k, (3,), np.float64))


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("keys-http"), modules=MODULES)
    try:
        yield server
    finally:
        stop_server(server)


@pytest.fixture(scope="module")
def http(srv: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url) as client:
        yield client


def ok(http: httpx.Client, path: str, body: dict, **headers: str) -> httpx.Response:
    r = http.post(path, json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r


# --------------------------------------------------------------------------- accepted


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_a_key_written_by_hand(http: httpx.Client, impl: str) -> None:
    k = jax.random.key(0, impl=impl)
    body = {"function": "noisy", "x": X, "contexts": [key(words(k), f"key<{impl}>")]}
    g = np.array(ok(http, "/gradient", body).json()["gradient"])
    np.testing.assert_allclose(g, noisy_gradient(np.array(X), draws(k)), rtol=1e-12)
    assert g.tobytes() == np.asarray(dxserve.gradient(noisy, "auto", np.array(X), k)).tobytes()
    # the same key as base64 of its little-endian words
    b64 = base64.b64encode(np.asarray(words(k), "<u4").tobytes()).decode()
    body["contexts"] = [key(b64, f"key<{impl}>")]
    answer = ok(http, "/gradient", body).json()["gradient"]  # typed, as the request was
    assert answer["dtype"] == "float64" and codec.to_tree(answer, "gradient").tobytes() == g.tobytes()


def test_the_documented_request(http: httpx.Client) -> None:
    body = {"function": "noisy", "x": [1, 2, 3],
            "contexts": [{"__ndarray__": [0, 0], "dtype": "key<threefry2x32>", "shape": []}]}
    got = ok(http, "/gradient", body).json()
    assert got == {"gradient": [1.9588315721040712, 3.6860936894213037, 7.089652003600791]}


def test_keys_in_the_answers(http: httpx.Client) -> None:
    k = jax.random.key(4)
    y, new_key = dxserve.value(key_functions.noisy_step, "auto", np.array(X), k)
    body = {"function": "noisy_step", "x": X, "contexts": [key(words(k))]}
    assert ok(http, "/value", body).json() == {"value": {"__tuple__": [
        float(y), {"__ndarray__": words(new_key), "dtype": "key<threefry2x32>", "shape": []},
    ]}}
    b64 = ok(http, "/value", body, accept="application/json; arrays=b64").json()["value"]
    got = b64["__tuple__"][1]
    assert got["dtype"] == "key<threefry2x32>" and got["shape"] == []
    assert np.frombuffer(base64.b64decode(got["__ndarray__"]), "<u4").tolist() == words(new_key)
    split = ok(http, "/value", {"function": "split_keys", "x": X,
                                "contexts": [key(words(k))]}).json()["value"]
    keys = jax.random.split(k, 3)
    assert split == {"keys": {"__ndarray__": words(keys), "dtype": "key<threefry2x32>",
                              "shape": [3]}, "total": 6.0}
    # an answer in the binary framing, read by the codec
    r = ok(http, "/value", body, accept=codec.BINARY_TYPE)
    value = codec.decode_response(r.content, r.headers["content-type"],
                                  r.headers[codec.HEADER_LENGTH], arrays=("value",))["value"]
    assert float(value[0]) == float(y) and value[1].data.tolist() == words(new_key)


def test_a_binary_body_written_by_hand(http: httpx.Client) -> None:
    k = jax.random.key(5, impl="rbg")
    x = np.array(X)
    header = {"function": "noisy", "x": {"__ndarray__": {"offset": 0, "nbytes": 24},
                                         "dtype": "float64", "shape": [3]},
              "contexts": [{"__ndarray__": {"offset": 64, "nbytes": 16}, "dtype": "key<rbg>",
                            "shape": []}]}
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 64)
    body = head + x.tobytes() + bytes(40) + np.asarray(words(k), "<u4").tobytes()
    r = http.post("/gradient", content=body, headers={
        "content-type": codec.BINARY_TYPE, codec.HEADER_LENGTH: str(len(head)),
        "accept": "application/json"})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["gradient"], noisy_gradient(x, draws(k)), rtol=1e-12)


# --------------------------------------------------------------------------- refused

K = key([0, 0])
REFUSED = [
    # (id, path, body, status, field, words of the detail)
    ("key-as-x", "/gradient", {"function": "noisy", "x": K, "contexts": [X]}, 422, "x",
     "Pass the key as a context"),
    ("b64-key-as-x", "/value", {"function": "noisy", "x": key("AAAAAAAAAAA="), "contexts": [X]},
     422, "x", '"contexts": [key]'),
    ("key-in-a-pytree-x", "/gradient",
     {"function": "noisy", "x": {"w": X, "k": K}, "contexts": [K]}, 422, "x", "typed PRNG key"),
    ("key-as-tangent", "/pushforward",
     {"function": "noisy", "x": X, "tangents": [K], "contexts": [K]}, 422, "tangents[0]",
     "cannot be differentiated"),
    ("unknown-impl", "/gradient",
     {"function": "noisy", "x": X, "contexts": [key([0, 0], "key<philox>")]}, 422,
     "contexts[0]", "key<threefry2x32> (2 uint32 per key)"),
    ("jax-short-name", "/gradient",
     {"function": "noisy", "x": X, "contexts": [key([0, 0], "key<fry>")]}, 422, "contexts[0]",
     "write 'key<threefry2x32>'"),
    ("too-many-words", "/gradient",
     {"function": "noisy", "x": X, "contexts": [key([0, 0, 0, 0])]}, 422, "contexts[0]",
     "needs [2] uint32 words"),
    ("rbg-words-short", "/gradient",
     {"function": "noisy", "x": X, "contexts": [key([0, 0], "key<rbg>")]}, 422, "contexts[0]",
     "needs [4] uint32 words"),
    ("shape-disagrees", "/gradient",
     {"function": "noisy", "x": X, "contexts": [key([0, 0], shape=[2])]}, 422, "contexts[0]",
     "needs [2, 2] uint32 words"),
    ("b64-length", "/gradient",
     {"function": "noisy", "x": X, "contexts": [key("AAAAAAAAAAAAAAAA")]}, 422, "contexts[0]",
     "16 base64 characters, not 12"),
    ("float-words", "/gradient",
     {"function": "noisy", "x": X, "contexts": [key([0.5, 1.0])]}, 422, "contexts[0][0]",
     "uint32 words"),
    ("negative-words", "/gradient",
     {"function": "noisy", "x": X, "contexts": [key([-1, 0])]}, 422, "contexts[0]",
     "out of range for uint32"),
    ("words-past-uint32", "/gradient",
     {"function": "noisy", "x": X, "contexts": [key([2**32, 0])]}, 422, "contexts[0]",
     "0 to 4294967295"),
    ("bool-words", "/gradient",
     {"function": "noisy", "x": X, "contexts": [key([True, False])]}, 422, "contexts[0][0]",
     "booleans are not numbers"),
    ("string-words", "/gradient",
     {"function": "noisy", "x": X, "contexts": [key(["0", "1"])]}, 422, "contexts[0][0]",
     "uint32 words"),
    ("nested-context", "/gradient",
     {"function": "noisy_tree", "x": X, "contexts": [{"key": key([1]), "scale": 0.1}]}, 422,
     "contexts[0].key", "needs [2] uint32 words"),
    # the bounds every typed array has
    ("huge-shape", "/gradient",
     {"function": "noisy", "x": X, "contexts": [key([], shape=[2**40])]}, 400, "contexts[0]",
     "exceeds 2147483648 elements"),
    ("huge-with-words", "/gradient",
     {"function": "noisy", "x": X, "contexts": [key([], shape=[2**16, 2**16])]}, 400,
     "contexts[0]", "exceeds 2147483648 elements"),
    ("huge-b64", "/gradient",
     {"function": "noisy", "x": X, "contexts": [key("AAAA", shape=[10**8])]}, 422,
     "contexts[0]", "needs [100000000, 2] uint32 words"),
    ("shape-not-a-list", "/gradient",
     {"function": "noisy", "x": X, "contexts": [key([0, 0], shape="[]")]}, 400, "contexts[0]",
     "list of ints"),
]


@pytest.mark.parametrize(("path", "body", "status", "field", "fix"), [c[1:] for c in REFUSED],
                         ids=[c[0] for c in REFUSED])
def test_refused_keys(http: httpx.Client, path: str, body: dict, status: int, field: str,
                      fix: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith(PROBLEM)
    doc = r.json()
    assert doc["field"] == field and fix in doc["detail"], doc
    # the connection serves the next request
    good = {"function": "noisy", "x": X, "contexts": [K]}
    assert http.post("/value", json=good).status_code == 200


def test_a_lying_binary_key_buffer(http: httpx.Client) -> None:
    header = {"function": "noisy", "x": X,
              "contexts": [{"__ndarray__": {"offset": 0, "nbytes": 16},
                            "dtype": "key<threefry2x32>", "shape": []}]}
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 64)
    headers = {"content-type": codec.BINARY_TYPE, codec.HEADER_LENGTH: str(len(head))}
    r = http.post("/gradient", content=head + bytes(16), headers=headers)
    assert r.status_code == 422 and r.json()["field"] == "contexts[0]", r.text
    assert "a buffer of 16 bytes" in r.json()["detail"]
    header["contexts"][0] = {"__ndarray__": {"offset": 0, "nbytes": 8 * 10**6},
                             "dtype": "key<threefry2x32>", "shape": [10**6]}
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 64)
    headers[codec.HEADER_LENGTH] = str(len(head))
    r = http.post("/gradient", content=head + bytes(8), headers=headers)
    assert r.status_code == 400 and "runs past" in r.json()["detail"], r.text


def test_many_keys_count_as_leaves(http: httpx.Client) -> None:
    """Each key is a pytree leaf: a request of more keys than DXSERVE_MAX_LEAVES is refused
    before anything is traced, as for arrays."""
    body = {"function": "noisy", "x": X, "contexts": [{"__list__": [K] * 5000}]}
    r = http.post("/gradient", json=body)
    assert r.status_code == 422 and r.json()["type"].endswith("request-shape"), r.text
    assert r.json()["field"].startswith("contexts[0]")


@pytest.mark.slow  # a server of its own and 5,000 keys
def test_a_large_key_array_within_the_body_limits(
    make_server: Callable[..., ServerProcess],
) -> None:
    server = make_server(env={"DXSERVE_MAX_JSON_BODY_BYTES": "65536"}, modules=MODULES)
    keys = jax.random.split(jax.random.key(0), 5000)
    text = {"function": "noisy_keys", "x": X, "contexts": [key(words(keys), shape=[5000])]}
    assert len(json.dumps(text)) > 65536
    r = httpx.post(server.url + "/gradient", json=text)
    assert r.status_code == 413 and r.json()["field"] == "body", r.text
    # the same keys in base64 fit, and answer what the library does
    small = dict(text, contexts=[key(base64.b64encode(
        np.asarray(jax.random.key_data(keys), "<u4").tobytes()).decode(), shape=[5000])])
    r = httpx.post(server.url + "/gradient", json=small)
    assert r.status_code == 200, r.text
    want = dxserve.gradient(key_functions.noisy_keys, "auto", np.array(X), keys)
    got = codec.to_tree(r.json()["gradient"], "gradient")
    assert got.tobytes() == np.asarray(want).tobytes()
