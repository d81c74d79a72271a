"""Malformed requests against the real server, over ONE keep-alive connection.

Every case must answer ``application/problem+json`` (RFC 9457) with the right status,
``type``, ``title``, a ``detail`` that says what was wrong, and the exact ``field`` it
names; after each bad request a good ``/gradient`` on the same connection must still
return the right values (bad input never drops the connection or poisons the worker).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest

from dxcontract import codec
from dxcontract.errors import PROBLEM_TYPE_PREFIX, DxError

PROBLEM = "application/problem+json"
JSON = {"content-type": "application/json"}
BINARY = codec.BINARY_TYPE

GOOD_X = [1.0, 2.0, 3.0]
# d/dx of sum 100 (x[i+1] - x[i]^2)^2 + (1 - x[i])^2 at (1, 2, 3), by hand
GOOD_GRADIENT = np.array([-400.0, 1002.0, -200.0])

def _all_titles() -> dict[str, str]:
    out: dict[str, str] = {}
    stack = [DxError]
    while stack:
        cls = stack.pop()
        out[cls.slug] = cls.title
        stack.extend(cls.__subclasses__())
    return out


TITLES = _all_titles()


@dataclass(frozen=True)
class Case:
    id: str
    status: int
    slug: str  # problem type is urn:dxserve:problem:<slug>
    field: str | None
    detail: str  # a fragment the detail must contain (case-insensitive)
    path: str = "/gradient"
    body: Any = None  # a JSON value, or a callable(ctx) -> JSON value
    raw: bytes | None = None  # sent as-is instead of body
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON))
    method: str = "POST"


def rb(**kw: Any) -> dict:
    """A rosenbrock /gradient body with overrides."""
    return {"function": "rosenbrock", "x": GOOD_X, **kw}


def typed(data: Any, dtype: str = "float64", shape: list | None = None) -> dict:
    obj: dict[str, Any] = {"__ndarray__": data, "dtype": dtype}
    if shape is not None:
        obj["shape"] = shape
    return obj


def binary(header: dict, buffers: bytes = b"", length: str | None = "auto") -> tuple[bytes, dict]:
    """A binary-framed body (header padded to 64 bytes) and its HTTP headers."""
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 64)
    headers = {"content-type": BINARY}
    if length == "auto":
        headers[codec.HEADER_LENGTH] = str(len(text))
    elif length is not None:
        headers[codec.HEADER_LENGTH] = length
    return text + buffers, headers


def ref(offset: int, nbytes: int, shape: list, dtype: str = "float64") -> dict:
    return {"__ndarray__": {"offset": offset, "nbytes": nbytes}, "dtype": dtype, "shape": shape}


F64x3 = np.array(GOOD_X).tobytes() + bytes(40)
W23 = np.ones((2, 3)).tobytes() + bytes(16)


def _bin_case(id: str, header: dict, buffers: bytes, length: str | None = "auto", **kw: Any) -> Case:
    raw, headers = binary(header, buffers, length)
    return Case(id, raw=raw, headers=headers, **kw)


def _deep(levels: int, leaf: Any) -> dict:
    out = leaf
    for i in reversed(range(levels)):
        out = {f"k{i}": out}
    return out


def _second_order_chain(levels: int) -> bytes:
    """A /hessian body whose backend nests ``levels`` second-order objects (as raw
    text: deeper than the stdlib JSON encoder's recursion allows)."""
    b = '"jax-forward"'
    for _ in range(levels):
        b = '{"type": "second-order", "outer": ' + b + ', "inner": "jax-reverse"}'
    return ('{"function": "rosenbrock", "x": [1.0, 2.0, 3.0], "backend": ' + b + "}").encode()


CASES: list[Case] = [
    # --- the body itself -------------------------------------------------------
    Case("malformed-json", 400, "malformed-request", "body", "invalid json",
         raw=b'{"function": "rosenbrock", "x": [1,'),
    Case("body-not-object", 400, "malformed-request", "body", "must be a json object", body=[1, 2]),
    Case("body-empty", 400, "malformed-request", "body", "invalid json", raw=b""),
    Case("bare-nan-token", 400, "malformed-request", "body", "invalid json",
         raw=b'{"function": "rosenbrock", "x": [NaN, 1, 2]}'),
    Case("number-overflows-double", 400, "malformed-request", "body", "infinity",
         raw=b'{"function": "rosenbrock", "x": [1e400, 1, 2]}'),
    Case("invalid-utf8", 400, "malformed-request", "body", "utf-8",
         raw=b'{"function": "rosen\xff\xfe", "x": [1]}'),
    Case("unknown-top-level-field", 422, "invalid-argument", "foo", "unknown field 'foo'",
         body=rb(foo=1)),
    # --- function ----------------------------------------------------------------
    Case("missing-function", 422, "invalid-argument", "function", "registered function",
         body={"x": GOOD_X}),
    Case("function-not-string", 422, "invalid-argument", "function", "registered function",
         body=rb(function=3)),
    Case("unknown-function", 404, "unknown-function", "function", "no function named 'nope'",
         body=rb(function="nope")),
    # --- x ----------------------------------------------------------------------------
    Case("missing-x", 422, "invalid-argument", "x", "required", body={"function": "rosenbrock"}),
    Case("x-ragged", 400, "malformed-request", "x[1]", "ragged", body=rb(x=[[1.0, 2.0], [3.0]])),
    Case("x-string", 400, "malformed-request", "x[1]", "unexpected string 'a'",
         body=rb(x=[1.0, "a", 3.0])),
    Case("x-nan-misspelled", 400, "malformed-request", "x[0]", "unexpected string 'nan'",
         body=rb(x=["nan", 1.0, 2.0])),
    Case("x-bool", 400, "malformed-request", "x[2]", "booleans are not numbers",
         body=rb(x=[1.0, 2.0, True])),
    Case("x-null-element", 400, "malformed-request", "x[0]", "got null", body=rb(x=[None, 1.0])),
    Case("x-null", 400, "malformed-request", "x", "got null", body=rb(x=None)),
    Case("x-int-typed-array", 422, "dtype-mismatch", "x", "floating point",
         body=rb(x=typed([1, 2, 3], "int64", [3]))),
    Case("x-list-nested-too-deep", 400, "malformed-request", "x", "nested deeper",
         body=rb(x=json.loads("[" * 40 + "1.0" + "]" * 40))),
    Case("pytree-reserved-key", 400, "malformed-request", "x.__w", "reserved",
         body={"function": "least_squares", "x": {"__w": [1.0], "b": [0.0]}}),
    Case("pytree-nested-too-deep", 400, "malformed-request",
         ".".join(["x"] + [f"k{i}" for i in range(33)]), "nested deeper",
         body={"function": "least_squares", "x": _deep(40, [1.0])}),
    # --- typed arrays (JSON) ----------------------------------------------------------
    Case("bad-base64", 400, "malformed-request", "x", "invalid base64",
         body=rb(x=typed("!" * 32, "float64", [3]))),
    Case("base64-length-mismatch", 400, "malformed-request", "x", "base64 chars",
         body=rb(x=typed("AAAAAAAA8D8=", "float64", [3]))),
    Case("unknown-dtype", 422, "dtype-mismatch", "x", "'float128' is not allowed",
         body=rb(x=typed([1.0, 2.0, 3.0], "float128", [3]))),
    Case("typed-missing-shape", 400, "malformed-request", "x", "exactly the keys",
         body=rb(x=typed([1.0, 2.0, 3.0]))),
    Case("typed-negative-shape", 400, "malformed-request", "x", "non-negative",
         body=rb(x=typed([1.0, 2.0, 3.0], "float64", [-3]))),
    Case("typed-data-vs-shape", 400, "malformed-request", "x", "declares shape [4]",
         body=rb(x=typed([1.0, 2.0, 3.0], "float64", [4]))),
    Case("buffer-ref-in-json", 400, "malformed-request", "x", "outside a binary body",
         body=rb(x=ref(0, 24, [3]))),
    # --- backend ------------------------------------------------------------------------
    Case("backend-unknown-type", 422, "invalid-backend", "backend.type", "unknown backend type",
         body=rb(backend="jax-sideways")),
    Case("backend-not-object", 422, "invalid-backend", "backend", "backend must be",
         body=rb(backend=5)),
    Case("backend-type-not-a-string", 422, "invalid-backend", "backend.type", "unknown backend type",
         body=rb(backend={"type": ["jax-forward"]})),
    Case("backend-inner-type-an-object", 422, "invalid-backend", "backend.inner.type",
         "unknown backend type",
         body=rb(backend={"type": "second-order", "outer": "jax-forward", "inner": {"type": {}}})),
    Case("backend-batch-size-0", 422, "invalid-backend", "backend.batch_size", "positive integer",
         body=rb(backend={"type": "jax-forward", "batch_size": 0})),
    Case("backend-negative-step", 422, "invalid-backend", "backend.step", "(0, 1)",
         body=rb(backend={"type": "finite-differences", "step": -0.1})),
    Case("backend-unknown-key", 422, "invalid-backend", "backend.foo", "no parameter 'foo'",
         body=rb(backend={"type": "jax-reverse", "foo": 1})),
    Case("backend-bad-method", 422, "invalid-backend", "backend.method", "'central' or 'forward'",
         body=rb(backend={"type": "finite-differences", "method": "sideways"})),
    Case("second-order-missing-inner", 422, "invalid-backend", "backend.inner",
         "needs both 'outer' and 'inner'", path="/hessian",
         body=rb(backend={"type": "second-order", "outer": "jax-forward"})),
    Case("second-order-outer-auto", 422, "invalid-backend", "backend.outer", "first-order",
         path="/hessian",
         body=rb(backend={"type": "second-order", "outer": "auto", "inner": "jax-reverse"})),
    Case("backend-nested-too-deep", 422, "invalid-backend", "backend", "nested deeper",
         path="/hessian", raw=_second_order_chain(1000)),
    Case("second-order-for-gradient", 422, "unsupported-operator", "backend", "second-order",
         body=rb(backend={"type": "second-order", "outer": "jax-forward",
                          "inner": "jax-reverse"})),
    # --- operator vs function -----------------------------------------------------------
    Case("gradient-of-vector-function", 422, "not-scalar-output", "function", "scalar-valued",
         body=rb(function="sin_cumsum")),
    Case("derivative-with-vector-x", 422, "not-scalar-input", "x", "scalar x",
         path="/derivative", body=rb()),
    # --- tangents -----------------------------------------------------------------------
    Case("hvp-without-tangents", 422, "invalid-argument", "tangents", "needs tangents",
         path="/hvp", body=rb()),
    Case("tangents-not-a-list", 400, "malformed-request", "tangents", "must be a json list",
         path="/hvp", body=rb(tangents={"t": GOOD_X})),
    Case("tangents-empty", 422, "shape-mismatch", "tangents", "non-empty", path="/hvp",
         body=rb(tangents=[])),
    Case("tangent-wrong-shape", 422, "shape-mismatch", "tangents[1]", "(2,)", path="/hvp",
         body=rb(tangents=[[1.0, 0.0, 0.0], [1.0, 0.0]])),
    Case("tangent-wrong-dtype", 422, "dtype-mismatch", "tangents[1]", "float32", path="/hvp",
         body=rb(tangents=[[1.0, 0.0, 0.0], typed([0.0, 1.0, 0.0], "float32", [3])])),
    Case("tangent-bad-element", 400, "malformed-request", "tangents[0][2]", "got null",
         path="/pushforward", body=rb(function="sin_cumsum", tangents=[[1.0, 0.0, None]])),
    Case("pullback-tangent-shaped-like-x", 422, "shape-mismatch", "tangents[0]", "f(x)",
         path="/pullback", body=rb(function="sum_of_squares", tangents=[GOOD_X])),
    Case("pushforward-wrong-shape", 422, "shape-mismatch", "tangents[0]", "(1,)",
         path="/pushforward", body=rb(function="sin_cumsum", tangents=[[1.0]])),
    Case("tangents-on-gradient", 422, "invalid-argument", "tangents", "takes no tangents",
         body=rb(tangents=[GOOD_X])),
    # --- contexts -----------------------------------------------------------------------
    Case("contexts-not-a-list", 400, "malformed-request", "contexts", "must be a json list",
         body=rb(contexts="W")),
    Case("contexts-bad-element", 400, "malformed-request", "contexts[0][1]", "unexpected string",
         body={"function": "tanh_layer", "x": GOOD_X, "contexts": [[1.0, "W"]]}),
    # The function itself fails on these shapes: the argument whose shape differs from
    # the function's example is named, then JAX's text.
    Case("contexts-wrong-shape", 422, "evaluation-failed", "contexts[0]", "dot_general",
         path="/jacobian",
         body={"function": "tanh_layer", "x": GOOD_X, "contexts": [[[1.0, 2.0]] * 2]}),
    # --- binary framing -------------------------------------------------------------------
    _bin_case("binary-missing-header-length", {"function": "rosenbrock", "x": ref(0, 24, [3])},
              F64x3, None, status=400, slug="malformed-request", field=codec.HEADER_LENGTH,
              detail="needs the dxserve-header-length header"),
    _bin_case("binary-non-numeric-length", {"function": "rosenbrock", "x": ref(0, 24, [3])},
              F64x3, "sixty-four", status=400, slug="malformed-request",
              field=codec.HEADER_LENGTH, detail="decimal integer"),
    _bin_case("binary-length-beyond-body", {"function": "rosenbrock", "x": ref(0, 24, [3])},
              F64x3, "100000", status=400, slug="malformed-request", field=codec.HEADER_LENGTH,
              detail="exceeds the body length"),
    _bin_case("binary-header-not-json", {"function": "rosenbrock"}, b"", "1",
              status=400, slug="malformed-request", field="header", detail="invalid json"),
    _bin_case("binary-offset-out-of-range", {"function": "rosenbrock", "x": ref(64, 24, [3])},
              F64x3, status=400, slug="malformed-request", field="x", detail="runs past"),
    _bin_case("binary-nbytes-mismatch", {"function": "rosenbrock", "x": ref(0, 16, [3])},
              F64x3, status=400, slug="malformed-request", field="x", detail="nbytes 16"),
    _bin_case("binary-context-nbytes-mismatch",
              {"function": "tanh_layer", "x": ref(0, 24, [3]), "contexts": [ref(64, 40, [2, 3])]},
              F64x3 + W23, status=400, slug="malformed-request", field="contexts[0]",
              detail="nbytes 40"),
    _bin_case("binary-pytree-bad-ref",
              {"function": "least_squares", "x": {"w": ref(0, 24, [3], "float99")}},
              F64x3, status=422, slug="dtype-mismatch", field="x.w", detail="'float99'"),
    # --- media types ------------------------------------------------------------------------
    Case("content-type-text-plain", 415, "unsupported-media-type", "Content-Type", "text/plain",
         raw=json.dumps(rb()).encode(), headers={"content-type": "text/plain"}),
    Case("no-content-type", 415, "unsupported-media-type", "Content-Type", "no content-type",
         raw=json.dumps(rb()).encode(), headers={}),
    # --- prepared handles ----------------------------------------------------------------------
    Case("unknown-prep", 404, "unknown-preparation", "prep", "'no-such-handle'",
         body=rb(prep="no-such-handle")),
    Case("prep-not-a-string", 422, "invalid-argument", "prep", "handle string", body=rb(prep=7)),
    Case("prep-shape-mismatch", 409, "preparation-mismatch", "x", "differs from prepared",
         body=lambda ctx: rb(x=[1.0, 2.0], backend="jax-reverse", prep=ctx["prep"])),
    Case("prep-other-operator", 409, "preparation-mismatch", "prep", "made for gradient",
         path="/hessian", body=lambda ctx: rb(backend="jax-reverse", prep=ctx["prep"])),
    Case("prep-other-backend", 409, "preparation-mismatch", "backend", "made for backend",
         body=lambda ctx: rb(backend="jax-forward", prep=ctx["prep"])),
    Case("prepare-bad-x", 400, "malformed-request", "x[2]", "unexpected string",
         path="/prepare/gradient", body=rb(x=[1.0, 2.0, "three"])),
    # --- routing ---------------------------------------------------------------------------------
    Case("get-on-operator-route", 405, "method-not-allowed", "method", "use post",
         method="GET", headers={}),
    Case("unknown-route", 404, "not-found", "path", "no route post /gradientt",
         path="/gradientt", body=rb()),
    # JAX's names are not aliases (their return shapes would differ from jax.jvp/jax.vjp)
    Case("jvp-is-not-a-route", 404, "not-found", "path", "no route post /jvp",
         path="/jvp", body=rb(function="sin_cumsum", tangents=[[1.0, 0.0, 0.0]])),
    # --- the registry ------------------------------------------------------------------------------
    Case("register-hostile-expression", 422, "invalid-expression", "expression", "__import__",
         path="/functions",
         body={"name": "evil", "expression": "__import__('os').system('true')"}),
    Case("register-missing-name", 422, "invalid-argument", "name", "field required",
         path="/functions", body={"expression": "jnp.sum(x)"}),
    Case("register-bad-name", 422, "invalid-argument", "name", "pattern",
         path="/functions", body={"name": "../etc/passwd", "expression": "jnp.sum(x)"}),
    Case("register-both-kinds", 422, "invalid-argument", "expression", "exactly one",
         path="/functions", body={"name": "both", "expression": "jnp.sum(x)", "export": "AAAA"}),
    Case("register-unknown-field", 422, "invalid-argument", "bogus", "extra inputs",
         path="/functions", body={"name": "e", "expression": "jnp.sum(x)", "bogus": 1}),
    Case("register-malformed-json", 400, "malformed-request", "body", "invalid json",
         path="/functions", raw=b'{"name": '),
    Case("register-text-plain", 415, "unsupported-media-type", "Content-Type", "text/plain",
         path="/functions", raw=b'{"name": "e", "expression": "x"}',
         headers={"content-type": "text/plain"}),
    Case("register-replace-module-function", 409, "function-conflict", "name", "server-side",
         path="/functions", body={"name": "rosenbrock", "expression": "jnp.sum(x)"}),
    Case("delete-unknown-function", 404, "unknown-function", "name", "'nope'",
         path="/functions/nope", method="DELETE", headers={}),
    Case("delete-module-function", 409, "function-conflict", "name", "server-side",
         path="/functions/rosenbrock", method="DELETE", headers={}),
    Case("get-unknown-function", 404, "unknown-function", "name", "'nope'",
         path="/functions/nope", method="GET", headers={}),
]  # fmt: skip


def _port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


class Connection:
    """One httpx client limited to one connection; records the local port it uses."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(
            base_url=url,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
        )
        self.port: int | None = None
        self.ctx: dict[str, Any] = {}

    def send(self, method: str, path: str, content: bytes | None, headers: dict) -> httpx.Response:
        response = self.http.request(method, path, content=content, headers=headers)
        port = _port(response)
        if self.port is None:
            self.port = port
        assert port == self.port, f"a new connection was opened (local port {port} != {self.port})"
        return response

    def good_gradient(self) -> None:
        r = self.send("POST", "/gradient", json.dumps(rb()).encode(), JSON)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/json"
        np.testing.assert_allclose(np.array(r.json()["gradient"]), GOOD_GRADIENT, rtol=1e-12)


@pytest.fixture(scope="module")
def conn(server: Any) -> Iterator[Connection]:
    c = Connection(server.url)
    c.good_gradient()  # pins the connection's local port
    r = c.send("POST", "/prepare/gradient", json.dumps(rb(backend="jax-reverse")).encode(), JSON)
    assert r.status_code == 200, r.text
    c.ctx["prep"] = r.json()["prep"]
    yield c
    c.http.close()


def test_table_is_big_enough() -> None:
    assert len(CASES) >= 35
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_request(conn: Connection, case: Case) -> None:
    if case.raw is not None:
        content = case.raw
    elif case.body is not None:
        body = case.body(conn.ctx) if callable(case.body) else case.body
        content = json.dumps(body).encode()
    else:
        content = None
    r = conn.send(case.method, case.path, content, case.headers)

    assert r.status_code == case.status, r.text
    assert r.headers["content-type"] == PROBLEM
    assert "connection" not in r.headers or r.headers["connection"].lower() != "close"
    problem = r.json()
    assert problem["type"] == PROBLEM_TYPE_PREFIX + case.slug, problem
    assert problem["status"] == case.status
    assert problem["title"] == TITLES.get(case.slug, problem["title"]) and problem["title"]
    assert isinstance(problem["detail"], str)
    assert case.detail.lower() in problem["detail"].lower(), problem["detail"]
    assert problem.get("field") == case.field, problem
    if case.status == 405:
        assert r.headers["allow"] == "POST"

    conn.good_gradient()  # same connection, still serving, right values


def _check_413(r: httpx.Response, limit: int) -> None:
    assert r.status_code == 413, r.text
    assert r.headers["content-type"] == PROBLEM
    problem = r.json()
    assert problem["type"] == PROBLEM_TYPE_PREFIX + "payload-too-large"
    assert problem["title"] == TITLES["payload-too-large"]
    assert problem["status"] == 413
    assert f"limit of {limit} bytes" in problem["detail"]
    assert problem["field"] == "body"


def test_body_too_large(make_server: Callable[..., Any]) -> None:
    """413 may close the connection (the body is left unread); a new one then works."""
    limit = 2048
    srv = make_server(env={"DXSERVE_MAX_BODY_BYTES": str(limit)})
    big = json.dumps(rb(x=[0.5] * 2000)).encode()
    assert len(big) > limit
    with httpx.Client(
        base_url=srv.url, limits=httpx.Limits(max_connections=1)
    ) as http:
        small = http.post("/gradient", content=json.dumps(rb()).encode(), headers=JSON)
        assert small.status_code == 200
        first_port = _port(small)

        r = http.post("/gradient", content=big, headers=JSON)  # declared Content-Length
        _check_413(r, limit)
        assert r.headers.get("connection", "").lower() == "close"

        again = http.post("/gradient", content=json.dumps(rb()).encode(), headers=JSON)
        assert again.status_code == 200, again.text
        np.testing.assert_allclose(again.json()["gradient"], GOOD_GRADIENT)
        assert _port(again) != first_port  # a new connection

        # chunked (no Content-Length): counted while streaming
        r = http.post("/gradient", content=iter([big[:1500], big[1500:]]), headers=JSON)
        _check_413(r, limit)
        after = http.post("/gradient", content=json.dumps(rb()).encode(), headers=JSON)
        assert after.status_code == 200, after.text


def test_no_internal_errors(server: Any) -> None:
    """None of the bad requests above became a 500 (the metrics count every status)."""
    text = httpx.get(server.url + "/metrics").text
    assert 'status="500"' not in text
    assert 'dxserve_errors_total{status="400"}' in text
