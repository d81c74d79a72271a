"""Large typed base64 arrays: lifted out of a body before parsing, written as parts.

A JSON body of ``LIFT_MIN_BODY`` bytes or more has each long ``__ndarray__`` string
handed to the base64 decoder as a view of the body (``common.loads_body``), and the
"b64" encoding writes a long base64 string as a part of its own (``RawString``). These
tests hold both to the general path: the same arrays and the same bytes, whatever a
sender writes (other languages' spacing and escapes, look-alike placeholders, broken
JSON), and 4xx problems, never 5xx, for what is wrong.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dxclient import Client, _models
from dxcontract import codec
from dxcontract.encodings import common
from dxcontract.errors import MalformedRequestError
from dxserve import JaxReverse

N = 20_000  # float64 elements: base64 of 160 KB, past both lifting thresholds


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes()).decode()


def _typed(a: np.ndarray) -> dict:
    return {"__ndarray__": _b64(a), "dtype": a.dtype.name, "shape": list(a.shape)}


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {
        "f64": rng.standard_normal(N),
        "f32": rng.standard_normal((100, 300)).astype(np.float32),
        "i8": rng.integers(-128, 127, 50_000, dtype=np.int8),
        "c128": (rng.standard_normal(3000) + 1j * rng.standard_normal(3000)),
        "bool": rng.integers(0, 2, 70_000).astype(bool),
        "nan": np.asarray(np.nan),  # short: never lifted (other senders may spell it "NaN")
        "short": rng.standard_normal(3),
    }


def _decoded(body: bytes) -> dict[str, np.ndarray]:
    obj = codec.decode_response(body, "application/json", arrays=tuple(_arrays()))
    return {k: obj[k] for k in _arrays()}


def _same(got: dict, want: dict) -> None:
    for key, a in want.items():
        b = got[key]
        assert b.dtype == a.dtype.newbyteorder("<") or b.dtype == a.dtype, key
        assert b.shape == a.shape, key
        assert np.array_equal(b, a, equal_nan=a.dtype.kind in "fc"), key


def _whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parse every body whole (the general path)."""
    monkeypatch.setattr(common, "LIFT_MIN_BODY", 1 << 62)


def test_long_strings_come_back_as_views_and_decode_identically(monkeypatch) -> None:
    arrays = _arrays()
    body, _, _ = codec.encode_body(arrays, "b64")
    obj = common.loads_body(body)
    lifted = [k for k, v in obj.items() if type(v["__ndarray__"]) is memoryview]
    assert sorted(lifted) == ["bool", "c128", "f32", "f64", "i8"]
    assert type(obj["nan"]["__ndarray__"]) is str and type(obj["short"]["__ndarray__"]) is str
    got = _decoded(body)
    _same(got, arrays)
    _whole(monkeypatch)
    whole = _decoded(body)
    for key in arrays:
        assert got[key].tobytes() == whole[key].tobytes(), key


@pytest.mark.parametrize(
    "dump",
    [
        lambda p: json.dumps(p).encode(),  # ", " and ": " (Python's default)
        lambda p: json.dumps(p, indent=2).encode(),  # newlines and indents
        lambda p: json.dumps(p, separators=(",", " :\t")).encode(),
        lambda p: json.dumps(p).replace("/", "\\/").encode(),  # PHP escapes every slash
        lambda p: json.dumps(p, ensure_ascii=True).replace('"__ndarray__"', '"__nd\\u0061rray__"').encode(),
    ],
    ids=["spaces", "indent", "odd-whitespace", "escaped-slashes", "escaped-key"],
)
def test_what_other_languages_write_decodes_the_same(dump) -> None:
    arrays = _arrays()
    payload = {k: _typed(a) if k != "nan" else {"__ndarray__": "NaN", "dtype": "float64", "shape": []}
               for k, a in arrays.items()}
    _same(_decoded(dump(payload)), arrays)


def test_a_look_alike_placeholder_is_never_swapped_for_lifted_data() -> None:
    """A sender's own ``\\u0000<n>`` string under ``__ndarray__`` can't claim another
    array's data: the body is parsed whole, and that string is invalid base64."""
    a = np.arange(N, dtype=np.float64)
    body = json.dumps({
        "x": _typed(a),
        "y": {"__ndarray__": "\u00000", "dtype": "float64", "shape": [N]},
    }).encode()
    obj = common.loads_body(body)
    assert obj["y"]["__ndarray__"] == "\x000" and type(obj["x"]["__ndarray__"]) is str
    with pytest.raises(MalformedRequestError) as err:
        codec.decode_response(body, "application/json", arrays=("x", "y"))
    assert err.value.field == "y"


@pytest.mark.parametrize("claim", ["\u00000", "\u0000\u00b2", "\u0000" + "9" * 5000, "\u00007"])
def test_any_placeholder_a_sender_writes_leaves_the_data_where_it_was(claim: str) -> None:
    a = np.arange(N, dtype=np.float64)
    body = json.dumps({"x": _typed(a), "y": {"__ndarray__": claim, "dtype": "float64",
                                              "shape": [1]}}).encode()
    obj = common.loads_body(body)
    assert type(obj["x"]["__ndarray__"]) is str and obj["y"]["__ndarray__"] == claim
    with pytest.raises(MalformedRequestError) as err:
        codec.decode_response(body, "application/json", arrays=("x", "y"))
    assert err.value.field == "y"


def test_broken_json_is_reported_as_the_whole_body_would_be(monkeypatch) -> None:
    body = json.dumps({"x": _typed(np.ones(N))}).encode()[:-1] + b",}"
    with pytest.raises(MalformedRequestError) as lifted:
        codec.decode_response(body, "application/json", arrays=("x",))
    _whole(monkeypatch)
    with pytest.raises(MalformedRequestError) as whole:
        codec.decode_response(body, "application/json", arrays=("x",))
    assert str(lifted.value) == str(whole.value) and lifted.value.field == "body"


@pytest.mark.parametrize("junk", [b"\x01", b"\xff\xfe", "é".encode(), b" ", b"*"])
def test_bytes_that_are_not_base64_are_a_400_naming_the_field(junk: bytes) -> None:
    text = _b64(np.ones(N)).encode()
    text = text[:100] + junk + text[100 + len(junk):]  # the same length
    body = b'{"x": {"__ndarray__": "' + text + b'", "dtype": "float64", "shape": [%d]}}' % N
    with pytest.raises(MalformedRequestError) as err:
        codec.decode_response(body, "application/json", arrays=("x",))
    assert err.value.field in ("x", "body")


def test_unterminated_and_truncated_bodies_are_400s() -> None:
    body = json.dumps({"x": _typed(np.ones(N))}).encode()
    for cut in (body[: len(body) // 2], body[:-3], body + b"{"):
        with pytest.raises(MalformedRequestError):
            codec.decode_response(cut, "application/json", arrays=("x",))


def test_a_body_of_many_typed_arrays_is_parsed_whole() -> None:
    """Past ``LIFT_MAX_KEYS`` typed-array strings the body is parsed as it is: a sender
    can't make the server step through millions of keys in Python."""
    small = {f"s{i}": np.float64([i, -i]) for i in range(common.LIFT_MAX_KEYS + 1)}
    arrays = {"big": np.arange(N, dtype=np.float64), **small}
    body, _, _ = codec.encode_body(arrays, "b64")
    assert common._lift(body) is None
    obj = codec.decode_response(body, "application/json", arrays=tuple(arrays))
    assert np.array_equal(obj["big"], arrays["big"]) and np.array_equal(obj["s7"], [7, -7])
    fewer = dict(list(arrays.items())[: common.LIFT_MAX_KEYS])
    body, _, _ = codec.encode_body(fewer, "b64")
    assert common._lift(body) is not None


def test_typed_arrays_after_a_long_list_are_parsed_whole() -> None:
    """A body that opens with a long JSON list is not searched end to end."""
    lists = np.random.default_rng(2).standard_normal(20_000)
    body = json.dumps({"lists": lists.tolist(), "x": _typed(np.arange(N, dtype=np.float64))}).encode()
    assert common._lift(body) is None
    obj = codec.decode_response(body, "application/json", arrays=("lists", "x"))
    assert np.array_equal(obj["lists"], lists) and np.array_equal(obj["x"], np.arange(N))


def test_bodies_as_bytearray_and_memoryview_decode_the_same() -> None:
    arrays = _arrays()
    body, _, _ = codec.encode_body(arrays, "b64")
    for form in (bytearray(body), memoryview(body)):
        _same(_decoded(form), arrays)


# --- writing -------------------------------------------------------------------------


def _with_str(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _with_str(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_with_str(v) for v in tree]
    if type(tree) is common.RawString:
        return tree.text.decode("ascii")
    return tree


@pytest.mark.parametrize("orjson", [True, False], ids=["orjson", "stdlib-json"])
def test_raw_strings_write_the_bytes_a_str_would(monkeypatch, orjson: bool) -> None:
    if not orjson:
        monkeypatch.setattr(common, "orjson", None)
    arrays = {k: v for k, v in _arrays().items() if k != "nan"}
    tree = codec.from_tree({"a": arrays, "batch": [arrays["f64"], arrays["short"]],
                            "mixed": [1.5, {"x": arrays["f32"]}]}, "b64")
    assert type(tree["a"]["f64"]["__ndarray__"]) is common.RawString
    assert type(tree["a"]["short"]["__ndarray__"]) is str
    want = codec.dumps(_with_str(tree))
    assert codec.dumps(tree) == want
    assert b"".join(bytes(p) for p in codec.dumps_parts(tree)) == want


def test_large_b64_calls_go_as_parts_with_the_bytes_of_one_encoding() -> None:
    from dxcontract.backends import backend_to_json

    x = np.random.default_rng(5).standard_normal(N)
    payload = {"function": "rosenbrock", "backend": backend_to_json("jax-reverse"), "x": x}
    body, _, _ = codec.encode_body(payload, "b64")
    for _ in range(2):  # the second call reuses the text kept around x
        call = _models.operator_call("gradient", "rosenbrock", "jax-reverse", x, None, (),
                                     None, "b64")
        assert type(call) is _models.PartsCall and call.size == len(body)
        assert call.body == body
    assert any(p is not None and len(p) >= 4 * N for p in call.parts)  # the base64, unjoined
    prep = _models.operator_call("gradient", "rosenbrock", "jax-reverse", x, None, (), None,
                                 "b64", prepare=True)
    assert type(prep) is _models.Call  # kept with its handle: one body of its own


def test_large_b64_over_http_from_any_sender(server) -> None:
    """A large b64 gradient through the client, and posted as other languages write it."""
    x = np.random.default_rng(9).uniform(-2, 2, 50_000)
    with Client(server.url, encoding="b64") as client:
        np.testing.assert_array_equal(client.gradient("sum_of_squares", JaxReverse(), x), 2 * x)
        out = client.value_and_gradient("rosenbrock", JaxReverse(), x)
    xm, xp = x[:-1], x[1:]
    want = np.zeros_like(x)
    want[:-1] += -400 * xm * (xp - xm**2) - 2 * (1 - xm)
    want[1:] += 200 * (xp - xm**2)
    np.testing.assert_allclose(out[1], want, rtol=1e-12, atol=1e-9)
    body = json.dumps({"function": "sum_of_squares", "backend": {"type": "jax-reverse"},
                       "x": _typed(x)}, indent=1).replace("/", "\\/").encode()
    r = httpx.post(server.url + "/gradient", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200
    got = codec.decode_response(r.content, r.headers["content-type"], arrays=("gradient",))
    np.testing.assert_array_equal(got["gradient"], 2 * x)
    bad = body.replace(b'"__ndarray__": "', b'"__ndarray__": "!', 1)
    r = httpx.post(server.url + "/gradient", content=bad, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/problem")
    assert r.json()["field"] == "x"


def test_the_server_decodes_base64_bodies_on_the_event_loop_only_when_quick() -> None:
    from dxserve.pipeline import operators as routes

    x = np.random.default_rng(4).standard_normal(100_000)
    b64_body, _, _ = codec.encode_body({"x": x}, "b64")
    lists_body, _, _ = codec.encode_body({"x": x}, "json")
    mixed = json.dumps({"x": _typed(x), "c": x.tolist()}).encode()
    assert routes.decodes_quickly(b64_body, False, None)
    assert not routes.decodes_quickly(lists_body, False, None)
    assert not routes.decodes_quickly(mixed, False, None)  # most of it is JSON to parse
    huge = b'{"x": {"__ndarray__": "' + b"A" * (routes.B64_INLINE_BYTES + 4) + b'"}}'
    assert not routes.decodes_quickly(huge, False, None)


# --- fuzzed bodies ---------------------------------------------------------------------

_SPACE = st.sampled_from(["", " ", "\t", "\n ", "\r\n"])


@st.composite
def _bodies(draw: st.DrawFn) -> bytes:
    """JSON text with typed base64 arrays (long and short), other values around them,
    the whitespace other writers use, and now and then an escape or a look-alike."""
    members = []
    for i in range(draw(st.integers(1, 6))):
        kind = "long" if i == 0 else draw(st.sampled_from(["long", "short", "list", "nested", "text"]))
        if kind in ("long", "short"):
            size = draw(st.integers(3100, 9000) if kind == "long" else st.integers(0, 40))
            text = base64.b64encode(draw(st.binary(min_size=size, max_size=size))).decode()
            if draw(st.integers(0, 9)) == 0:
                text = text.replace("/", "\\/")  # an escape: the whole body is parsed
            if draw(st.integers(0, 19)) == 0:
                text = "\\u0000" + str(draw(st.integers(0, 3)))  # a look-alike placeholder
            value = (f'{{"__ndarray__"{draw(_SPACE)}:{draw(_SPACE)}"{text}",'
                     f'"dtype":"uint8","shape":[{size}]}}')
        elif kind == "list":
            value = json.dumps(draw(st.lists(st.floats(allow_nan=False), max_size=50)))
        elif kind == "nested":
            value = json.dumps({"__tuple__": [draw(st.lists(st.integers(), max_size=5))]})
        else:
            value = json.dumps(draw(st.text(max_size=30)))
        members.append(f'"k{i}"{draw(_SPACE)}:{draw(_SPACE)}{value}')
    text = "{" + ",".join(members)
    # mostly past the size from which strings are lifted, now and then just short of it
    padding = max(0, common.LIFT_MIN_BODY - len(text)) + draw(st.integers(-2, 100))
    return (text + " " * max(0, padding) + "}").encode()


def _as_text(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _as_text(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_as_text(v) for v in tree]
    return tree.tobytes().decode("ascii") if type(tree) is memoryview else tree


@settings(max_examples=150, deadline=None)
@given(_bodies())
def test_lifting_parses_any_body_as_a_whole_parse_does(body: bytes) -> None:
    try:
        want = common.loads(body)
    except MalformedRequestError as err:
        with pytest.raises(MalformedRequestError) as got:
            common.loads_body(body)
        assert str(got.value) == str(err)
        return
    assert _as_text(common.loads_body(body)) == want
    assert _as_text(common.loads_body(bytearray(body))) == want
