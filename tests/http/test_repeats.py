"""Repeated calls take shortcuts that must give exactly what the full path gives.

A client calling one operator of one function with one backend and one shape sends
the same binary header every time, and the server answers with the same header. Four
places remember work keyed on that: the codec (decoded header layouts, encoded headers),
the client (a call's header), the server (a header's parsed and validated request).
Each is checked here against the full path with the memory cleared.
"""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from dxclient import JaxForward, JaxReverse, SecondOrder, _models
from dxcontract import codec
from dxcontract.encodings import binary
from dxcontract.errors import MalformedRequestError
from dxcontract.lru import LRU
from dxcontract.operators import OPERATORS
from dxserve.frameworks.jax.signature import Signature
from dxserve.http.metrics import _RequestCollector
from dxserve.pipeline import wire


@pytest.fixture(autouse=True)
def forget() -> None:
    """Every test starts with nothing remembered."""
    binary._LAYOUTS = LRU(512)
    binary._HEADERS = LRU(512)
    _models._REPEATS = _models._RepeatCalls()


def _uncached_body(payload: dict) -> bytes:
    binary._HEADERS = LRU(512)
    body, _, _ = codec.encode_body(payload, "binary")
    binary._HEADERS = LRU(512)
    return body


PAYLOADS = [
    {"gradient": np.arange(10.0)},
    {"value": np.float64(3.0).reshape(()), "gradient": np.ones((2, 3), np.float32)},
    {"hvps": (np.arange(4.0), np.arange(4.0) * 2), "prep": "p1", "n": 3, "ok": True, "z": None},
    {"x": {"w": np.ones((2, 2), ">f8"), "b": np.arange(6, dtype=np.int16)[::2]}},
    {"x": np.zeros((0, 3)), "tangents": [np.ones(1, np.complex64)]},
    {"x": np.asfortranarray(np.arange(6.0).reshape(2, 3))},
]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_remembered_header_encodes_the_same_bytes(payload: dict) -> None:
    first, _, h1 = codec.encode_body(payload, "binary")
    again, _, h2 = codec.encode_body(payload, "binary")  # from the remembered header
    assert again == first == _uncached_body(payload)
    assert h1 == h2


def test_encoded_header_follows_new_data_and_shapes() -> None:
    a = codec.encode_body({"g": np.arange(3.0)}, "binary")[0]
    b = codec.encode_body({"g": np.arange(3.0) + 1}, "binary")[0]
    c = codec.encode_body({"g": np.arange(4.0)}, "binary")[0]
    assert a != b and b == _uncached_body({"g": np.arange(3.0) + 1})
    assert c == _uncached_body({"g": np.arange(4.0)})


def test_unremembered_trees_still_encode() -> None:
    # floats and numpy scalars are not part of a header key: encoded in full each time
    payload = {"v": 1.5, "s": np.float32(2.0), "g": np.ones(2)}
    assert codec.encode_body(payload, "binary")[0] == codec.encode_body(payload, "binary")[0]
    with pytest.raises(Exception, match="reserved"):
        codec.encode_body({"__x": np.ones(2)}, "binary")
    with pytest.raises(Exception, match="reserved"):  # refused again, never remembered
        codec.encode_body({"__x": np.ones(2)}, "binary")


@pytest.mark.parametrize("payload", PAYLOADS)
def test_remembered_layout_decodes_the_same(payload: dict) -> None:
    body, ctype, headers = codec.encode_body(payload, "binary")
    first, layout1 = codec.decode_body_and_layout(body, ctype, headers[codec.HEADER_LENGTH])
    again, layout2 = codec.decode_body_and_layout(body, ctype, headers[codec.HEADER_LENGTH])
    assert layout1 is layout2 is not None
    _assert_same_tree(again, first)
    # a fresh tree each time: changing one decode does not leak into the next
    again["extra"] = 1
    assert "extra" not in codec.decode_body(body, ctype, headers[codec.HEADER_LENGTH])


def test_remembered_layout_reads_each_body_own_data() -> None:
    body1, ctype, h = codec.encode_body({"g": np.arange(5.0)}, "binary")
    body2, _, _ = codec.encode_body({"g": -np.arange(5.0)}, "binary")
    codec.decode_body(body1, ctype, h[codec.HEADER_LENGTH])
    got = codec.decode_body(body2, ctype, h[codec.HEADER_LENGTH])
    np.testing.assert_array_equal(got["g"], -np.arange(5.0))
    assert not got["g"].flags.writeable


def test_short_body_with_a_remembered_header_is_still_refused() -> None:
    body, ctype, h = codec.encode_body({"g": np.arange(5.0)}, "binary")
    n = h[codec.HEADER_LENGTH]
    codec.decode_body(body, ctype, n)
    with pytest.raises(MalformedRequestError, match="runs past") as info:
        codec.decode_body(body[:-30], ctype, n)  # 40 data bytes + 24 padding
    assert info.value.field == "g"


def test_long_headers_are_not_remembered() -> None:
    payload = {f"k{i:04d}": np.ones(1) for i in range(60)}
    body, ctype, h = codec.encode_body(payload, "binary")
    assert int(h[codec.HEADER_LENGTH]) > codec.BinaryLayout.MAX_HEADER
    obj, layout = codec.decode_body_and_layout(body, ctype, h[codec.HEADER_LENGTH])
    assert layout is None and len(obj) == 60


def test_memo_stays_bounded() -> None:
    assert binary._LAYOUTS.maxsize == binary._HEADERS.maxsize == 512
    memo = LRU(4)
    for i in range(10):
        memo.put(i, i)
    assert len(memo) == 4 and memo.get(9) == 9 and memo.get(0) is None


# --- client ---------------------------------------------------------------
CALLS = [
    ("gradient", "rosenbrock", JaxReverse(), np.linspace(-1, 1, 10)),
    ("gradient", "rosenbrock", "jax-reverse", np.linspace(-1, 1, 7).astype(np.float32)),
    ("hessian", "f", SecondOrder(JaxForward(), JaxReverse()), np.arange(6.0).reshape(2, 3)),
    ("value", "f", "auto", np.arange(12.0).reshape(3, 4)[:, ::2]),  # not contiguous
    ("jacobian", "f", JaxForward(batch_size=2), np.arange(4.0, dtype=">f8")),  # big-endian
    ("gradient", "f", "auto", np.array(2.0)),
    ("gradient", "f", "auto", np.zeros(0)),
]


@pytest.mark.parametrize(("operator", "f", "backend", "x"), CALLS)
@pytest.mark.parametrize("prepare", [False, True])
def test_repeated_client_call_is_byte_identical(operator, f, backend, x, prepare) -> None:  # noqa: ANN001
    def call(value: np.ndarray) -> _models.Call:
        return _models.operator_call(
            operator, f, backend, value, None, (), None, "binary", prepare=prepare
        )

    def full(value: np.ndarray) -> _models.Call:
        _models._REPEATS = _models._RepeatCalls()
        binary._HEADERS = LRU(512)
        return call(value)

    call(x)  # remembered
    assert _models._REPEATS._calls, "the first call should be remembered"
    y = x * 3 + 1 if x.size else x
    repeated = call(y)
    assert repeated == full(y)


def test_client_calls_with_more_than_x_are_encoded_in_full() -> None:
    x = np.ones(3)
    for tangents, contexts in (((x,), ()), (None, (x,))):
        op = "pushforward" if tangents else "gradient"
        _models.operator_call(op, "f", "auto", x, tangents, contexts, None, "binary")
    _models.operator_call("gradient", "f", "auto", [1.0, 2.0], None, (), None, "binary")
    _models.operator_call("gradient", "f", "auto", x, None, (), None, "b64")
    assert not _models._REPEATS._calls


# --- server ---------------------------------------------------------------
def _request_body(**fields) -> tuple[bytes, str, str]:  # noqa: ANN003
    body, ctype, h = codec.encode_body(fields, "binary")
    return body, ctype, h[codec.HEADER_LENGTH]


def test_repeated_header_gives_the_parsed_request() -> None:
    op = OPERATORS["pushforward"]
    backend = {"type": "jax-forward", "batch_size": 2}
    x, t = {"a": np.ones(3), "b": np.zeros((2, 2))}, np.arange(3.0)
    memo = wire.WireMemo()

    def decode(scale: float) -> wire.OperatorRequest:
        body, ctype, n = _request_body(
            function="f", backend=backend, x={k: v * scale for k, v in x.items()},
            tangents=[{"a": t * scale, "b": np.ones((2, 2))}], contexts=[np.ones(2)],
        )
        return wire.decode_operator_request(body, ctype, n, op, memo)

    first = decode(1.0)
    again = decode(2.0)  # from the header's memo
    expected = wire.parse_operator_request(
        codec.decode_body(*_request_body(
            function="f", backend=backend, x={k: v * 2.0 for k, v in x.items()},
            tangents=[{"a": t * 2.0, "b": np.ones((2, 2))}], contexts=[np.ones(2)],
        )), op,
    )
    assert (again.function, again.backend, again.prep) == (expected.function, expected.backend, None)
    _assert_same_tree(again.x, expected.x)
    _assert_same_tree(list(again.tangents), list(expected.tangents))
    _assert_same_tree(list(again.contexts), list(expected.contexts))
    assert again.signature == Signature.of(expected.x, expected.tangents, expected.contexts)
    assert first.signature is None  # the first one is parsed in full


def test_header_memo_is_per_operator() -> None:
    body, ctype, n = _request_body(function="f", backend="auto", x=np.ones(3))
    memo = wire.WireMemo()
    wire.decode_operator_request(body, ctype, n, OPERATORS["gradient"], memo)
    wire.decode_operator_request(body, ctype, n, OPERATORS["gradient"], memo)
    with pytest.raises(Exception, match="needs tangents"):  # validated again for hvp
        wire.decode_operator_request(body, ctype, n, OPERATORS["hvp"], memo)


def test_memos_are_per_door() -> None:
    body, ctype, n = _request_body(function="f", backend="auto", x=np.ones(3))
    one, other = wire.WireMemo(), wire.WireMemo()
    wire.decode_operator_request(body, ctype, n, OPERATORS["gradient"], one)
    assert wire.decode_operator_request(body, ctype, n, OPERATORS["gradient"], one).signature
    assert wire.decode_operator_request(body, ctype, n, OPERATORS["gradient"], other).signature is None
    assert wire.decode_operator_request(body, ctype, n, OPERATORS["gradient"]).signature is None


def test_inline_json_arrays_in_a_binary_header_are_validated_every_time() -> None:
    op = OPERATORS["gradient"]
    header = b'{"function":"f","x":[1.0,2.0]}'
    header += b" " * (-len(header) % 64)
    memo = wire.WireMemo()
    for _ in range(2):
        req = wire.decode_operator_request(header, codec.BINARY_TYPE, str(len(header)), op, memo)
        assert req.signature is None
        np.testing.assert_array_equal(req.x, [1.0, 2.0])


def test_invalid_request_is_refused_every_time() -> None:
    body, ctype, n = _request_body(function="f", x=np.ones(2), bogus=1)
    memo = wire.WireMemo()
    for _ in range(2):
        with pytest.raises(Exception, match="unknown field 'bogus'"):
            wire.decode_operator_request(body, ctype, n, OPERATORS["gradient"], memo)


# --- metrics --------------------------------------------------------------
def test_request_collector_matches_prometheus_histogram() -> None:
    ours = _RequestCollector()
    registry = CollectorRegistry()
    registry.register(ours)
    reference = CollectorRegistry()
    histogram = Histogram(
        "dxserve_request_seconds", "Request latency (seconds) by route", ["route"],
        buckets=_RequestCollector.BUCKETS, registry=reference,
    )
    for i, seconds in enumerate([0.0001, 0.0005, 0.0007, 0.001, 0.3, 2.5, 61.0, 0.02]):
        route = "/gradient" if i % 3 else "/hvp"
        ours.record(route, 200, seconds)
        histogram.labels(route).observe(seconds)

    def samples(reg: CollectorRegistry) -> set:
        return {
            (s.name, tuple(sorted(s.labels.items())), round(s.value, 12))
            for m in reg.collect() if m.name == "dxserve_request_seconds"
            for s in m.samples if not s.name.endswith("_created")
        }

    assert samples(registry) == samples(reference)
    text = generate_latest(registry).decode()
    assert 'dxserve_requests_total{route="/gradient",status="200"} 5.0' in text


def _assert_same_tree(got, want) -> None:  # noqa: ANN001
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys()
        for k in want:
            _assert_same_tree(got[k], want[k])
    elif isinstance(want, list | tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _assert_same_tree(g, w)
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    else:
        assert got == want
