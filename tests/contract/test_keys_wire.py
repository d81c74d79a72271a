"""Typed PRNG keys in every wire encoding: round trips per implementation and shape, the
exact wire forms, and every malformed key a 4xx naming its field (``dxcontract.keys``).

No JAX here: a key is its implementation's name and uint32 words (the words
``jax.random.key_data`` gives are checked against JAX in tests/client/test_keys_client.py).
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from dxcontract import codec
from dxcontract.encodings import ENCODINGS, common
from dxcontract.encodings.common import MAX_DEPTH, MAX_ELEMENTS, SeqNode, pytree_to_wire
from dxcontract.errors import (
    DtypeMismatchError,
    InvalidArgumentError,
    MalformedRequestError,
    ShapeMismatchError,
)
from dxcontract.keys import IMPLS, KeyArray, dtype_name, read_key

#: every registered encoding (the built-in ones at collection): each carries keys
ENCODING_NAMES = tuple(ENCODINGS)
SHAPES = ((), (3,), (2, 3), (0,), (4, 0))
WORDS = {"threefry2x32": 2, "rbg": 4, "unsafe_rbg": 4}


def words(impl: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """uint32 words for keys of ``shape``, spread over the whole uint32 range."""
    rng = np.random.default_rng(seed)
    full = (*shape, WORDS[impl])
    return rng.integers(0, 2**32, size=full, dtype=np.uint64).astype(np.uint32)


def encode(payload: dict, encoding: str) -> tuple[bytes, str, str | None]:
    body, media, headers = codec.encode_body(payload, encoding)
    parts, _, _ = codec.encode_body_parts(payload, encoding)
    assert b"".join(bytes(p) for p in parts) == body  # one wire form, whole or in parts
    return body, media, headers.get(codec.HEADER_LENGTH)


def decode(body: bytes, media: str, header_length: str | None, field: str = "contexts") -> Any:
    obj = codec.decode_body(body, media, header_length)
    return codec.decode_result(obj[field], field, True)


def test_the_implementations_are_jaxs_built_in_ones() -> None:
    assert {name: impl.words for name, impl in IMPLS.items()} == {
        "threefry2x32": (2,), "rbg": (4,), "unsafe_rbg": (4,)
    }
    assert common.KEY_DTYPES == ("key<threefry2x32>", "key<rbg>", "key<unsafe_rbg>")
    # JAX's own dtype spellings name the same implementations
    assert dtype_name("key<fry>") == "key<threefry2x32>"
    assert dtype_name("key<urbg>") == "key<unsafe_rbg>"
    assert dtype_name("key<rbg>") == "key<rbg>"
    assert dtype_name(np.dtype("float32")) == "float32"
    assert set(ENCODING_NAMES) >= {"json", "b64", "binary"}


@pytest.mark.parametrize("encoding", ENCODING_NAMES)
@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_keys_round_trip(encoding: str, impl: str, shape: tuple[int, ...]) -> None:
    key = KeyArray(impl, words(impl, shape))
    assert key.shape == shape and key.dtype == f"key<{impl}>" and key.ndim == len(shape)
    contexts = [key, {"k": key, "pair": (key, np.float32(2.5))}, np.arange(3.0)]
    payload = {"x": np.ones(2), "contexts": [pytree_to_wire(c) for c in contexts]}
    body, media, header_length = encode(payload, encoding)
    for _ in range(2):  # binary: the second body of a header is read from its layout
        got = decode(body, media, header_length)
        assert type(got[0]) is KeyArray and got[0] == key
        assert got[0].data.dtype == np.dtype("<u4") and got[0].data.shape == key.data.shape
        np.testing.assert_array_equal(got[0].data, key.data)
        assert got[1]["k"] == key and got[1]["pair"][0] == key
        assert got[1]["pair"][1].dtype == np.float32 and got[1]["pair"][1] == 2.5
        np.testing.assert_array_equal(got[2], np.arange(3.0))


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_the_wire_forms(impl: str) -> None:
    data = words(impl, (2,), seed=1)
    key = KeyArray(impl, data)
    name = f"key<{impl}>"
    as_json = json.loads(encode({"k": key}, "json")[0])["k"]
    assert as_json == {"__ndarray__": data.tolist(), "dtype": name, "shape": [2]}
    as_b64 = json.loads(encode({"k": key}, "b64")[0])["k"]
    assert as_b64 == {
        "__ndarray__": base64.b64encode(data.astype("<u4").tobytes()).decode(),
        "dtype": name, "shape": [2],
    }
    body, media, header_length = encode({"k": key}, "binary")
    header = json.loads(body[: int(header_length)])["k"]
    assert header == {"__ndarray__": {"offset": 0, "nbytes": data.size * 4}, "dtype": name,
                      "shape": [2]}
    start = int(header_length)
    assert body[start : start + data.size * 4] == data.astype("<u4").tobytes()
    # one key: the typed array has shape [] and its words as data
    one = json.loads(encode({"k": KeyArray(impl, data[0])}, "json")[0])["k"]
    assert one == {"__ndarray__": data[0].tolist(), "dtype": name, "shape": []}


def test_hand_written_bodies_decode() -> None:
    """What a client in another language writes: list data, base64 data, a key among the
    results of an answer (``decode_response``)."""
    body = json.dumps({
        "contexts": [
            {"__ndarray__": [0, 42], "dtype": "key<threefry2x32>", "shape": []},
            {"__ndarray__": base64.b64encode(np.array([[1, 2, 3, 4]], "<u4").tobytes()).decode(),
             "dtype": "key<rbg>", "shape": [1]},
            {"__ndarray__": [[4294967295, 0, 1, 2]], "dtype": "key<unsafe_rbg>", "shape": [1]},
        ],
        "value": {"__tuple__": [1.5, {"__ndarray__": [7, 8], "dtype": "key<threefry2x32>",
                                       "shape": []}]},
    }).encode()
    got = decode(body, codec.JSON_TYPE, None)
    assert got == [
        KeyArray("threefry2x32", np.array([0, 42])),
        KeyArray("rbg", np.array([[1, 2, 3, 4]])),
        KeyArray("unsafe_rbg", np.array([[4294967295, 0, 1, 2]])),
    ]
    answer = codec.decode_response(body, codec.JSON_TYPE, arrays=("value",))
    y, key = answer["value"]
    assert float(y) == 1.5 and key == KeyArray("threefry2x32", np.array([7, 8], np.uint32))


def test_results_holding_keys_encode_as_the_server_answers() -> None:
    """A function's value ``(y, new_key)`` marked for the wire, as ``results_to_wire`` does."""
    key = KeyArray("threefry2x32", np.array([1797259609, 2579123966], np.uint32))
    for encoding in ENCODING_NAMES:
        payload = {"value": common.mark_sequences((np.array(14.5), key))}
        assert type(payload["value"]) is SeqNode
        body, media, header_length = encode(payload, encoding)
        obj = codec.decode_response(body, media, header_length, arrays=("value",))
        y, back = obj["value"]
        assert float(y) == 14.5 and back == key


@pytest.mark.parametrize("encoding", ("b64", "binary"))
def test_many_keys_in_a_large_body(encoding: str) -> None:
    """Large bodies take the fast paths: long base64 strings lifted out before parsing,
    binary buffers as views."""
    key = KeyArray("threefry2x32", words("threefry2x32", (6000,), seed=2))
    x = np.linspace(0.0, 1.0, 5000)
    body, media, header_length = encode({"x": x, "contexts": [key]}, encoding)
    assert len(body) > common.LIFT_MIN_BODY
    obj = codec.decode_body(body, media, header_length, arrays=("x",))
    assert codec.to_tree(obj["contexts"][0], "contexts[0]") == key
    np.testing.assert_array_equal(codec.to_tree(obj["x"], "x"), x)


def test_flat_json_lists_beside_a_key() -> None:
    """A long JSON list under x is parsed straight into float64; the key beside it is a
    typed object, parsed as usual."""
    x = np.linspace(-1.0, 1.0, 4000)
    key = KeyArray("rbg", words("rbg", (), seed=3))
    body = codec.encode_body({"x": x, "contexts": [key]}, "json")[0]
    obj = codec.decode_body(body, codec.JSON_TYPE, None, arrays=("x",))
    assert type(obj["x"]) is np.ndarray  # lifted
    assert codec.to_tree(obj["contexts"][0], "contexts[0]") == key


# --------------------------------------------------------------------------- KeyArray


def test_key_array_checks_what_it_is_given() -> None:
    key = KeyArray("rbg", [[1, 2, 3, 4], [5, 6, 7, 8]])
    assert key.shape == (2,) and key.data.dtype == np.uint32 and key.nbytes == 32
    assert key == KeyArray("rbg", np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.uint64))
    assert key != KeyArray("unsafe_rbg", key.data) and key != KeyArray("rbg", key.data[:1])
    assert "rbg" in repr(key) and "(2,)" in repr(key)
    with pytest.raises(AttributeError):
        key.impl = "threefry2x32"  # type: ignore[misc]
    with pytest.raises(TypeError):
        hash(key)
    with pytest.raises(DtypeMismatchError, match="key<threefry2x32>"):
        KeyArray("philox", [0, 0])
    with pytest.raises(DtypeMismatchError, match="uint32 words"):
        KeyArray("threefry2x32", [0.5, 1.0])
    with pytest.raises(DtypeMismatchError, match="uint32 words"):
        KeyArray("threefry2x32", [-1, 0])
    with pytest.raises(DtypeMismatchError, match="uint32 words"):
        KeyArray("threefry2x32", [2**32, 0])
    with pytest.raises(ShapeMismatchError, match=r"\[2\] uint32 words"):
        KeyArray("threefry2x32", [0, 0, 0])
    with pytest.raises(ShapeMismatchError):
        KeyArray("rbg", 7)


def test_a_typed_key_of_an_unknown_framework_is_refused_naming_the_field() -> None:
    class ForeignKey:
        """An array with a key dtype that no registered reader knows."""

        dtype = type("KeyDtype", (), {"__str__": lambda self: "key<fry>"})()
        shape = ()

        def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
            raise TypeError("no numpy array of a key")

    assert read_key(np.arange(3)) is None and read_key(KeyArray("rbg", [1, 2, 3, 4])) is not None
    with pytest.raises(InvalidArgumentError, match="import dxclient") as err:
        codec.encode_body({"contexts": [ForeignKey()]}, "json")
    assert err.value.field == "contexts[0]"


def test_an_encoding_without_typed_arrays_cannot_carry_keys() -> None:
    class Bare(common.JsonBody):
        name = "bare"

        def encode_array(self, a: np.ndarray, buffers: Any, field: str) -> Any:
            return a.tolist()

    with pytest.raises(InvalidArgumentError, match="cannot carry PRNG keys") as err:
        common.encode_tree({"k": KeyArray("rbg", [1, 2, 3, 4])}, Bare(), None, "")
    assert err.value.field == "k"


# --------------------------------------------------------------------------- malformed


def _json(*contexts: Any) -> bytes:
    return json.dumps({"contexts": list(contexts)}).encode()


def _key(data: Any, dtype: str = "key<threefry2x32>", shape: Any = ()) -> dict:
    return {"__ndarray__": data, "dtype": dtype, "shape": list(shape) if isinstance(shape, tuple)
            else shape}


MALFORMED_JSON = [
    # (the context, the error class, words its detail must hold)
    (_key([0, 0], "key<philox4x32>"), DtypeMismatchError, "key<threefry2x32>"),
    (_key([0, 0], "key<fry>"), DtypeMismatchError, "JAX's short spelling"),
    (_key([0, 0], "key<threefry2x32"), DtypeMismatchError, "key<IMPL>"),
    (_key([0, 0], "key<>"), DtypeMismatchError, "key<rbg>"),
    (_key([0, 0, 0]), ShapeMismatchError, "needs [2] uint32 words"),
    (_key([[0, 0], [0, 0]], shape=(3,)), ShapeMismatchError, "needs [3, 2] uint32 words"),
    (_key([0, 0, 0, 0], "key<rbg>", (2,)), ShapeMismatchError, "needs [2, 4] uint32 words"),
    (_key(5), ShapeMismatchError, "needs [2] uint32 words"),
    (_key([[0, 0], [0]], shape=(2,)), DtypeMismatchError, "ragged"),
    (_key([0.5, 1.0]), DtypeMismatchError, "uint32 words"),
    (_key([0.0, 1.0]), DtypeMismatchError, "uint32 words"),
    (_key([-1, 0]), DtypeMismatchError, "out of range for uint32"),
    (_key([2**32, 0]), DtypeMismatchError, "out of range for uint32"),
    (_key([True, False]), DtypeMismatchError, "booleans are not numbers"),
    (_key(["0", "0"]), DtypeMismatchError, "uint32 words"),
    (_key([None, 0]), DtypeMismatchError, "uint32 words"),
    (_key("AAAA"), ShapeMismatchError, "4 base64 characters, not 12"),
    (_key("A" * 16, shape=(1,)), ShapeMismatchError, "16 base64 characters, not 12"),
]


@pytest.mark.parametrize(("context", "error", "words_"), MALFORMED_JSON)
def test_malformed_keys_are_422_naming_the_field(context: dict, error: type, words_: str) -> None:
    body = _json(np.ones(1).tolist(), {"w": context})
    with pytest.raises(error, match=None) as err:
        decode(body, codec.JSON_TYPE, None)
    assert isinstance(err.value, InvalidArgumentError)  # a 422, never a 5xx
    assert words_ in err.value.detail, err.value.detail
    assert err.value.field.startswith("contexts[1].w"), err.value.field


MALFORMED_400 = [
    # the existing bounds of every typed array hold for keys too
    (_key([0, 0], shape=[2**40]), "exceeds 2147483648 elements"),
    (_key([0, 0], shape=[2**16, 2**16]), "exceeds 2147483648 elements"),  # with the words: 2^33
    (_key([0, 0], shape=[1] * MAX_DEPTH), "more than"),
    (_key([0, 0], shape="[]"), "list of ints"),
    (_key([0, 0], shape=[-1]), "non-negative"),
    (_key({"offset": 0, "nbytes": 8}), "outside a binary body"),
    (_key("@@@@@@@@@@@="), "invalid base64"),
    ({"__ndarray__": [0, 0], "dtype": "key<rbg>"}, "exactly the keys"),
]


@pytest.mark.parametrize(("context", "words_"), MALFORMED_400)
def test_keys_within_the_array_bounds_or_400(context: dict, words_: str) -> None:
    with pytest.raises(MalformedRequestError) as err:
        decode(_json(context), codec.JSON_TYPE, None)
    assert words_ in err.value.detail and err.value.field == "contexts[0]"
    assert 2**31 == MAX_ELEMENTS


def _binary(header: dict, data: bytes) -> tuple[bytes, str]:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 64)
    return text + data, str(len(text))


def test_malformed_binary_keys() -> None:
    ok = {"__ndarray__": {"offset": 0, "nbytes": 8}, "dtype": "key<threefry2x32>", "shape": []}
    body, n = _binary({"contexts": [ok]}, b"\x01\x00\x00\x00\x02\x00\x00\x00")
    assert decode(body, codec.BINARY_TYPE, n) == [KeyArray("threefry2x32", [1, 2])]
    wrong = dict(ok, __ndarray__={"offset": 0, "nbytes": 16})  # rbg's length for threefry
    body, n = _binary({"contexts": [wrong]}, bytes(16))
    with pytest.raises(ShapeMismatchError, match="a buffer of 16 bytes") as err:
        decode(body, codec.BINARY_TYPE, n)
    assert err.value.field == "contexts[0]"
    unknown = dict(ok, dtype="key<threefry>")
    body, n = _binary({"contexts": [unknown]}, bytes(8))
    with pytest.raises(DtypeMismatchError) as err:
        decode(body, codec.BINARY_TYPE, n)
    assert err.value.field == "contexts[0]"
    past = dict(ok, shape=[1000], __ndarray__={"offset": 0, "nbytes": 8000})  # 8 bytes sent
    body, n = _binary({"contexts": [past]}, bytes(8))
    with pytest.raises(MalformedRequestError, match="runs past"):
        decode(body, codec.BINARY_TYPE, n)

