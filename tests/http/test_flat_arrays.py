"""Long flat JSON lists of numbers, parsed straight into float64 arrays.

A large JSON body's request ``x``, or an answer's (non-batch) results, that is a long
flat list of numbers is parsed by simdjson into a float64 array
(``dxcontract.encodings.flat_arrays``); the rest of the body by the usual parser. These
tests hold it to the general path: the same arrays bit for bit, the same pytrees and
the same errors, whatever a sender writes (other languages' number forms and spacing,
look-alike placeholders, keys repeated, nested or hidden in strings, broken JSON).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dxclient import Client
from dxcontract import codec
from dxcontract.encodings import common, flat_arrays
from dxcontract.errors import DxError
from dxserve import JaxReverse

JSON = "application/json"
N = 20_000  # numbers: ~400 KB of text, past the body and list thresholds


def _decode(body: bytes | bytearray, keys: tuple[str, ...]) -> Any:
    """What the server makes of a request's x (``keys`` lifted), or the error."""
    try:
        obj = codec.decode_body(body, JSON, arrays=keys)
        x = codec.to_tree(obj["x"], "x") if "x" in obj else None
        return "ok", x, {k: v for k, v in obj.items() if k != "x"}
    except DxError as err:
        return "error", type(err).__name__, str(err), err.field


def _same(got: Any, want: Any) -> None:
    assert got[0] == want[0], (got, want)
    if want[0] == "error":
        assert got == want
        return
    _same_tree(got[1], want[1])
    assert got[2] == want[2]


def _same_tree(a: Any, b: Any) -> None:
    if isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()  # bit for bit: -0.0, subnormals, rounding
        assert a.flags.writeable == b.flags.writeable
        return
    assert type(a) is type(b)
    if isinstance(b, dict):
        assert a.keys() == b.keys()
        for k in b:
            _same_tree(a[k], b[k])
    elif isinstance(b, list | tuple):
        assert len(a) == len(b)
        for u, v in zip(a, b, strict=True):
            _same_tree(u, v)
    else:
        assert a == b


def _both(body: bytes) -> Any:
    """The lifted decode, checked against the whole parse; returns it."""
    got, want = _decode(body, ("x",)), _decode(body, ())
    _same(got, want)
    _same(_decode(bytearray(body), ("x",)), want)
    return got


def _numbers(x: np.ndarray) -> str:
    return json.dumps(x.tolist())


def test_a_long_list_of_numbers_is_lifted_and_decodes_identically() -> None:
    x = np.random.default_rng(0).standard_normal(N)
    body = json.dumps({"function": "f", "backend": "auto", "x": x.tolist()}).encode()
    lifted = flat_arrays.lift(body, ("x",))
    assert lifted is not None and [k for k, _ in lifted[1]] == ["x"]
    assert len(lifted[0]) < 100  # what is left for the usual parser
    got = _both(body)
    assert got[0] == "ok" and np.array_equal(got[1], x)


def test_what_other_languages_write_decodes_the_same() -> None:
    rng = np.random.default_rng(1)
    forms = [
        "0", "-0", "-0.0", "1", "1.0", "1e5", "1E5", "1e+5", "-2.5E-3", "123456789",
        "9007199254740993", "18446744073709551615", "9223372036854775808",
        "4.9e-324", "2.2250738585072011e-308", "1.7976931348623157e308", "1e-400",
        "0.1", "0.30000000000000004", "3.141592653589793238462643383279",
    ]
    items = [forms[i] for i in rng.integers(0, len(forms), N)]
    for sep in (",", ", ", ",\n  ", " ,\t"):
        text = "[" + sep.join(items) + "]"
        body = ('{"function":"f",\n "x" :\t' + text + "\n}").encode()
        assert flat_arrays.lift(body, ("x",)) is not None
        _both(body)


@pytest.mark.parametrize("inside", ["true", "null", '"1"', '"NaN"', "[1]", "{}", "1e400",
                                    "123456789012345678901234567890", "01", "1.", "+1", "NaN"])
def test_a_list_with_anything_but_numbers_is_parsed_whole(inside: str) -> None:
    items = ["1.5"] * N
    items[N // 2] = inside
    body = ('{"function":"f","x":[' + ",".join(items) + "]}").encode()
    _both(body)


def test_repeated_nested_and_hidden_keys_leave_the_body_to_the_whole_parse() -> None:
    a, b = _numbers(np.arange(N, dtype=float)), _numbers(-np.arange(N, dtype=float))
    bodies = [
        f'{{"x": {a}, "x": {b}}}',  # the last one counts, as in any parser
        f'{{"x": {{"x": {a}, "y": {b}}}}}',  # a pytree whose leaf is called x
        f'{{"contexts": [{{"x": {a}}}], "x": {b}}}',
        f'{{"a\\"x": {a}, "x": 1.5}}',  # a key ending in "x, found by the pattern
        f'{{"s": "\\"x\\": {a[:50]}", "x": {b}}}',
        f'{{"x": {a}, "y": "\\u00010"}}',  # a look-alike placeholder: nothing lifted
        f'{{"y": "\\u00010", "x": {a}}}',
        f'{{"x": "\\u00010", "z": {{"x": {a}}}}}',  # a claim on a nested list's data
        f'{{"x": [{a}, {b}]}}',  # two dimensions
    ]
    for text in bodies:
        body = text.encode()
        got = _both(body)
        if "u0001" in text:
            assert flat_arrays.lift(body, ("x",)) is None
    claim = f'{{"x": "\\u00010", "z": {{"x": {a}}}}}'.encode()
    got = _decode(claim, ("x",))
    assert got[0] == "error"  # the string x is not an array; z's list stays z's


def test_broken_json_is_reported_as_the_whole_body_would_be() -> None:
    good = '{"function": "f", "x": ' + _numbers(np.ones(N)) + "}"
    for bad in (good[:-1] + ",}", good[:-1], good.replace('"function"', "function"),
                good + "x", good.replace("]", "],]", 1)):
        got = _both(bad.encode())
        assert got[0] == "error" and got[3] == "body"


def test_lists_of_a_few_hundred_numbers_are_lifted_shorter_ones_not() -> None:
    def kind(body: bytes) -> type:
        return type(codec.decode_body(body, JSON, arrays=("x",))["x"])

    x = np.random.default_rng(3).standard_normal(300)  # ~6 KB of text
    assert kind(json.dumps({"x": x.tolist()}).encode()) is np.ndarray
    _both(json.dumps({"x": x.tolist()}).encode())
    for short in ({"x": list(range(100))}, {"pad": "a" * 40_000, "x": [1.0] * 10}):
        body = json.dumps(short).encode()
        assert kind(body) is list and flat_arrays.lift(body, ("x",)) is None
        _both(body)


def test_without_simdjson_nothing_is_lifted(monkeypatch: pytest.MonkeyPatch) -> None:
    body = json.dumps({"x": np.ones(N).tolist()}).encode()
    monkeypatch.setattr(flat_arrays, "simdjson", None)
    assert flat_arrays.lift(body, ("x",)) is None
    _both(body)


# --- fuzzed bodies ---------------------------------------------------------------------

_SPACE = st.sampled_from(["", " ", "\t", "\n ", "\r\n"])
_FLOAT = st.floats(allow_nan=False, allow_infinity=False).map(repr)
_NUMBER = st.one_of(
    _FLOAT, _FLOAT, _FLOAT,
    st.integers(-(2**63), 2**64 - 1).map(str),
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(["-0", "-0.0", "1e5", "1E-5", "2.5e+3", "1e-400", "1e400", "true",
                     "null", '"x"', "[]", "01", "NaN"]),
)


@st.composite
def _bodies(draw: st.DrawFn) -> bytes:
    """A request with a long list of numbers (now and then something else in it) under
    x or another key, and other members around it."""
    common_number = draw(_NUMBER)
    count = draw(st.integers(1, 3)) * (flat_arrays.MIN_CHARS // len(common_number) + 1)
    items = [common_number] * count
    for _ in range(draw(st.integers(0, 3))):
        items[draw(st.integers(0, count - 1))] = draw(_NUMBER)
    space = draw(_SPACE)
    numbers = "[" + ("," + space).join(items) + "]"
    if draw(st.booleans()):  # rows of a matrix, now and then one of another length
        width = draw(st.integers(1, 40))
        chunks = [items[i:i + width] for i in range(0, len(items), width)]
        numbers = "[" + ("," + space).join(
            "[" + ("," + space).join(row) + "]" for row in chunks) + space + "]"
    members = [f'"function":{draw(_SPACE)}"f"']
    key = draw(st.sampled_from(["x", "x", "x", "y", "a\\\"x"]))
    members.append(f'"{key}"{draw(_SPACE)}:{draw(_SPACE)}{numbers}')
    for _ in range(draw(st.integers(0, 2))):
        other = draw(st.sampled_from([
            '"x": 1', '"x": [1, 2]', '"c": "\\u00010"', '"n": {"x": ' + numbers + "}",
            '"x": ' + numbers, '"s": "\\\\"',
        ]))
        members.insert(draw(st.integers(0, len(members))), other)
    text = "{" + ",".join(members) + "}"
    padding = max(0, common.LIFT_MIN_BODY - len(text)) + draw(st.integers(-2, 100))
    return (text[:-1] + " " * max(0, padding) + "}").encode()


@settings(max_examples=150, deadline=None)
@given(_bodies())
def test_lifting_decodes_any_body_as_the_whole_parse_does(body: bytes) -> None:
    _both(body)


# --- over HTTP -------------------------------------------------------------------------


def test_json_gradients_over_http_are_those_of_the_binary_encoding(server) -> None:
    x = np.random.default_rng(7).uniform(-2, 2, 50_000)
    with Client(server.url, encoding="binary") as binary, Client(server.url, encoding="json") as js:
        want = binary.value_and_gradient("rosenbrock", JaxReverse(), x)
        got = js.value_and_gradient("rosenbrock", JaxReverse(), x)
        assert got[0] == want[0] and got[1].tobytes() == want[1].tobytes()
        np.testing.assert_array_equal(js.gradient("sum_of_squares", JaxReverse(), x), 2 * x)
    xm, xp = x[:-1], x[1:]
    analytic = np.zeros_like(x)
    analytic[:-1] += -400 * xm * (xp - xm**2) - 2 * (1 - xm)
    analytic[1:] += 200 * (xp - xm**2)
    np.testing.assert_allclose(got[1], analytic, rtol=1e-12, atol=1e-9)
    # as another language posts it: integers, exponents, its own spacing
    text = "[" + ", ".join(f"{v:.17e}" if i % 3 else str(round(v)) for i, v in enumerate(x)) + "]"
    body = f'{{"function": "sum_of_squares", "backend": "jax-reverse", "x": {text}}}'.encode()
    r = httpx.post(server.url + "/gradient", content=body, headers={"content-type": JSON})
    assert r.status_code == 200
    sent = np.array(json.loads(text))
    np.testing.assert_array_equal(np.array(r.json()["gradient"]), 2 * sent)
    bad = body.replace(b"[", b"[true, ", 1)  # a boolean among the numbers
    r = httpx.post(server.url + "/gradient", content=bad, headers={"content-type": JSON})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/problem")
    assert r.json()["field"].startswith("x")


def test_both_ends_lift_the_arrays_they_read(server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server lifts a request's x; the client an answer's results (not batches)."""
    from dxcontract.operators import OPERATORS
    from dxserve.pipeline import wire

    lifted: list[tuple[str, ...]] = []
    lift = flat_arrays.lift

    def recorded(data: Any, keys: tuple[str, ...]) -> Any:
        out = lift(data, keys)
        lifted.append(tuple(k for k, _ in out[1]) if out else ())
        return out

    monkeypatch.setattr(flat_arrays, "lift", recorded)
    x = np.random.default_rng(8).uniform(-2, 2, N)
    body = json.dumps({"function": "rosenbrock", "x": x.tolist()}).encode()
    req = wire.decode_operator_request(body, JSON, None, OPERATORS["gradient"])
    assert lifted == [("x",)] and req.x.tobytes() == x.tobytes()
    lifted.clear()
    with Client(server.url, encoding="json") as client:
        client.value_and_gradient("rosenbrock", JaxReverse(), x)
    assert lifted == [("gradient",)]  # the value is a number: nothing to lift there


def test_a_key_written_over_and_over_costs_one_parse_of_each_byte(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sender can't make the lifting parse the same bytes again and again, or look at
    every one of a million keys: each span is parsed at most once, and a body with the
    key more often than ``MAX_TRIES`` is parsed whole."""
    parsed: list[int] = []
    floats = flat_arrays._floats

    def counted(text: memoryview) -> Any:
        parsed.append(len(text))
        return floats(text)

    monkeypatch.setattr(flat_arrays, "_floats", counted)
    numbers = _numbers(np.ones(N))
    nested = '{"x": [' * 1000 + numbers[1:] + "]}" * 1000  # 1000 lists open, one closes
    strings = json.dumps({"s": ["x"] * 100_000, "x": np.ones(N).tolist()})
    unclosed = '{"x": [' + "1," * N + '"x": [' * 10
    for text in (nested, strings, unclosed):
        _both(text.encode())
        parsed.clear()
        flat_arrays.lift(text.encode(), ("x",))
        assert sum(parsed) <= len(text)
    parsed.clear()
    assert flat_arrays.lift(strings.encode(), ("x",)) is None and not parsed


def test_keys_are_looked_for_near_the_start_and_after_each_lifted_list() -> None:
    """The search never runs through a whole body (a 10 MB base64 string, say): a key
    opens within ``PROBE_BYTES`` of the start or of a list lifted before it."""
    a, b = np.arange(N, dtype=float), -np.arange(N, dtype=float)
    both = json.dumps({"value": a.tolist(), "gradient": b.tolist()}).encode()
    lifted = flat_arrays.lift(both, ("gradient", "value"))
    assert lifted is not None and [k for k, _ in lifted[1]] == ["value", "gradient"]
    obj = codec.decode_body(both, JSON, arrays=("gradient", "value"))
    assert obj["value"].tobytes() == a.tobytes() and obj["gradient"].tobytes() == b.tobytes()
    late = json.dumps({"pad": "a" * flat_arrays.PROBE_BYTES, "x": a.tolist()}).encode()
    assert flat_arrays.lift(late, ("x",)) is None
    _both(late)


def test_lists_of_rows_are_lifted_as_matrices_and_decode_identically() -> None:
    rng = np.random.default_rng(5)
    for shape, spacing in (((200, 100), ""), ((1, 5000), " "), ((3000, 2), "\n  ")):
        m = rng.standard_normal(shape)
        rows = ("," + spacing).join("[" + ", ".join(map(repr, r)) + "]" for r in m.tolist())
        body = ('{"x":' + spacing + "[" + spacing + rows + spacing + "]}").encode()
        obj = codec.decode_body(body, JSON, arrays=("x",))
        assert type(obj["x"]) is np.ndarray and obj["x"].shape == shape
        got = _both(body)
        assert got[1].tobytes() == m.tobytes()


@pytest.mark.parametrize("rows", [
    "[[1.5, 2], [3, 4, 5]",  # ragged: no matrix
    "[[1.5, 2], [3, [4]]",  # a list in a row (simdjson would flatten it)
    "[[1.5, 2], [[3], 4]",
    "[[[1.5, 2]], [[3, 4]]",  # three dimensions
    "[[1.5, 2], 3",
    "[[1.5, 2], [true, 4]",
    "[[1.5, 2], []",
])
def test_lists_of_rows_that_are_no_matrix_of_numbers_are_parsed_whole(rows: str) -> None:
    body = ('{"x": ' + rows + ", [1.5, 2]" * 2000 + "]}").encode()  # long: past MIN_CHARS
    assert type(codec.decode_body(body, JSON, arrays=("x",)).get("x")) is not np.ndarray
    _both(body)


def test_more_rows_than_max_rows_are_parsed_whole() -> None:
    m = np.ones((flat_arrays.MAX_ROWS + 1, 2))
    body = json.dumps({"x": m.tolist()}).encode()
    assert flat_arrays.lift(body, ("x",)) is None
    _both(body)
