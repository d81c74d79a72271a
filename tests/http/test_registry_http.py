"""Registering functions from anywhere, through the real server.

Uploaded JAX exports (through ``dxclient``) and expressions (over plain HTTP
JSON) must give every applicable operator, with every backend, the same results
as the original function run in process; the registry must survive restarts,
including a SIGKILL.
"""

from __future__ import annotations

import base64
import os
import signal

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

import dxserve
from dxclient import Client, JaxForward, JaxReverse, SecondOrder
from dxclient.export import export_function
from dxcontract.errors import InvalidExportError, PayloadTooLargeError, TooManyFunctionsError
from dxcontract.operators import OPERATORS
from dxserve.frameworks.jax.expressions import compile_expression
from tests.conftest import start_server, stop_server

RTOL = 1e-12
FIRST = ["jax-forward", "jax-reverse", "auto", JaxForward(batch_size=2), JaxReverse(batch_size=2)]
SECOND = [
    "auto",
    SecondOrder(JaxForward(), JaxReverse()),
    SecondOrder(JaxReverse(), JaxReverse()),
    SecondOrder(JaxReverse(), JaxForward()),
    SecondOrder(JaxForward(), JaxForward()),
]


def rosenbrock(x):
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def pytree_loss(p, X, Y):
    r = jnp.tanh(X @ p["w"] + p["b"]) - Y
    return 0.5 * jnp.sum(r**2)


def vector_map(x, A):
    return jnp.tanh(A @ x) * x[:3]


RNG = np.random.default_rng(7)
X4 = np.array([0.5, -1.2, 0.8, 1.5])
PARAMS = {"w": RNG.normal(size=(3, 2)), "b": RNG.normal(size=2)}
DATA = (RNG.normal(size=(5, 3)), RNG.normal(size=(5, 2)))
A = RNG.normal(size=(3, 4))

# (name, function, x, contexts, output is scalar, x is a pytree)
CASES = [
    ("up_rosenbrock", rosenbrock, X4, (), True, False),
    ("up_pytree_loss", pytree_loss, PARAMS, DATA, True, True),
    ("up_vector_map", vector_map, X4, (A,), False, False),
]


def _like(x, scale):
    return {k: scale * np.ones_like(v) for k, v in x.items()} if isinstance(x, dict) else scale * np.ones_like(x)


def _calls(x, contexts, scalar, pytree, y, turn=None):
    """(operator, args) pairs applicable to one function: every operator with every
    backend, or (``turn`` an int) with one first- and one second-order backend, taken in
    turn."""
    t = (_like(x, 0.3), _like(x, -0.7))
    c = (np.full(np.shape(y), 0.4), np.full(np.shape(y), -1.1))
    calls = [("value", (x, *contexts))]
    first = FIRST if turn is None else [FIRST[turn % len(FIRST)]]
    second = SECOND if turn is None else [SECOND[turn % len(SECOND)]]
    for b in first:
        calls += [
            ("pushforward", (b, x, t, *contexts)),
            ("value_and_pushforward", (b, x, t, *contexts)),
            ("pullback", (b, x, c, *contexts)),
        ]
        if scalar:
            calls += [("gradient", (b, x, *contexts)), ("value_and_gradient", (b, x, *contexts))]
        if not pytree:
            calls += [("jacobian", (b, x, *contexts)), ("value_and_jacobian", (b, x, *contexts))]
    if scalar:
        for b in second:
            calls += [("hvp", (b, x, t, *contexts)), ("gradient_and_hvp", (b, x, t, *contexts))]
            if not pytree:
                calls += [("hessian", (b, x, *contexts)), ("value_gradient_and_hessian", (b, x, *contexts))]
    return calls


def _assert_close(got, want, where):
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), where
        for g, w in zip(got, want, strict=True):
            _assert_close(g, w, where)
    elif isinstance(want, dict):
        assert set(got) == set(want), where
        for k in want:
            _assert_close(got[k], want[k], f"{where}.{k}")
    else:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=1e-13, err_msg=where)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("registry"), modules=("dxserve.examples",))
    yield srv
    stop_server(srv)


# make test: every operator, a backend of each order in turn; make test-slow: every backend
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_uploaded_export_matches_in_process(fresh, case):
    _uploaded_matches(fresh, case, turn=CASES.index(case))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_uploaded_export_matches_in_process_every_backend(fresh, case):
    _uploaded_matches(fresh, case, turn=None)


def _uploaded_matches(fresh, case, turn):
    name, fn, x, contexts, scalar, pytree = case
    with Client(fresh.url) as client:
        remote = client.register(fn, x, *contexts, name=name, description="uploaded",
                                 replace=True)
        assert remote.kind == "export"
        y = fn(x, *contexts)
        for op, args in _calls(x, contexts, scalar, pytree, y, turn):
            if op == "value":
                got = client.value(remote, "auto", *args)
                want = dxserve.value(fn, "auto", *args)
            else:
                got = getattr(client, op)(remote, *args)
                want = getattr(dxserve, op)(fn, *args)
            _assert_close(got, want, f"{name} {op} {args[0] if op != 'value' else ''}")


def test_polymorphic_export_serves_many_sizes(fresh):
    with Client(fresh.url) as client:
        remote = client.register(
            rosenbrock, np.ones(3), name="up_rosen_poly", polymorphic_shapes=("(n,)",),
            constraints=("n >= 2",),
        )
        for n in (3, 7, 20):
            x = np.linspace(-1.0, 1.5, n)
            _assert_close(client.gradient(remote, "jax-reverse", x), dxserve.gradient(rosenbrock, "jax-reverse", x), n)
            t = (np.ones(n),)
            _assert_close(client.hvp(remote, "auto", x, t), dxserve.hvp(rosenbrock, "auto", x, t), n)


def test_export_for_another_platform_is_refused(fresh):
    bundle = export_function(rosenbrock, np.ones(3), platforms=("cuda",))
    body = {"name": "cuda_only", "export": base64.b64encode(bundle).decode()}
    r = httpx.post(fresh.url + "/functions", json=body)
    assert r.status_code == 422
    problem = r.json()
    assert r.headers["content-type"] == "application/problem+json"
    assert problem["field"] == "export" and "cuda" in problem["detail"]
    with Client(fresh.url) as client, pytest.raises(InvalidExportError):
        client.register(rosenbrock, np.ones(3), name="cuda_again", platforms=("cuda",))


EXPRESSIONS = [
    # name, expression, args, x, contexts, scalar
    ("ex_rosen", "jnp.sum(100*(x[1:]-x[:-1]**2)**2 + (1-x[:-1])**2)", ["x"], [0.5, -1.2, 0.8, 1.5], [], True),
    ("ex_quad", "0.5 * x @ (A @ x) + jnp.sum(jnp.log1p(jnp.exp(x)))", ["x", "A"], [0.3, -0.2, 0.9],
     [[[2.0, 0.5, 0.1], [0.5, 1.0, 0.2], [0.1, 0.2, 3.0]]], True),
    ("ex_vec", "jnp.tanh(W @ x) * jnp.sum(x**2)", ["x", "W"], [0.1, 0.4, -0.3, 0.8],
     [[[1.0, 2.0, 0.5, -1.0], [0.3, -0.7, 1.1, 0.2]]], False),
]


JSON_FIRST = ["jax-forward", "jax-reverse", "auto", {"type": "jax-forward", "batch_size": 2}]


def _json_ops(x, y_shape, scalar, turn=None):
    """Every operator with every backend, or (``turn`` an int) with one backend of each
    order, taken in turn."""
    t = [list(0.5 * np.ones(len(x))), list(-np.ones(len(x)))]
    c = [np.full(y_shape, 0.25).tolist(), np.full(y_shape, -2.0).tolist()]
    ops = [("value", "auto", None)]
    first = JSON_FIRST if turn is None else [JSON_FIRST[turn % len(JSON_FIRST)]]
    second = SECOND if turn is None else [SECOND[turn % len(SECOND)]]
    for b in first:
        ops += [("pushforward", b, t), ("pullback", b, c), ("jacobian", b, None), ("value_and_jacobian", b, None)]
        if scalar:
            ops += [("gradient", b, None), ("value_and_gradient", b, None)]
    if scalar:
        for b in second:
            bj = b if isinstance(b, str) else b.to_json()
            ops += [("hvp", bj, t), ("hessian", bj, None), ("value_gradient_and_hessian", bj, None)]
    return ops


# make test: every operator, a backend of each order in turn; make test-slow: every backend
@pytest.mark.parametrize("spec", EXPRESSIONS, ids=[e[0] for e in EXPRESSIONS])
def test_expression_over_plain_json_matches_in_process(fresh, spec):
    _expression_matches(fresh, spec, turn=EXPRESSIONS.index(spec))


@pytest.mark.slow
@pytest.mark.parametrize("spec", EXPRESSIONS, ids=[e[0] for e in EXPRESSIONS])
def test_expression_over_plain_json_matches_in_process_every_backend(fresh, spec):
    _expression_matches(fresh, spec, turn=None)


def _expression_matches(fresh, spec, turn):
    name, expression, args, x, contexts, scalar = spec
    with httpx.Client(base_url=fresh.url) as http:
        r = http.post("/functions", json={"name": name, "expression": expression, "args": args,
                                          "replace": True})
        assert r.status_code in (200, 201), r.text
        assert r.json()["kind"] == "expression"
        local = compile_expression(expression, args)
        xa = np.asarray(x)
        ctx = tuple(np.asarray(c) for c in contexts)
        y_shape = np.shape(local(xa, *ctx))
        for op, backend, tangents in _json_ops(x, y_shape, scalar, turn):
            body = {"function": name, "backend": backend, "x": x, "contexts": contexts}
            if tangents is not None:
                body["tangents"] = tangents
            r = http.post(f"/{op}", json=body)
            assert r.status_code == 200, (op, backend, r.text)
            answer = r.json()
            b = dxserve.backend_from_json(backend)
            lib_args = (xa, tuple(np.asarray(t) for t in tangents)) if tangents is not None else (xa,)
            want = getattr(dxserve, op)(local, b, *lib_args, *ctx)
            results = OPERATORS[op].results
            want = want if len(results) > 1 else (want,)
            for key, w in zip(results, want, strict=True):
                got = answer[key]
                if isinstance(w, tuple):
                    assert len(got) == len(w)
                    for g, wi in zip(got, w, strict=True):
                        np.testing.assert_allclose(np.asarray(g), np.asarray(wi), rtol=RTOL, atol=1e-13, err_msg=f"{op} {backend}")
                else:
                    np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=RTOL, atol=1e-13, err_msg=f"{op} {backend}")


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_registry_survives_restart(tmp_path, how):
    store = tmp_path / "store"
    args = ("--store", str(store))
    srv = start_server(tmp_path / "a", args=args, modules=("dxserve.examples",))
    x = np.array([0.5, -1.2, 0.8])
    try:
        with Client(srv.url) as client:
            client.register(rosenbrock, x, name="kept_export")
            client.register_expression("kept_expr", "jnp.sum(jnp.sin(x) * x)", description="sine")
            client.register_expression("kept_ctx", "jnp.sum((A @ x) ** 2)", args=("x", "A"))
            before = {
                "kept_export": client.hvp("kept_export", "auto", x, (np.ones(3),)),
                "kept_expr": client.gradient("kept_expr", "auto", x),
                "kept_ctx": client.hessian("kept_ctx", "auto", x, np.eye(3)),
            }
    finally:
        if how == signal.SIGKILL:
            os.kill(srv.proc.pid, signal.SIGKILL)
            srv.proc.wait(timeout=10)
        else:
            stop_server(srv)
    again = start_server(tmp_path / "b", args=args, modules=("dxserve.examples",))
    try:
        with Client(again.url) as client:
            listed = {f.name: f for f in client.functions()}
            assert {"kept_export", "kept_expr", "kept_ctx"} <= set(listed)
            assert listed["kept_expr"].description == "sine"
            assert listed["kept_export"].kind == "export"
            after = {
                "kept_export": client.hvp("kept_export", "auto", x, (np.ones(3),)),
                "kept_expr": client.gradient("kept_expr", "auto", x),
                "kept_ctx": client.hessian("kept_ctx", "auto", x, np.eye(3)),
            }
        for key in before:
            _assert_close(after[key], before[key], key)
    finally:
        stop_server(again)


def test_idempotent_conflict_replace_delete(fresh):
    with Client(fresh.url) as client:
        a = client.register_expression("same", "jnp.sum(x**2)")
        b = client.register_expression("same", "jnp.sum(x**2)")
        assert a == b
        with pytest.raises(Exception) as info:
            client.register_expression("same", "jnp.sum(x**4)")
        assert info.value.status == 409 and info.value.field == "name"
        client.register_expression("same", "jnp.sum(x**4)", replace=True)
        np.testing.assert_allclose(client.gradient("same", "auto", np.array([2.0])), [32.0])
        client.delete("same")
        assert "same" not in {f.name for f in client.functions()}


def test_upload_and_count_limits(make_server):
    srv = make_server(
        env={
            "DXSERVE_MAX_UPLOAD_BYTES": "2000",
            "DXSERVE_MAX_FUNCTIONS": "2",
            "DXSERVE_MAX_RESULT_ELEMENTS": "5000",
        }
    )
    with Client(srv.url) as client:
        with pytest.raises(PayloadTooLargeError):
            client.register(rosenbrock, np.ones(3), name="too_big")
        client.register_expression("one", "jnp.sum(x)")
        client.register_expression("two", "jnp.sum(x**2)")
        with pytest.raises(TooManyFunctionsError) as info:
            client.register_expression("three", "jnp.sum(x**3)")
        assert info.value.status == 429
        # the examples (server-side functions) do not count against the limit
        assert len(client.functions()) > 2
        # a dense Hessian of n = 100 would return 10,101 numbers: refused before compiling
        r = httpx.post(srv.url + "/hessian", json={"function": "rosenbrock", "x": [0.5] * 100})
        assert r.status_code == 422 and r.json()["type"].endswith("result-too-large")
        assert r.json()["field"] == "x"
        hv = client.hvp("rosenbrock", "auto", np.full(100, 0.5), (np.ones(100),))
        assert hv[0].shape == (100,)


def _hostile():
    from tests.library.test_expressions import HOSTILE

    return HOSTILE


@pytest.fixture(scope="module")
def http(fresh):
    with httpx.Client(base_url=fresh.url, limits=httpx.Limits(max_connections=1)) as client:
        yield client


@pytest.mark.parametrize("hostile", _hostile(), ids=lambda h: repr(h[0][:30]))
def test_hostile_expression_refused_over_http(http, hostile):
    source, args, field, needle = hostile
    before = {f["name"] for f in http.get("/functions").json()["functions"]}
    r = http.post("/functions", json={"name": "hostile", "expression": source, "args": args})
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"
    problem = r.json()
    assert problem["field"].startswith(field)  # pydantic may name the item: args[1]
    assert needle in problem["detail"] or problem["field"] != field
    after = {f["name"] for f in http.get("/functions").json()["functions"]}
    assert after == before  # nothing registered, the server still answers
