"""Wire codec: exact round-trips, strict JSON, zero-copy binary, precise errors."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dxcontract import codec, dtypes
from dxcontract.codec import (
    BINARY_TYPE,
    ENCODINGS,
    HEADER_LENGTH,
    JSON_TYPE,
    decode_body,
    decode_response,
    decode_result,
    encode_body,
    to_tree,
)
from dxcontract.encodings import common
from dxcontract.errors import (
    DtypeMismatchError,
    InvalidArgumentError,
    MalformedRequestError,
    UnsupportedMediaTypeError,
)

DTYPES = [
    "bfloat16", "float16", "float32", "float64",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "bool", "complex64", "complex128",
]  # fmt: skip
SHAPES = [(), (0,), (3,), (2, 3), (2, 0, 4)]


# --------------------------------------------------------------------------- helpers


def _raise_constant(name):
    raise AssertionError(f"invalid JSON constant {name}")


def strict_json(data: bytes):
    return json.loads(data, parse_constant=_raise_constant)


def sample(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Edge values of ``dtype`` tiled into ``shape``."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if dt.kind == "b":
        base = np.array([True, False, False, True, True])
    elif dt.kind in "iu":
        info = np.iinfo(dt)
        base = np.array([info.min, info.max, 0, 1, info.max - 1, 7], dtype=dt)
    else:
        ft = np.dtype("float32") if dt == np.complex64 else np.dtype(dt.name)
        if dt.kind == "c":
            ft = np.dtype("float64") if dt == np.complex128 else ft
        fi = dtypes.finfo(ft)
        base = np.array(
            [-0.0, 0.1, np.nan, np.inf, -np.inf, fi.smallest_subnormal, fi.max, fi.min, 1.0],
            dtype=ft,
        )
        if dt.kind == "c":
            re, im = base, np.roll(base, 3)
            base = np.empty(len(base), dtype=dt)
            base.real, base.imag = re, im
    return np.resize(base, n).reshape(shape).astype(dt)


def assert_identical(got: np.ndarray, want: np.ndarray) -> None:
    """Same dtype, shape and bits (any NaN matches any NaN)."""
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    if want.dtype.kind == "c":
        parts = [(got.real, want.real), (got.imag, want.imag)]
    else:
        parts = [(got, want)]
    for g, w in parts:
        g, w = np.ascontiguousarray(g), np.ascontiguousarray(w)
        if dtypes.kind(w.dtype) == "f":
            nan = np.isnan(w)
            assert np.array_equal(np.isnan(g), nan)
            g, w = g[~nan], w[~nan]
        assert g.tobytes() == w.tobytes()


def roundtrip(payload: dict, encoding: str) -> tuple[dict, bytes]:
    body, ctype, headers = encode_body(payload, encoding)
    assert isinstance(body, bytes)
    if encoding == "binary":
        assert ctype == BINARY_TYPE and HEADER_LENGTH in headers
    else:
        assert ctype == JSON_TYPE and headers == {}
        strict_json(body)
    return decode_body(body, ctype, headers.get(HEADER_LENGTH)), body


def rt_array(a, encoding: str) -> np.ndarray:
    decoded, _ = roundtrip({"x": a}, encoding)
    return to_tree(decoded["x"], "x")


# --------------------------------------------------------------------------- round-trips


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_roundtrip_every_dtype_and_shape(encoding, dtype, shape):
    a = sample(dtype, shape)
    assert_identical(rt_array(a, encoding), a)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "int32", "bool", "complex128"])
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_roundtrip_pytree(encoding, dtype):
    tree = {"w": sample(dtype, (2, 3)), "b": {"c": sample(dtype, (4,))}}
    got = rt_array(tree, encoding)
    assert set(got) == {"w", "b"} and set(got["b"]) == {"c"}
    assert_identical(got["w"], tree["w"])
    assert_identical(got["b"]["c"], tree["b"]["c"])


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_batches_and_plain_values(encoding):
    a1, a2 = sample("float64", (3,)), sample("float32", (2, 2))
    payload = {
        "pushforwards": (a1, a2),
        "contexts": [{"w": a1}, a2],
        "value": np.float64(2.5),
        "scalar": np.nan,
        "prep": "handle-123",
        "n": 3,
        "meta": {"ok": True, "name": "x"},
    }
    decoded, _ = roundtrip(payload, encoding)
    pf = decode_result(decoded["pushforwards"], "pushforwards", is_batch=True)
    assert isinstance(pf, list) and len(pf) == 2
    assert_identical(pf[0], a1)
    assert_identical(pf[1], a2)
    ctx = decode_result(decoded["contexts"], "contexts", True)
    assert_identical(ctx[0]["w"], a1)
    assert_identical(ctx[1], a2)
    value = decode_result(decoded["value"], "value")
    assert value.shape == () and value == 2.5
    assert np.isnan(to_tree(decoded["scalar"], "scalar"))
    assert decoded["prep"] == "handle-123" and decoded["n"] == 3
    assert decoded["meta"] == {"ok": True, "name": "x"}


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_decode_response(encoding):
    g, hv = sample("float64", (2, 3)), [sample("float64", (3,))] * 2
    body, ctype, headers = encode_body({"gradient": g, "hvps": hv, "prep": "p"}, encoding)
    out = decode_response(
        body, ctype, headers.get(HEADER_LENGTH), arrays=["gradient"], batches=["hvps"]
    )
    assert_identical(out["gradient"], g)
    assert len(out["hvps"]) == 2
    assert_identical(out["hvps"][1], hv[1])
    assert out["prep"] == "p"


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_big_endian_and_non_contiguous_inputs(encoding):
    a = sample("float64", (3, 4))
    be = a.astype(">f8")
    got = rt_array(be, encoding)
    assert got.dtype == np.dtype("<f8")
    assert_identical(got, a)
    assert_identical(rt_array(a.T, encoding), np.ascontiguousarray(a.T))
    assert_identical(rt_array(a[:, ::2], encoding), np.ascontiguousarray(a[:, ::2]))
    i = np.arange(12, dtype=">i4").reshape(3, 4)
    assert_identical(rt_array(i, encoding), i.astype("<i4"))


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_jax_arrays(encoding):
    jnp = pytest.importorskip("jax.numpy")
    a = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)
    assert_identical(rt_array(a, encoding), np.asarray(a))


# --------------------------------------------------------------------------- wire forms


def test_json_wire_forms():
    body, _, _ = encode_body(
        {
            "f64": np.array([1.0, np.nan, np.inf, -np.inf, -0.0]),
            "s": np.float64(np.inf),
            "f32": np.array([0.5], np.float32),
            "b": np.array([True, False]),
            "c": np.array([1 + 2j]),
            "e": np.zeros((0, 3)),
        },
        "json",
    )
    d = strict_json(body)
    assert d["f64"] == [1.0, "NaN", "Infinity", "-Infinity", -0.0]
    assert d["s"] == "Infinity"
    assert d["f32"] == {"__ndarray__": [0.5], "dtype": "float32", "shape": [1]}
    assert d["b"] == {"__ndarray__": [True, False], "dtype": "bool", "shape": [2]}
    assert d["c"] == {"__ndarray__": [[1.0, 2.0]], "dtype": "complex128", "shape": [1]}
    # a 0 before the last axis cannot be carried by a bare list: typed object
    assert d["e"] == {"__ndarray__": [], "dtype": "float64", "shape": [0, 3]}


def test_b64_wire_form():
    body, _, _ = encode_body({"x": np.array([1.0, 2.0])}, "b64")
    d = strict_json(body)
    raw = np.array([1.0, 2.0], "<f8").tobytes()
    assert d == {
        "x": {"__ndarray__": base64.b64encode(raw).decode(), "dtype": "float64", "shape": [2]}
    }


def test_binary_wire_form_aligned_and_zero_copy():
    a = np.arange(5, dtype=np.float64)
    b = np.arange(7, dtype=np.int16).reshape(7, 1)
    body, ctype, headers = encode_body({"x": a, "tangents": [{"w": b}, a]}, "binary")
    n = int(headers[HEADER_LENGTH])
    assert n % 64 == 0 and len(body) % 64 == 0
    header = strict_json(body[:n])
    assert header["x"] == {
        "__ndarray__": {"offset": 0, "nbytes": 40},
        "dtype": "float64",
        "shape": [5],
    }
    assert header["tangents"][0]["w"]["__ndarray__"] == {"offset": 64, "nbytes": 14}
    decoded = decode_body(body, ctype, headers[HEADER_LENGTH])
    base = np.frombuffer(body, np.uint8)
    start = base.__array_interface__["data"][0]
    for arr, want in [
        (decoded["x"], a),
        (decoded["tangents"][0]["w"], b),
        (decoded["tangents"][1], a),
    ]:
        assert isinstance(arr, np.ndarray)
        assert np.shares_memory(arr, base)
        assert (arr.__array_interface__["data"][0] - start) % 64 == 0
        assert arr.flags.aligned and not arr.flags.writeable
        assert_identical(arr, want)
    # to_tree passes the views through untouched
    assert to_tree(decoded["x"], "x") is decoded["x"]


def test_content_type_parameters_and_bytes_like_bodies():
    body, _, _ = encode_body({"x": np.ones(2)}, "json")
    d = decode_body(bytearray(body), "Application/JSON; charset=utf-8", None)
    assert_identical(to_tree(d["x"], "x"), np.ones(2))
    body, ctype, h = encode_body({"x": np.ones(2)}, "binary")
    d = decode_body(memoryview(body), ctype, h[HEADER_LENGTH])
    assert_identical(d["x"], np.ones(2))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_every_16_bit_float_round_trips(encoding, dtype):
    """All 65536 bit patterns: bit for bit in binary and b64; in JSON every value
    exactly (each is a float64, whose shortest repr reads back the same), NaNs as NaN."""
    a = np.arange(2**16, dtype=np.uint16).view(np.dtype(dtype)).reshape(256, 256)
    got = rt_array(a, encoding)
    assert got.dtype == np.dtype(dtype) and got.shape == a.shape
    if encoding != "json":
        assert got.tobytes() == a.tobytes()
        return
    nan = np.isnan(a)
    assert np.array_equal(np.isnan(got), nan)
    assert got[~nan].tobytes() == a[~nan].tobytes()  # -0.0, subnormals and infinities too


def test_json_numbers_typed_bfloat16():
    x = to_tree({"__ndarray__": [0.1, 2, "-Infinity", 1e-45], "dtype": "bfloat16",
                 "shape": [4]}, "x")
    assert x.dtype == dtypes.BFLOAT16
    want = np.array([0.1, 2.0, -np.inf, 1e-45]).astype(dtypes.BFLOAT16)  # nearest, to zero
    assert x.tobytes() == want.tobytes()
    assert to_tree({"__ndarray__": "NaN", "dtype": "bfloat16", "shape": []}, "x").dtype == (
        dtypes.BFLOAT16
    )
    body = b'{"x": {"__ndarray__": [[1.5, 3], [0.25, -1]], "dtype": "bfloat16", "shape": [2, 2]}}'
    got = to_tree(decode_body(body, JSON_TYPE, None)["x"], "x")
    assert got.dtype == dtypes.BFLOAT16 and got.astype(float).tolist() == [[1.5, 3], [0.25, -1]]
    with pytest.raises(MalformedRequestError, match="out of range for bfloat16") as e:
        to_tree({"__ndarray__": [1.0, 1e39], "dtype": "bfloat16", "shape": [2]}, "x")
    assert e.value.field == "x"
    with pytest.raises(MalformedRequestError) as e:  # the slow path names the element
        to_tree({"__ndarray__": [1.0, "one"], "dtype": "bfloat16", "shape": [2]}, "x")
    assert e.value.field == "x[1]"
    # b64 of bfloat16 is its two bytes a value, little-endian: 1.0 is 0x3f80
    wire = codec.from_tree(np.array([1.0], dtypes.BFLOAT16), "b64")
    assert wire == {"__ndarray__": base64.b64encode(b"\x80\x3f").decode(), "dtype": "bfloat16",
                    "shape": [1]}


def test_plain_lists_default_dtype():
    assert to_tree([1, 2, 3], "x").dtype == np.float64
    x = to_tree([[1, 2.5]], "x", default_dtype=np.float32)
    assert x.dtype == np.float32 and x.shape == (1, 2)
    assert to_tree(3, "x").shape == ()
    assert np.isnan(to_tree(["NaN"], "x")[0])
    assert to_tree([[], []], "x").shape == (2, 0)
    assert to_tree([1, 2], "x", default_dtype=np.int32).dtype == np.int32
    with pytest.raises(MalformedRequestError) as e:
        to_tree([1, 2.5], "x", default_dtype=np.int32)
    assert e.value.field == "x[1]"


def test_encode_rejects_unsupported():
    with pytest.raises(DtypeMismatchError) as e:
        encode_body({"x": {"w": np.array(["a"])}}, "json")
    assert e.value.field == "x.w"
    with pytest.raises(DtypeMismatchError):
        encode_body({"x": np.zeros(2, np.float128 if hasattr(np, "float128") else object)}, "b64")
    with pytest.raises(InvalidArgumentError) as e:
        encode_body({"x": {"__w": np.ones(1)}}, "binary")
    assert e.value.field == "x.__w"
    with pytest.raises(ValueError):
        encode_body({"x": 1}, "xml")


def test_large_list_fast_path_with_nan():
    a = np.random.default_rng(0).random(200_000)
    a[::997] = np.nan
    assert_identical(rt_array(a, "json"), a)
    assert_identical(rt_array(a.reshape(400, 500), "json"), a.reshape(400, 500))


# --------------------------------------------------------------------------- malformed


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


def _deep(n):
    v = [1.0]
    for _ in range(n):
        v = [v]
    return v


def _b64(a) -> str:
    return base64.b64encode(np.asarray(a).tobytes()).decode()


def _binary(header: dict, buffers: bytes = bytes(128), pad: bool = True):
    h = json.dumps(header).encode()
    if pad:
        h += b" " * (-len(h) % 64)
    return h + buffers, str(len(h))


def _ref(offset=0, nbytes=24, dtype="float64", shape=(3,)):
    return {
        "__ndarray__": {"offset": offset, "nbytes": nbytes},
        "dtype": dtype,
        "shape": list(shape),
    }


def _typed(data, dtype="float32", shape=(2,)):
    return {"__ndarray__": data, "dtype": dtype, "shape": list(shape)}


M, D = MalformedRequestError, DtypeMismatchError
# fmt: off
# (id, request object, field to decode, is_batch, error class, expected error field)
JSON_CASES = [
    ("ragged", {"x": [[1, 2], [3]]}, "x", False, M, "x[1]"),
    ("ragged-deeper", {"x": [[1, 2], [3, [4]]]}, "x", False, M, "x[1][1]"),
    ("ragged-scalar-row", {"x": [[1, 2], 3]}, "x", False, M, "x[1]"),
    ("bad-string", {"x": [1.0, "nan"]}, "x", False, M, "x[1]"),
    ("nested-bad-string", {"x": [[1, 2], [3, "foo"]]}, "x", False, M, "x[1][1]"),
    ("bool-in-list", {"x": [1.0, True]}, "x", False, M, "x[1]"),
    ("only-bools", {"x": [False, True]}, "x", False, M, "x[0]"),
    ("bool-scalar", {"x": True}, "x", False, M, "x"),
    ("null-in-list", {"x": [1.0, None]}, "x", False, M, "x[1]"),
    ("null", {"x": None}, "x", False, M, "x"),
    ("string-scalar", {"x": "1.5"}, "x", False, M, "x"),
    ("too-deep-list", {"x": _deep(40)}, "x", False, M, "x"),
    ("list-of-objects", {"x": [{"a": 1.0}]}, "x", False, M, "x[0]"),
    ("reserved-key", {"x": {"__w": [1.0]}}, "x", False, M, "x.__w"),
    ("pytree-leaf", {"x": {"w": {"v": [1, "a"]}}}, "x", False, M, "x.w.v[1]"),
    ("batch-leaf", {"contexts": [[1.0], {"w": [None]}]}, "contexts", True, M, "contexts[1].w[0]"),
    ("batch-not-list", {"tangents": 1.0}, "tangents", True, M, "tangents"),
    ("b64-bad-chars", {"x": _typed("!!!!!!!!!!!=", "float32", (2,))}, "x", False, M, "x"),
    ("b64-wrong-length", {"x": _typed(_b64([1.0]), "float64", (2,))}, "x", False, M, "x"),
    ("b64-bad-padding", {"x": _typed("AAAAAAAAAAA", "float64", (1,))}, "x", False, M, "x"),
    ("negative-shape", {"x": _typed(_b64([1.0]), "float64", (-1,))}, "x", False, M, "x"),
    ("float-shape", {"x": {"__ndarray__": [1.0], "dtype": "float32", "shape": [1.0]}}, "x", False, M, "x"),
    ("bool-shape", {"x": {"__ndarray__": [1.0], "dtype": "float32", "shape": [True]}}, "x", False, M, "x"),
    ("shape-not-list", {"x": {"__ndarray__": [1.0], "dtype": "float32", "shape": 1}}, "x", False, M, "x"),
    ("bad-dtype", {"x": _typed([1.0, 2.0], "float128")}, "x", False, D, "x"),
    ("object-dtype", {"tangents": [_typed([1, 2], "object")]}, "tangents", True, D, "tangents[0]"),
    ("dtype-not-string", {"x": _typed([1.0, 2.0], 5)}, "x", False, M, "x"),
    ("extra-key", {"x": {**_typed([1.0, 2.0]), "order": "C"}}, "x", False, M, "x"),
    ("missing-shape", {"x": {"__ndarray__": [1.0], "dtype": "float32"}}, "x", False, M, "x"),
    ("data-shape-mismatch", {"x": _typed([1.0, 2.0, 3.0])}, "x", False, M, "x"),
    ("int-with-float", {"x": _typed([1, 2.5], "int32")}, "x", False, M, "x[1]"),
    ("int-out-of-range", {"x": _typed([1, 300], "int8")}, "x", False, M, "x"),
    ("uint-negative", {"x": _typed([-1, 3], "uint64")}, "x", False, M, "x"),
    ("bool-with-number", {"x": _typed([1, True], "bool")}, "x", False, M, "x[0]"),
    ("float32-overflow", {"x": _typed([1e300, 1.0], "float32")}, "x", False, M, "x"),
    ("complex-not-pairs", {"x": _typed([1.0, 2.0], "complex128")}, "x", False, M, "x"),
    ("buffer-ref-in-json", {"x": _ref()}, "x", False, M, "x"),
]
# fmt: on


@pytest.mark.parametrize("case", JSON_CASES, ids=[c[0] for c in JSON_CASES])
def test_malformed_json_values(case):
    _, obj, field, is_batch, exc, where = case
    with pytest.raises(exc) as e:
        decoded = decode_body(_json(obj), JSON_TYPE, None)
        decode_result(decoded[field], field, is_batch)
    assert e.value.field == where, str(e.value)
    assert e.value.detail


# fmt: off
BODY_CASES = [
    ("invalid-json", b'{"x": [1, 2', JSON_TYPE, None, M, "body"),
    ("not-an-object", b"[1, 2]", JSON_TYPE, None, M, "body"),
    ("bare-nan", b'{"x": [NaN]}', JSON_TYPE, None, M, "body"),
    ("bare-infinity", b'{"x": Infinity}', JSON_TYPE, None, M, "body"),
    ("not-utf8", b'{"x": "\xff"}', JSON_TYPE, None, M, "body"),
    ("media-type", b"{}", "text/plain", None, UnsupportedMediaTypeError, "Content-Type"),
    ("no-media-type", b"{}", None, None, UnsupportedMediaTypeError, "Content-Type"),
    ("no-header-length", *(_binary({"x": _ref()})[:1]), BINARY_TYPE, None, M, HEADER_LENGTH),
    ("header-length-text", _binary({"x": _ref()})[0], BINARY_TYPE, "abc", M, HEADER_LENGTH),
    ("header-length-negative", _binary({"x": _ref()})[0], BINARY_TYPE, "-64", M, HEADER_LENGTH),
    ("header-length-zero", _binary({"x": _ref()})[0], BINARY_TYPE, "0", M, HEADER_LENGTH),
    ("header-length-past-body", _binary({"x": _ref()})[0], BINARY_TYPE, "100000", M, HEADER_LENGTH),
    ("header-too-short", _binary({"x": _ref()})[0], BINARY_TYPE, "10", M, "header"),
    ("header-not-object", _binary([1])[0], BINARY_TYPE, "64", M, "header"),
    ("offset-past-end", *_binary({"x": _ref(offset=120)}), M, "x"),
    ("offset-way-past-end", *_binary({"x": _ref(offset=10**12)}), M, "x"),
    ("nbytes-lies", *_binary({"x": _ref(nbytes=16)}), M, "x"),
    ("nbytes-huge", *_binary({"x": _ref(nbytes=8 * 10**9, shape=(10**9,))}), M, "x"),
    ("negative-offset", *_binary({"x": _ref(offset=-8)}), M, "x"),
    ("string-offset", *_binary({"x": _ref(offset="0")}), M, "x"),
    ("bool-nbytes", *_binary({"x": _ref(nbytes=True, shape=(), dtype="bool")}), M, "x"),
    ("ref-extra-key", *_binary({"x": {**_ref(), "__ndarray__": {"offset": 0, "nbytes": 24, "x": 1}}}), M, "x"),
    ("nested-lie", *_binary({"tangents": [_ref(), {"w": _ref(offset=200)}]}), M, "tangents[1].w"),
    ("binary-bad-dtype", *_binary({"x": _ref(dtype="float128")}), D, "x"),
    ("binary-negative-shape", *_binary({"x": _ref(shape=(-3,))}), M, "x"),
]
# fmt: on


def _bctype(case):
    # cases built with *_binary(...) carry (body, header_length) and need BINARY_TYPE
    if len(case) == 5:
        name, body, hl, exc, where = case
        return name, body, BINARY_TYPE, hl, exc, where
    return case


BODY_CASES = [_bctype(c) for c in BODY_CASES]


@pytest.mark.parametrize("case", BODY_CASES, ids=[c[0] for c in BODY_CASES])
def test_malformed_bodies(case):
    _, body, ctype, header_length, exc, where = case
    with pytest.raises(exc) as e:
        decode_body(body, ctype, header_length)
    assert e.value.field == where, str(e.value)


def test_python_values_that_json_parsers_may_produce():
    # stdlib json yields huge ints; orjson refuses them at parse time
    with pytest.raises(MalformedRequestError) as e:
        to_tree([1.0, 10**400], "x")
    assert e.value.field == "x[1]"
    big = to_tree(_typed([0, 2**64 - 1], "uint64"), "x")
    assert big.dtype == np.uint64 and big[1] == 2**64 - 1
    with pytest.raises(MalformedRequestError):
        decode_body(b'{"x": [1e999]}', JSON_TYPE, None)


def test_header_length_limit():
    body, ctype, h = encode_body({"x": np.ones(3)}, "binary")
    with pytest.raises(MalformedRequestError) as e:
        decode_body(body, ctype, h[HEADER_LENGTH], max_header_bytes=32)
    assert e.value.field == HEADER_LENGTH


def test_deep_pytree_and_json_do_not_crash():
    tree: dict = {"w": [1.0]}
    for _ in range(100):
        tree = {"a": tree}
    with pytest.raises(MalformedRequestError):
        to_tree(tree, "x")
    deep = b'{"x":' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(MalformedRequestError):
        decode_body(deep, JSON_TYPE, None)


def test_errors_render_as_problems():
    with pytest.raises(MalformedRequestError) as e:
        to_tree([[1.0], [2.0, 3.0]], "x")
    from dxserve.http.problems import problem_document  # the HTTP layer renders it

    problem = problem_document(e.value)
    assert problem["status"] == 400 and problem["field"] == "x[1]"


# --------------------------------------------------------------------------- property


_shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)


@st.composite
def float_arrays(draw):
    dtype = draw(st.sampled_from([np.dtype("float64"), np.dtype("float32"), np.dtype(">f8")]))
    width = 32 if dtype.itemsize == 4 else 64
    return draw(hnp.arrays(dtype, _shapes, elements=st.floats(width=width)))


@settings(max_examples=100, deadline=None)
@given(a=float_arrays(), encoding=st.sampled_from(tuple(ENCODINGS)))
def test_property_float_roundtrip(a, encoding):
    got = rt_array(a, encoding)
    assert_identical(got, a.astype(a.dtype.newbyteorder("<")))
    got = rt_array({"t": {"u": a}}, encoding)
    assert_identical(got["t"]["u"], a.astype(a.dtype.newbyteorder("<")))


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_without_orjson(monkeypatch, encoding):
    """The client may run without orjson: stdlib json must give the same results."""
    monkeypatch.setattr(common, "orjson", None)
    for dtype in DTYPES:
        for shape in [(), (2, 3), (2, 0, 4)]:
            a = sample(dtype, shape)
            assert_identical(rt_array(a, encoding), a)
    with pytest.raises(MalformedRequestError):
        decode_body(b'{"x": [NaN]}', JSON_TYPE, None)
    with pytest.raises(MalformedRequestError):
        decode_body(b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}", JSON_TYPE, None)


def test_module_constants():
    assert tuple(codec.ENCODINGS) == ("json", "b64", "binary")
    assert codec.MARKER == "__ndarray__"
    assert len(codec.ALLOWED_DTYPES) == 15
