"""The three wire encodings, pinned byte for byte, and the encoding plug-in point.

``GOLDEN`` holds the SHA-256 of every body (and of its part boundaries, for
``encode_body_parts``) that the codec wrote for ``CASES`` before the encodings were split
into one module each; any change to the bytes a client or server writes fails here.
Regenerate only for a deliberate wire-format change:
``.venv/bin/python tests/contract/test_encodings.py`` prints a fresh table.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np
import pytest

from dxcontract import codec
from dxcontract.dtypes import BFLOAT16 as _BF16
from dxcontract.encodings import common

ENCODING_NAMES = ("json", "b64", "binary")


def _f64(n: int) -> np.ndarray:
    return np.sin(np.arange(n, dtype=np.float64)) * 1e3


def _large() -> np.ndarray:
    return _f64(20_000).reshape(200, 100)  # more than codec.JSON_CHUNK elements: in blocks


def _large_nan() -> np.ndarray:
    a = _f64(40_000)
    a[::97] = np.nan
    a[5::131] = np.inf
    return a


def _cases() -> dict[str, tuple[dict[str, Any], tuple[str, ...], tuple[str, ...]]]:
    """name -> (payload, its array fields, its batch fields)."""
    nonfinite = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1.5, 5e-324, 1e308])
    return {
        "scalars": (
            {"value": np.float64(3.5), "f32": np.float32(0.25), "i": np.int64(-7),
             "b": np.bool_(True), "nan": np.float64(np.nan), "zero_d": np.array(2.0)},
            ("value", "f32", "i", "b", "nan", "zero_d"), (),
        ),
        "plain_values": (
            {"function": "rosenbrock", "backend": "auto", "n": 3, "ok": True, "z": None,
             "y": 1.5, "inf": math.inf, "ninf": -math.inf, "pnan": math.nan,
             "meta": {"k": [1, 2.5, "s"]}, "x": [1.0, 2.0, 3.0]},
            ("x",), (),
        ),
        "float64": (
            {"gradient": _f64(10), "m": _f64(12).reshape(3, 4)}, ("gradient", "m"), (),
        ),
        "float32": (
            {"gradient": _f64(7).astype(np.float32), "h": np.float16([1.0, -2.5, 65504.0])},
            ("gradient", "h"), (),
        ),
        "low_precision": (
            {"bf16": np.array([1.5, -0.0, np.nan, np.inf, 0.1, 3e38, 2.0**-133], _BF16),
             "bf16_be": np.array([[0.5, -2.0], [1e-3, 7.0]], _BF16).astype(_BF16.newbyteorder(">")),
             "f16": np.float16([0.1, -0.0, np.nan, -np.inf, 65504.0, 2.0**-24]),
             "bf16_0d": np.array(-3.25, _BF16)},
            ("bf16", "bf16_be", "f16", "bf16_0d"), (),
        ),
        "ints": (
            {"i32": np.arange(-3, 4, dtype=np.int32), "i64": np.array([2**62, -(2**63)]),
             "u8": np.arange(250, 256, dtype=np.uint8).reshape(2, 3),
             "u64": np.array([2**64 - 1], np.uint64), "i16": np.arange(6, dtype=np.int16)[::2],
             "i8": np.array([-128, 127], np.int8)},
            ("i32", "i64", "u8", "u64", "i16", "i8"), (),
        ),
        "bool_complex": (
            {"b": np.array([[True, False], [False, True]]),
             "c64": np.array([1 + 2j, -0.5j], np.complex64),
             "c128": np.array([[np.nan + 1j, np.inf - 1j]])},
            ("b", "c64", "c128"), (),
        ),
        "nonfinite": (
            {"f64": nonfinite, "f32": nonfinite[:6].astype(np.float32),
             "s": np.float64(-np.inf), "m": nonfinite.reshape(2, 4)},
            ("f64", "f32", "s", "m"), (),
        ),
        "pytree": (
            {"x": {"w": _f64(6).reshape(2, 3), "b": {"c": np.arange(4, dtype=np.int16),
                                                   "d": np.float32([0.5])}},
             "value": np.float64(1.0)},
            ("x", "value"), (),
        ),
        "empty": (
            {"e0": np.zeros(0), "e03": np.zeros((0, 3)), "e20": np.zeros((2, 0)),
             "e204": np.zeros((2, 0, 4), np.float32), "ei": np.zeros(0, np.int32)},
            ("e0", "e03", "e20", "e204", "ei"), (),
        ),
        "request_tangents": (
            {"function": "f", "backend": {"type": "jax-forward", "batch_size": 2},
             "x": {"a": _f64(3), "b": np.ones((2, 2))},
             "tangents": [{"a": np.arange(3.0), "b": np.zeros((2, 2))},
                          {"a": -np.arange(3.0), "b": np.eye(2)}],
             "contexts": [np.float32([1.0, 2.0]), np.arange(3)], "prep": "p-1"},
            ("x",), ("tangents", "contexts"),
        ),
        "request_gradient": (
            {"function": "rosenbrock", "backend": "jax-reverse", "x": _f64(10)}, ("x",), (),
        ),
        "response_batch": (
            {"value": np.float64(2.0), "hvps": (_f64(4), _f64(4) * 2), "prep": "p"},
            ("value",), ("hvps",),
        ),
        "layouts": (
            {"be": _f64(5).astype(">f8"), "bei": np.arange(6, dtype=">i4").reshape(2, 3),
             "fortran": np.asfortranarray(_f64(6).reshape(2, 3)), "strided": _f64(12)[::3],
             "transposed": _f64(6).reshape(2, 3).T},
            ("be", "bei", "fortran", "strided", "transposed"), (),
        ),
        "long_header": (  # header over BinaryLayout.MAX_HEADER: never remembered
            {f"field_{i:03d}": np.float32([i, -i]) for i in range(60)},
            tuple(f"field_{i:03d}" for i in range(60)), (),
        ),
        "large": ({"jacobian": _large()}, ("jacobian",), ()),
        "large_nonfinite": ({"gradient": _large_nan()}, ("gradient",), ()),
        "large_batch": (
            {"pullbacks": [_f64(20_000), _f64(17_000).astype(np.float32)]}, (), ("pullbacks",),
        ),
    }  # fmt: skip


CASES = _cases()


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:24]


def fingerprint(payload: dict, encoding: str) -> str:
    """One hash over the body, its media type and headers, and its part boundaries."""
    body, media, headers = codec.encode_body(payload, encoding)
    parts, media2, headers2 = codec.encode_body_parts(payload, encoding)
    assert (media2, headers2) == (media, headers)
    assert b"".join(bytes(p) for p in parts) == body
    lengths = ",".join(str(len(memoryview(p).cast("B"))) for p in parts)
    meta = f"{media}|{sorted(headers.items())}|{lengths}".encode()
    return _digest(body) + ":" + _digest(meta)


def _table(orjson: bool) -> dict[str, dict[str, str]]:
    return {
        name: {enc: fingerprint(payload, enc) for enc in ENCODING_NAMES}
        for name, (payload, _, _) in CASES.items()
        if orjson or "large" not in name
    }


# fmt: off
GOLDEN: dict[str, dict[str, str]] = {
    "scalars": {
        "json": "5f731670ba3be7674a046f0f:66ee0221bdef61328c794e8e",
        "b64": "1fc7e0ab48a9aac21f8ea2fe:8ab62b97169417ac0485a579",
        "binary": "7a98c8e6ee9892ab454d9ab2:e3101f05106d276cafbcf019",
    },
    "plain_values": {
        "json": "877de3d40057aef51d8209bd:804cd69fe0054e5324e1940f",
        "b64": "877de3d40057aef51d8209bd:804cd69fe0054e5324e1940f",
        "binary": "ea6f736da9d5b6c7347a6665:bc7cea65b92d1146824732d7",
    },
    "float64": {
        "json": "6db823fd6ab0bf0aa8a51d30:08a44459cdca0bbc5d45cf5f",
        "b64": "9cb2f692fba4d0b6df17f059:e8f11915b0c7aa06f85daee8",
        "binary": "3d3afbf8cc3d810d294edfb5:6b2f2930f17c59df32de0150",
    },
    "float32": {
        "json": "7873cd98e5e6f4bd66baa52d:ac250e17426f51ecd2ca7371",
        "b64": "4529875188b09c95930f472b:9232ff507e017665fc39a10f",
        "binary": "3bfdd5fbb0d90b6148bc7055:000279ca3da21035d49b5c57",
    },
    "low_precision": {
        "json": "327e2d18297965e6ff20ec7a:57935e6da4f933affea01e6e",
        "b64": "c98e1594973de28353d54e6b:8a92802661112e725c587654",
        "binary": "75eccbef5fcfa8f57c43a887:f8d30bc72e516cfcfd71c050",
    },
    "ints": {
        "json": "6a583561b6105316aaf34654:2b94eae800a5d75d1da04f53",
        "b64": "1a54a736abe54c872b9a297a:8e2ef21c42a662aa27cf4e6e",
        "binary": "e6c93425a9eda5757e13a110:89d79ef724f8acb7c1f1a56a",
    },
    "bool_complex": {
        "json": "f81e958e4c26e97ab39f61ee:e73ac600d0fe01a6500a0563",
        "b64": "1804bd405e1e40d998a77796:ede36d1361f21cf24fe2269a",
        "binary": "b95201f95335a67f00301233:68e675a62a9ba3d5bcb81a86",
    },
    "nonfinite": {
        "json": "9b05bb86090f701d97cbba95:2ad9c665c3f452f99595ef01",
        "b64": "069c5ddf78a310a0b11561d0:7b95e5c1d3c770e499d535b1",
        "binary": "90729c22b64ac28dd89e9247:6c8a1fe5383c1e6dd9ac6ab9",
    },
    "pytree": {
        "json": "f5f752824d7b1087660a314d:31993b6d145b8469a82f2ff3",
        "b64": "5fda81318075dff71067f048:ce041928b1bb0d434361c36d",
        "binary": "d61e48f40507a86bcf44e2ca:5c6376a3e04eef161ffd4d4f",
    },
    "empty": {
        "json": "85b6948c9f0896b7d33b91a5:219830eddf510dbf23ffeea7",
        "b64": "b252336d0cba7dbab8bc50fb:1a08aa583fbb70bdb0111f4e",
        "binary": "5cc27343de2ae38c7a6133fb:0af4c21b177e068a8d84817b",
    },
    "request_tangents": {
        "json": "02993bd87e6d0af246b2440b:2708cef12a8f1cbd8d07b1d5",
        "b64": "86e2d261bb86fc65ac98fad3:b7d99589c379355461fc9225",
        "binary": "dfef4a5daae06152ab4906a6:6c6f1f4fc092a8d104332e5f",
    },
    "request_gradient": {
        "json": "7c07337c45937eb666a4ec8f:6a428482c73188da664f887b",
        "b64": "25d6110ca9a5c9248c39997b:d18a140e7a08ca714966fb88",
        "binary": "fe61181322ba4d82b40acddd:5544f00c2a39261e5a3108d9",
    },
    "response_batch": {
        "json": "6940e6437feed2c9178f2984:d1bcbf454330111fb098eef8",
        "b64": "a5dfd9fe4bde6ee22f73c9c6:0a70532acada2c4bc9ed0852",
        "binary": "ab061fd38b53b9f763c3b7d1:e202407e32d367a50bbd970a",
    },
    "layouts": {
        "json": "64e55af8f45bce87e582a94f:ade98c2482b37f291da48db4",
        "b64": "ae64efb9ca4cf777b70f411d:bfae7b6c53a2ac79c4ad5372",
        "binary": "1e6ee603d26e71b4665378ab:df403f753ea681cade942c09",
    },
    "long_header": {
        "json": "0419f8a464df770f7309ed51:b1fc1a15185294e6f6e4a8ba",
        "b64": "b6703e65527294d049d3b116:a121b30b8c64b355eb78ee54",
        "binary": "e4dfc5ca5274958317160d15:a74ef17b2067ab7cfaaa447b",
    },
    "large": {
        "json": "4509ed73bec44d2ca12d6eee:d492757317f998182734d08e",
        "b64": "937fbd9e43c22fc8a68288ef:7ff0adaf5bb1d75c5f554d02",
        "binary": "9438870cf58d6dc748f99817:b509253da4133987d6cf9f44",
    },
    "large_nonfinite": {
        "json": "52f5deca4e38a0001f8f0a31:30f6834d9e53ff2361ce9860",
        "b64": "02c9e006dc62f358805bd307:24ddc73bb1b47fdcf3ec7186",
        "binary": "1ea85b1f662290f1398c97e0:3239cfc2d2eb0885d392e2a0",
    },
    "large_batch": {
        "json": "7323bef0d0708c71629f895d:b5635dc0a6f3d24660c36d90",
        "b64": "4c8185e4d64cb620952bc1b6:ed72d1c50df94331e7dbf841",
        "binary": "164cc6172f8b35ec1a045fcb:8975b1ab7c32c8e9a13946a8",
    },
}
GOLDEN_WITHOUT_ORJSON: dict[str, dict[str, str]] = {
    "scalars": {
        "json": "5f731670ba3be7674a046f0f:66ee0221bdef61328c794e8e",
        "b64": "1fc7e0ab48a9aac21f8ea2fe:8ab62b97169417ac0485a579",
        "binary": "7a98c8e6ee9892ab454d9ab2:e3101f05106d276cafbcf019",
    },
    "plain_values": {
        "json": "877de3d40057aef51d8209bd:804cd69fe0054e5324e1940f",
        "b64": "877de3d40057aef51d8209bd:804cd69fe0054e5324e1940f",
        "binary": "ea6f736da9d5b6c7347a6665:bc7cea65b92d1146824732d7",
    },
    "float64": {
        "json": "6db823fd6ab0bf0aa8a51d30:08a44459cdca0bbc5d45cf5f",
        "b64": "9cb2f692fba4d0b6df17f059:e8f11915b0c7aa06f85daee8",
        "binary": "3d3afbf8cc3d810d294edfb5:6b2f2930f17c59df32de0150",
    },
    "float32": {
        "json": "7873cd98e5e6f4bd66baa52d:ac250e17426f51ecd2ca7371",
        "b64": "4529875188b09c95930f472b:9232ff507e017665fc39a10f",
        "binary": "3bfdd5fbb0d90b6148bc7055:000279ca3da21035d49b5c57",
    },
    "low_precision": {  # stdlib json writes exponents with two digits ("e-08")
        "json": "9969ac5b18db501933ebcf85:0d6148b6e066580a1bfecec2",
        "b64": "c98e1594973de28353d54e6b:8a92802661112e725c587654",
        "binary": "75eccbef5fcfa8f57c43a887:f8d30bc72e516cfcfd71c050",
    },
    "ints": {
        "json": "6a583561b6105316aaf34654:2b94eae800a5d75d1da04f53",
        "b64": "1a54a736abe54c872b9a297a:8e2ef21c42a662aa27cf4e6e",
        "binary": "e6c93425a9eda5757e13a110:89d79ef724f8acb7c1f1a56a",
    },
    "bool_complex": {
        "json": "f81e958e4c26e97ab39f61ee:e73ac600d0fe01a6500a0563",
        "b64": "1804bd405e1e40d998a77796:ede36d1361f21cf24fe2269a",
        "binary": "b95201f95335a67f00301233:68e675a62a9ba3d5bcb81a86",
    },
    "nonfinite": {
        "json": "9b05bb86090f701d97cbba95:2ad9c665c3f452f99595ef01",
        "b64": "069c5ddf78a310a0b11561d0:7b95e5c1d3c770e499d535b1",
        "binary": "90729c22b64ac28dd89e9247:6c8a1fe5383c1e6dd9ac6ab9",
    },
    "pytree": {
        "json": "f5f752824d7b1087660a314d:31993b6d145b8469a82f2ff3",
        "b64": "5fda81318075dff71067f048:ce041928b1bb0d434361c36d",
        "binary": "d61e48f40507a86bcf44e2ca:5c6376a3e04eef161ffd4d4f",
    },
    "empty": {
        "json": "85b6948c9f0896b7d33b91a5:219830eddf510dbf23ffeea7",
        "b64": "b252336d0cba7dbab8bc50fb:1a08aa583fbb70bdb0111f4e",
        "binary": "5cc27343de2ae38c7a6133fb:0af4c21b177e068a8d84817b",
    },
    "request_tangents": {
        "json": "02993bd87e6d0af246b2440b:2708cef12a8f1cbd8d07b1d5",
        "b64": "86e2d261bb86fc65ac98fad3:b7d99589c379355461fc9225",
        "binary": "dfef4a5daae06152ab4906a6:6c6f1f4fc092a8d104332e5f",
    },
    "request_gradient": {
        "json": "7c07337c45937eb666a4ec8f:6a428482c73188da664f887b",
        "b64": "25d6110ca9a5c9248c39997b:d18a140e7a08ca714966fb88",
        "binary": "fe61181322ba4d82b40acddd:5544f00c2a39261e5a3108d9",
    },
    "response_batch": {
        "json": "6940e6437feed2c9178f2984:d1bcbf454330111fb098eef8",
        "b64": "a5dfd9fe4bde6ee22f73c9c6:0a70532acada2c4bc9ed0852",
        "binary": "ab061fd38b53b9f763c3b7d1:e202407e32d367a50bbd970a",
    },
    "layouts": {
        "json": "64e55af8f45bce87e582a94f:ade98c2482b37f291da48db4",
        "b64": "ae64efb9ca4cf777b70f411d:bfae7b6c53a2ac79c4ad5372",
        "binary": "1e6ee603d26e71b4665378ab:df403f753ea681cade942c09",
    },
    "long_header": {
        "json": "0419f8a464df770f7309ed51:b1fc1a15185294e6f6e4a8ba",
        "b64": "b6703e65527294d049d3b116:a121b30b8c64b355eb78ee54",
        "binary": "e4dfc5ca5274958317160d15:a74ef17b2067ab7cfaaa447b",
    },
}
# fmt: on


def _without_orjson(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the codec on the stdlib ``json`` module, as a client without orjson does."""
    monkeypatch.setattr(common, "orjson", None)


def _expected(value: Any) -> np.ndarray:
    a = np.asarray(value)
    return np.array(a, dtype=a.dtype.newbyteorder("<"), order="C")


def _assert_same_array(got: Any, want: Any) -> None:
    want = _expected(want)
    assert isinstance(got, np.ndarray)
    assert (got.dtype, got.shape) == (want.dtype, want.shape)
    nan_got, nan_want = got != got, want != want  # NaN (and complex with a NaN part)
    assert np.array_equal(nan_got, nan_want)
    assert got[~nan_got].tobytes() == want[~nan_want].tobytes()


def _assert_same_tree(got: Any, want: Any) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys()
        for key in want:
            _assert_same_tree(got[key], want[key])
    else:
        _assert_same_array(got, want)


@pytest.mark.parametrize("encoding", ENCODING_NAMES)
@pytest.mark.parametrize("case", list(CASES))
def test_bytes_are_pinned(case: str, encoding: str) -> None:
    payload = CASES[case][0]
    first = fingerprint(payload, encoding)
    assert fingerprint(payload, encoding) == first  # again, from any remembered header
    assert first == GOLDEN[case][encoding]


@pytest.mark.parametrize("encoding", ENCODING_NAMES)
@pytest.mark.parametrize("case", list(GOLDEN_WITHOUT_ORJSON))
def test_bytes_are_pinned_without_orjson(
    case: str, encoding: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _without_orjson(monkeypatch)
    assert fingerprint(CASES[case][0], encoding) == GOLDEN_WITHOUT_ORJSON[case][encoding]


@pytest.mark.parametrize("encoding", ENCODING_NAMES)
@pytest.mark.parametrize("case", list(CASES))
def test_bodies_decode_to_what_was_encoded(case: str, encoding: str) -> None:
    payload, arrays, batches = CASES[case]
    body, media, headers = codec.encode_body(payload, encoding)
    for _ in range(2):  # the second time from a remembered binary layout
        out = codec.decode_response(
            body, media, headers.get(codec.HEADER_LENGTH), arrays=arrays, batches=batches
        )
        assert out.keys() == payload.keys()
        for key, want in payload.items():
            if key in arrays:
                _assert_same_tree(out[key], want)
            elif key in batches:
                assert len(out[key]) == len(want)
                for got_item, want_item in zip(out[key], want, strict=True):
                    _assert_same_tree(got_item, want_item)
            elif isinstance(want, float) and not math.isfinite(want):
                assert out[key] == codec.from_tree(want, encoding)  # its string spelling
            else:
                assert out[key] == want


def test_small_bodies_literally() -> None:
    """The three encodings of one small request, written out."""
    payload = {"function": "f", "x": np.array([1.0, np.nan]), "t": [np.float32([0.5])]}
    assert codec.encode_body(payload, "json") == (
        b'{"function":"f","x":[1.0,"NaN"],"t":[{"__ndarray__":[0.5],"dtype":"float32",'
        b'"shape":[1]}]}',
        "application/json",
        {},
    )
    assert codec.encode_body(payload, "b64") == (
        b'{"function":"f","x":{"__ndarray__":"AAAAAAAA8D8AAAAAAAD4fw==","dtype":"float64",'
        b'"shape":[2]},"t":[{"__ndarray__":"AAAAPw==","dtype":"float32","shape":[1]}]}',
        "application/json",
        {},
    )
    header = (
        b'{"function":"f","x":{"__ndarray__":{"offset":0,"nbytes":16},"dtype":"float64",'
        b'"shape":[2]},"t":[{"__ndarray__":{"offset":64,"nbytes":4},"dtype":"float32",'
        b'"shape":[1]}]}'
    )
    header += b" " * (192 - len(header))
    data = np.array([1.0, np.nan]).tobytes() + bytes(48) + np.float32([0.5]).tobytes()
    assert codec.encode_body(payload, "binary") == (
        header + data + bytes(60),
        "application/vnd.dxserve.binary",
        {"Dxserve-Header-Length": "192"},
    )


@pytest.mark.parametrize("n", [0, 1, 2, 63, 64, 65, 100])
@pytest.mark.parametrize("fill", ["finite", "nan", "inf", "-inf", "overflowing sum", "tiny"])
def test_float_lists_spell_non_finite_values_at_every_length(n: int, fill: str) -> None:
    """Short 1-d arrays take a quicker finiteness test than long ones; both write the
    same JSON as spelling each value by hand, on either side of the length bound."""
    a = np.sin(np.arange(n, dtype=np.float64)) * 1e3
    if n:
        a[n // 2] = {
            "finite": a[n // 2], "nan": np.nan, "inf": np.inf, "-inf": -np.inf,
            "overflowing sum": 1.5e308, "tiny": 5e-324,
        }[fill]
        if fill == "overflowing sum":
            a[0] = 1.7e308  # finite values whose sum is not
    spelled = [
        "NaN" if math.isnan(v) else "Infinity" if v == math.inf
        else "-Infinity" if v == -math.inf else v
        for v in a.tolist()
    ]
    import orjson

    body, _, _ = codec.encode_body({"x": a}, "json")
    assert body == orjson.dumps({"x": spelled})
    back = codec.to_tree(codec.loads(body)["x"], "x")
    assert back.dtype == np.float64 and back.tobytes() == a.tobytes()


# Content negotiation: for each request Content-Type, the answer's encoding for each
# Accept in ACCEPTS (space-separated groups), one letter per body in NEGOTIATION_BODIES:
# j = "json" (lists), b = "b64", B = "binary".
J, B = "application/json", "application/vnd.dxserve.binary"
ACCEPTS = (
    None, "", J, B, f"{J}; arrays=b64", f"{J}; arrays=lists", "*/*", f"{B}, {J};q=0.5",
    "application/JSON; Arrays=B64",
)  # fmt: skip
NEGOTIATION_BODIES = (
    b'{"x":[1.0]}',
    b'{"x":{"__ndarray__":"AAAA","dtype":"float32","shape":[1]}}',
    b'{"x":{"__ndarray__" :\n "AAAA"}}',
    b'{"x":{"__ndarray__":[1.0],"dtype":"float32","shape":[1]}}',
)
NEGOTIATION = {
    J: "jbbj jbbj jbbj BBBB bbbb jjjj jbbj BBBB bbbb",
    B: "BBBB BBBB jjjj BBBB bbbb jjjj BBBB BBBB bbbb",
    "Application/JSON; charset=utf-8": "jbbj jbbj jbbj BBBB bbbb jjjj jbbj BBBB bbbb",
    "APPLICATION/VND.DXSERVE.BINARY": "BBBB BBBB jjjj BBBB bbbb jjjj BBBB BBBB bbbb",
    None: "jbbj jbbj jbbj BBBB bbbb jjjj jbbj BBBB bbbb",
    "text/plain": "jbbj jbbj jbbj BBBB bbbb jjjj jbbj BBBB bbbb",
}
_LETTERS = {"j": "json", "b": "b64", "B": "binary"}


@pytest.mark.parametrize("content_type", list(NEGOTIATION))
def test_response_encoding_is_pinned(content_type: str | None) -> None:
    response_encoding = _response_encoding()
    for accept, letters in zip(ACCEPTS, NEGOTIATION[content_type].split(), strict=True):
        for body, letter in zip(NEGOTIATION_BODIES, letters, strict=True):
            got = response_encoding(content_type, accept, body)
            assert got == _LETTERS[letter], (content_type, accept, body)


def _response_encoding() -> Any:
    return pytest.importorskip("dxcontract.encodings.negotiation").response_encoding



# --------------------------------------------------------------------------- plug-in


class HexJson(common.JsonBody):
    """A toy fourth encoding, all of it here: arrays as hex strings in a JSON body of
    its own media type; decoding gives numpy arrays directly."""

    name = "hex"
    media_type = "application/x-dxserve-hex+json"

    def encode_array(self, a: np.ndarray, buffers: Any, field: str) -> Any:
        dtype = common.check_dtype(a, field)
        data = common.le_contig(a).tobytes().hex()
        return {common.MARKER: data, "dtype": dtype, "shape": list(a.shape)}

    def decode_body(
        self, body: bytes | bytearray | memoryview, header_length: str | None,
        max_header_bytes: int,
    ) -> tuple[dict, None]:
        obj, _ = super().decode_body(body, header_length, max_header_bytes)
        return self._arrays(obj, "body"), None

    def _arrays(self, value: Any, field: str) -> Any:
        if isinstance(value, dict):
            if common.MARKER in value:
                dtype, shape = common.typed_header(value, field, common.MAX_DEPTH)
                return np.frombuffer(bytes.fromhex(value[common.MARKER]), dtype).reshape(shape)
            return {k: self._arrays(v, common.join(field, k)) for k, v in value.items()}
        if isinstance(value, list):
            return [self._arrays(v, f"{field}[{i}]") for i, v in enumerate(value)]
        return value


@pytest.fixture
def hex_encoding() -> Any:
    from dxcontract.encodings import ENCODINGS, register_encoding, unregister_encoding

    encoding = register_encoding(HexJson())
    try:
        yield encoding
    finally:
        unregister_encoding(encoding.name)
    assert "hex" not in ENCODINGS


def test_a_registered_encoding_round_trips(hex_encoding: Any) -> None:
    from dxcontract.encodings import MEDIA_TYPES
    from dxcontract.encodings.negotiation import decoder_for, response_encoding

    payload, arrays, batches = CASES["request_tangents"]
    body, media, headers = codec.encode_body(payload, "hex")
    assert media == "application/x-dxserve-hex+json" and headers == {}
    assert b'"__ndarray__":"000000000000f03f' in body  # hex, little-endian
    assert b"".join(codec.encode_body_parts(payload, "hex")[0]) == body
    assert decoder_for(f"{media}; charset=utf-8") is hex_encoding
    assert MEDIA_TYPES[media] is hex_encoding
    out = codec.decode_response(body, media, None, arrays=arrays, batches=batches)
    _assert_same_tree(out["x"], payload["x"])
    for got, want in zip(out["tangents"], payload["tangents"], strict=True):
        _assert_same_tree(got, want)
    assert out["function"] == "f" and out["backend"] == payload["backend"]
    assert codec.from_tree(np.float32([1.0]), "hex")["__ndarray__"] == "0000803f"
    # negotiation: the request's own encoding, or the one Accept names
    assert response_encoding(media, None, body) == "hex"
    assert response_encoding(codec.JSON_TYPE, media, b"{}") == "hex"
    assert response_encoding(media, codec.BINARY_TYPE, body) == "binary"
    # the built-in encodings are untouched
    assert codec.encode_body({"g": np.arange(2.0)}, "json")[0] == b'{"g":[0.0,1.0]}'


def test_unknown_encodings_and_media_types_are_refused() -> None:
    from dxcontract.errors import UnsupportedMediaTypeError

    with pytest.raises(ValueError, match="unknown encoding 'hex'"):
        codec.encode_body({"x": np.ones(1)}, "hex")
    with pytest.raises(UnsupportedMediaTypeError) as e:
        codec.decode_body(b"{}", "application/x-dxserve-hex+json", None)
    assert "application/json or application/vnd.dxserve.binary" in str(e.value)


if __name__ == "__main__":  # pragma: no cover - prints the tables above
    import pprint

    pprint.pprint(_table(True), width=100, sort_dicts=False)
