"""``"has_aux": true`` over HTTP, raw bodies on a real server: the answer's ``aux`` member
in every encoding (JSON lists, typed base64, binary, the progress stream's result), with
batches, chunked runs and prepared handles, and a 422 (or 409 for a prep) naming the
field and the fix for every careless or hostile has_aux request.

The server serves ``tests.aux_functions`` (functions returning ``(output, aux)``) with
``DXSERVE_CHUNK_FROM=16``, so a Jacobian of 40 columns runs in chunks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jax
import numpy as np
import pytest

from dxclient import Client
from dxcontract import codec
from dxcontract.errors import NotScalarOutputError
from dxserve.examples import bn_loss
from dxserve.frameworks.jax.precision import float64_scope
from tests.aux_functions import X3, aux_scalar, aux_vector
from tests.conftest import ServerProcess, start_server, stop_server

PROBLEM = "application/problem+json"
X = X3.tolist()


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    srv: ServerProcess = start_server(
        tmp_path_factory.mktemp("aux"), modules=("dxserve.examples", "tests.aux_functions"),
        env={"DXSERVE_CHUNK_FROM": "16"},
    )
    try:
        yield srv.url
    finally:
        stop_server(srv)


def post(url: str, path: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(url + path, content=json.dumps(body), headers={"content-type": "application/json", **headers})


def strict(content: bytes) -> Any:
    """Strict JSON: a bare NaN or Infinity is an error."""
    return json.loads(content, parse_constant=lambda name: pytest.fail(f"bare {name}"))


def problem(r: httpx.Response, status: int, field: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith(PROBLEM)
    doc = r.json()
    assert doc["field"] == field, doc
    return doc


def jax_value_and_grad(f: Any, x: Any, *contexts: Any) -> Any:
    with float64_scope():
        return jax.value_and_grad(f, has_aux=True)(x, *contexts)


# --- the aux member ---------------------------------------------------------------------
def test_json_answer_carries_aux_as_a_pytree(url: str) -> None:
    r = post(url, "/value_and_gradient", {"function": "aux_scalar", "x": X, "has_aux": True})
    assert r.status_code == 200, r.text
    body = strict(r.content)
    assert set(body) == {"value", "gradient", "aux"}
    (value, aux), g = jax_value_and_grad(aux_scalar, X3)
    assert body["value"] == pytest.approx(float(value), rel=1e-15)
    np.testing.assert_allclose(body["gradient"], g, rtol=1e-14)
    got = body["aux"]
    # the pytree as the wire spells it: tuples and lists marked, None as null, int typed
    assert set(got) == {"norm", "parts", "count"}
    assert got["norm"] == pytest.approx(float(aux["norm"]), rel=1e-15)
    assert got["count"] == {"__ndarray__": 3, "dtype": "int32", "shape": []}
    squares, rest = got["parts"]["__tuple__"]
    np.testing.assert_allclose(squares, X3**2, rtol=1e-15)
    cumsum, none = rest["__list__"]
    np.testing.assert_allclose(cumsum, np.cumsum(X3), rtol=1e-15)
    assert none is None


@pytest.mark.parametrize(
    "accept", ["application/json; arrays=b64", "application/vnd.dxserve.binary"]
)
def test_typed_and_binary_answers_carry_aux(url: str, accept: str) -> None:
    body = {"function": "aux_vector", "x": X, "has_aux": True}
    r = post(url, "/value_and_jacobian", body, accept=accept)
    assert r.status_code == 200, r.text
    got = codec.decode_response(
        r.content, r.headers["content-type"], r.headers.get(codec.HEADER_LENGTH),
        arrays=["value", "jacobian", "aux"],
    )
    with float64_scope():
        J, aux = jax.jacrev(aux_vector, has_aux=True)(X3)
    np.testing.assert_allclose(got["jacobian"], J, rtol=1e-14)
    assert isinstance(got["aux"], list) and isinstance(got["aux"][1], dict)
    assert got["aux"][0] == pytest.approx(float(aux[0]), rel=1e-15)
    assert got["aux"][1]["max"] == pytest.approx(float(aux[1]["max"]), rel=1e-15)
    assert got["aux"][1]["max"].dtype == np.float64


def test_bn_loss_new_state_comes_back_as_aux(url: str) -> None:
    ps, batch, st = bn_loss.__dxserve__.example
    wire = codec.loads(codec.dumps(codec.from_tree({"ps": ps, "batch": batch, "st": st}, "json")))
    body = {"function": "bn_loss", "x": wire["ps"], "contexts": [wire["batch"], wire["st"]],
            "has_aux": True, "backend": "jax-reverse"}
    r = post(url, "/value_and_gradient", body)
    assert r.status_code == 200, r.text
    got = strict(r.content)
    (loss, new_st), g = jax_value_and_grad(bn_loss, ps, batch, st)
    assert got["value"] == pytest.approx(float(loss), rel=1e-13)
    for k in ("mean", "var"):
        np.testing.assert_allclose(got["aux"][k], new_st[k], rtol=1e-13)
    for k in ("w", "scale", "shift"):
        np.testing.assert_allclose(got["gradient"][k], g[k], rtol=1e-12)


def test_a_batch_of_points_stacks_aux(url: str) -> None:
    points = np.stack([X3, 2 * X3, -X3])
    body = {"function": "aux_scalar", "x": points.tolist(), "batch_axis": 0, "has_aux": True}
    r = post(url, "/gradient", body)
    assert r.status_code == 200, r.text
    got = strict(r.content)
    assert got["aux"]["count"] == {"__ndarray__": [3, 3, 3], "dtype": "int32", "shape": [3]}
    for i, p in enumerate(points):
        (_, aux), g = jax_value_and_grad(aux_scalar, p)
        np.testing.assert_allclose(got["gradient"][i], g, rtol=1e-14)
        assert got["aux"]["norm"][i] == pytest.approx(float(aux["norm"]), rel=1e-15)


def test_a_chunked_streamed_jacobian_ends_with_aux(url: str) -> None:
    x = np.linspace(-1.0, 1.0, 40)
    body = {"function": "aux_vector", "x": x.tolist(), "backend": "jax-forward",
            "has_aux": True}
    with httpx.stream("POST", url + "/value_and_jacobian", content=json.dumps(body),
                      headers={"content-type": "application/json",
                               "accept": "text/event-stream"}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith(("event:", "data:"))]
    names = [e.split(": ", 1)[1] for e in events if e.startswith("event:")]
    assert names.count("progress") >= 2 and names[-1] == "result", names
    result = strict(events[-1].split(": ", 1)[1].encode())
    with float64_scope():
        J, aux = jax.jacfwd(aux_vector, has_aux=True)(x)
    np.testing.assert_allclose(result["jacobian"], J, rtol=1e-13, atol=1e-15)
    assert result["aux"]["__list__"][0] == pytest.approx(float(aux[0]), abs=1e-14)
    # the plain answer is the same bits
    plain = strict(post(url, "/value_and_jacobian", body).content)
    assert plain == result


def test_prepared_handles_carry_has_aux(url: str) -> None:
    base = {"function": "aux_scalar", "x": X, "backend": "jax-forward", "has_aux": True}
    r = post(url, "/prepare/value_and_gradient", base)
    assert r.status_code == 200, r.text
    handle = r.json()["prep"]
    r = post(url, "/gradient", {**base, "prep": handle})
    assert r.status_code == 200, r.text
    assert set(r.json()) == {"gradient", "aux"}
    doc = problem(post(url, "/gradient", {**base, "prep": handle, "has_aux": False}),
                  409, "has_aux")
    assert "has_aux=False given, prepared with has_aux=True" in doc["detail"]


# --- careless and hostile has_aux ----------------------------------------------------------
@pytest.mark.parametrize("function", ["no_pair", "triple"])
def test_a_function_returning_no_pair_is_422_naming_it_and_the_fix(url: str, function: str) -> None:
    r = post(url, "/value_and_gradient", {"function": function, "x": X, "has_aux": True})
    doc = problem(r, 422, "function")
    assert repr(function) in doc["detail"]
    assert "return a tuple (output, aux)" in doc["detail"] and '"has_aux": false' in doc["detail"]
    assert doc["fix"] == {"has_aux": False}


def test_a_pair_without_has_aux_says_how_to_ask(url: str) -> None:
    doc = problem(post(url, "/gradient", {"function": "aux_scalar", "x": X}), 422, "function")
    assert '"has_aux": true' in doc["detail"] and doc["fix"] == {"has_aux": True}


@pytest.mark.parametrize("value", ["yes", 1, 0, None, [True], {"on": True}])
def test_has_aux_must_be_a_boolean(url: str, value: Any) -> None:
    r = post(url, "/gradient", {"function": "aux_scalar", "x": X, "has_aux": value})
    assert "must be true" in problem(r, 422, "has_aux")["detail"]


def test_the_output_part_is_checked_as_without_aux(url: str) -> None:
    body = {"function": "vector_pair", "x": X, "has_aux": True}
    doc = problem(post(url, "/gradient", body), 422, "function")
    assert doc["type"].endswith("not-scalar-output")
    r = post(url, "/jacobian", body)
    assert r.status_code == 200 and r.json()["aux"] == pytest.approx(float(np.sum(X3)))


def test_sparse_refuses_has_aux(url: str) -> None:
    doc = problem(post(url, "/sparsity", {"function": "aux_vector", "x": X, "has_aux": True}),
                  422, "has_aux")
    assert "sparsity takes no has_aux" in doc["detail"]
    body = {"function": "aux_vector", "x": X, "has_aux": True,
            "backend": {"type": "sparse", "dense": "jax-forward"}}
    assert "sparse" in problem(post(url, "/jacobian", body), 422, "has_aux")["detail"]


def test_a_repeated_body_is_not_taken_for_one_with_another_has_aux(url: str) -> None:
    """The server's memo of validated JSON bodies keys has_aux too."""
    with_aux = {"function": "aux_scalar", "x": X, "has_aux": True}
    without = {"function": "aux_scalar", "x": X}
    for _ in range(2):
        assert set(post(url, "/gradient", with_aux).json()) == {"gradient", "aux"}
        problem(post(url, "/gradient", without), 422, "function")
        problem(post(url, "/gradient", {**without, "has_aux": False}), 422, "function")


def test_the_openapi_document_has_has_aux_and_aux(url: str) -> None:
    doc = httpx.get(url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    request = schemas["ValueAndGradientRequest"]["properties"]["has_aux"]
    assert request["type"] == "boolean" and request["default"] is False
    assert "aux" in schemas["ValueAndGradientResponse"]["properties"]
    assert "has_aux" not in schemas["SparsityRequest"]["properties"]
    assert "aux" not in schemas["SparsityResponse"]["properties"]


@pytest.mark.parametrize("encoding", ["binary", "json", "b64"])
def test_the_clients_repeated_calls_keep_has_aux_apart(url: str, encoding: str) -> None:
    """x alone changing (no contexts): the client reuses the rest of the body; a call with
    has_aux and one without never share it."""
    (_, aux_ref), g_ref = jax_value_and_grad(aux_scalar, X3)
    with Client(url, encoding=encoding) as client:
        for _ in range(3):
            g, aux = client.gradient("aux_scalar", X3, has_aux=True)
            np.testing.assert_allclose(g, g_ref, rtol=1e-14)
            assert aux["parts"][1][1] is None and isinstance(aux["parts"], tuple)
            assert aux["count"].dtype == np.int32 and int(aux["count"]) == 3
            with pytest.raises(NotScalarOutputError):
                client.gradient("aux_scalar", X3)
