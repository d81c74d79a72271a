"""Acceptance tests of the in-process library beyond the conformance grid.

(a) second order is forward-over-reverse by default; (b) preparation and the implicit
cache never re-run the Python function, and mismatched calls fail clearly; (c) finite
differences on plain numpy functions; (d) pytree inputs keep their structure; (e) Auto's
choice of mode; (f) contexts are not differentiated; (g) backend descriptors as JSON.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import dxserve
from dxcontract.errors import (
    InvalidBackendError,
    PreparationMismatchError,
    UnsupportedOperatorError,
)
from dxserve import Auto, FiniteDifferences, JaxForward, JaxReverse, SecondOrder

try:  # imported as a top-level module by pytest (tests/ has no __init__.py)
    import scenarios as sc
except ImportError:  # pragma: no cover
    from tests import scenarios as sc

FWD_REV = SecondOrder(JaxForward(), JaxReverse())
RTOL = 1e-8
FD_RTOL = 1e-7  # central differences, first order (measured ~1e-10, see test_conformance)
FD2_RTOL = 1e-5  # central over central (measured ~1e-7)


def close(actual, expected, rtol=RTOL, scaled=False):
    sc.assert_close(actual, expected, rtol=rtol, atol=rtol if scaled else 1e-10, scaled=scaled)


def sin_sq(x):
    return jnp.sum(jnp.sin(x) * x**2)


X3 = np.array([0.5, -1.0, 2.0])


def sin_sq_refs(x):
    grad = np.cos(x) * x**2 + 2 * x * np.sin(x)
    hess = np.diag(-np.sin(x) * x**2 + 4 * x * np.cos(x) + 2 * np.sin(x))
    return grad, hess


# --- (a) forward-over-reverse by default ------------------------------------------------
@pytest.mark.parametrize("backend", ["auto", "jax-reverse", "jax-forward", JaxReverse(), Auto()])
@pytest.mark.parametrize("operator", ["hvp", "gradient_and_hvp", "hessian",
                                      "value_gradient_and_hessian"])
def test_second_order_resolves_to_forward_over_reverse(backend, operator):
    assert dxserve.resolve(backend, operator, sin_sq, X3) == FWD_REV


def test_second_derivative_resolves_to_forward_over_reverse():
    assert dxserve.resolve("auto", "second_derivative", jnp.sin, 0.3) == FWD_REV
    assert dxserve.resolve("jax-reverse", "second_derivative", jnp.sin, 0.3) == FWD_REV


def test_single_backend_keeps_its_batch_size_on_the_outer_mode():
    got = dxserve.resolve(JaxReverse(batch_size=3), "hessian", sin_sq, X3)
    assert got == SecondOrder(JaxForward(batch_size=3), JaxReverse())
    fd = FiniteDifferences("forward")
    assert dxserve.resolve(fd, "hvp", sin_sq, X3) == SecondOrder(fd, fd)
    explicit = SecondOrder(JaxReverse(), JaxReverse())
    assert dxserve.resolve(explicit, "hvp", sin_sq, X3) == explicit


@pytest.mark.parametrize("backend", ["auto", "jax-reverse"])
def test_prepared_hvp_records_forward_over_reverse(backend):
    t = np.ones(3)
    prep = dxserve.prepare_hvp(sin_sq, backend, X3, (t,))
    assert prep.resolved == FWD_REV
    assert prep.backend == dxserve.backend_from_json(backend)
    (hv,) = dxserve.hvp(sin_sq, backend, X3, (t,), prep=prep)
    close(hv, sin_sq_refs(X3)[1] @ t)
    assert dxserve.prepare_hessian(sin_sq, backend, X3).resolved == FWD_REV


# --- (b) preparation and the implicit cache ---------------------------------------------
def counted(body):
    """``f`` that counts how often its Python body runs (only while tracing)."""
    calls = []

    def f(x, *contexts):
        calls.append(1)
        return body(x, *contexts)

    f.calls = calls
    return f


def test_prepared_calls_never_rerun_the_python_function():
    f = counted(sin_sq)
    prep = dxserve.prepare_gradient(f, "jax-reverse", X3)
    traced = len(f.calls)
    assert traced >= 1
    for i in range(10):
        g = dxserve.gradient(f, "jax-reverse", X3 + i, prep=prep)
        close(g, sin_sq_refs(X3 + i)[0])
    assert len(f.calls) == traced


@pytest.mark.parametrize("backend", ["jax-forward", "auto", "finite-differences"])
def test_prepared_calls_with_tangents_never_rerun(backend):
    f = counted(sin_sq)
    t = (np.ones(3), np.arange(3.0))
    prep = dxserve.prepare_hvp(f, backend, X3, t)
    traced = len(f.calls)
    for _ in range(10):
        dxserve.hvp(f, backend, X3, t, prep=prep)
    assert len(f.calls) == traced


def test_implicit_cache_does_not_retrace():
    f = counted(sin_sq)
    g0 = dxserve.gradient(f, "jax-reverse", X3)
    traced = len(f.calls)
    hits = dxserve.CACHE.hits
    for i in range(5):
        g = dxserve.gradient(f, JaxReverse(), X3 + i)  # the descriptor equals the shorthand
        close(g, sin_sq_refs(X3 + i)[0])
    assert len(f.calls) == traced
    assert dxserve.CACHE.hits >= hits + 5
    close(g0, sin_sq_refs(X3)[0])


def test_implicit_cache_compiles_once_per_signature():
    f = counted(sin_sq)
    dxserve.gradient(f, "jax-reverse", X3)
    traced = len(f.calls)
    dxserve.gradient(f, "jax-reverse", np.ones(4))  # a new shape is a new signature
    assert len(f.calls) > traced
    again = len(f.calls)
    dxserve.gradient(f, "jax-reverse", np.ones(4))
    dxserve.gradient(f, "jax-reverse", X3)
    assert len(f.calls) == again


def _mismatch(call, field):
    with pytest.raises(PreparationMismatchError) as info:
        call()
    assert info.value.field == field, info.value
    from dxserve.http.problems import status_of  # library errors carry no HTTP status

    assert type(info.value) is PreparationMismatchError and status_of(info.value) == 409
    return info.value


def test_mismatched_x_shape_and_dtype():
    prep = dxserve.prepare_gradient(sin_sq, "jax-reverse", X3)
    err = _mismatch(lambda: dxserve.gradient(sin_sq, "jax-reverse", np.ones(4), prep=prep), "x")
    assert "shape" in err.detail
    err = _mismatch(
        lambda: dxserve.gradient(sin_sq, "jax-reverse", X3.astype(np.float32), prep=prep), "x"
    )
    assert "dtype" in err.detail


def test_mismatched_number_and_shape_of_tangents():
    t = np.ones(3)
    prep = dxserve.prepare_pushforward(sin_sq, "jax-forward", X3, (t,))
    _mismatch(lambda: dxserve.pushforward(sin_sq, "jax-forward", X3, (t, t), prep=prep),
              "tangents")
    _mismatch(lambda: dxserve.pushforward(sin_sq, "jax-forward", X3, (np.ones(4),), prep=prep),
              "tangents[0]")


def quad_ctx(x, A):
    return 0.5 * x @ (A @ x)


def test_mismatched_context_shape():
    A = np.eye(3)
    prep = dxserve.prepare_gradient(quad_ctx, "jax-reverse", X3, A)
    _mismatch(lambda: dxserve.gradient(quad_ctx, "jax-reverse", X3, np.eye(4), prep=prep),
              "contexts[0]")
    _mismatch(lambda: dxserve.gradient(quad_ctx, "jax-reverse", X3, prep=prep), "contexts")
    close(dxserve.gradient(quad_ctx, "jax-reverse", X3, 2 * A, prep=prep), 2 * X3)


def test_mismatched_operator_backend_function():
    prep = dxserve.prepare_gradient(sin_sq, "jax-reverse", X3)
    _mismatch(lambda: dxserve.hvp(sin_sq, "jax-reverse", X3, (X3,), prep=prep), "prep")
    _mismatch(lambda: dxserve.gradient(sin_sq, "jax-forward", X3, prep=prep), "backend")
    _mismatch(lambda: dxserve.gradient(lambda x: jnp.sum(x), "jax-reverse", X3, prep=prep),
              "function")
    # the other operator of the family accepts the prep
    v, g = dxserve.value_and_gradient(sin_sq, "jax-reverse", X3, prep=prep)
    close(g, sin_sq_refs(X3)[0])
    close(v, np.sum(np.sin(X3) * X3**2))


# --- (c) finite differences on black-box numpy functions --------------------------------
def np_scalar(x):
    """x0 sum(sin x) + sum(x^2): numpy and float(), so JAX cannot trace it."""
    x = np.asarray(x)
    return float(x[0]) * np.sum(np.sin(x)) + np.sum(x**2)


def np_scalar_refs(x):
    grad = x[0] * np.cos(x) + 2 * x
    grad[0] += np.sum(np.sin(x))
    hess = np.diag(-x[0] * np.sin(x) + 2)
    hess[0, :] += np.cos(x)
    hess[:, 0] += np.cos(x)
    return grad, hess


def np_vector(x):
    """R^3 -> R^4 in numpy."""
    x = np.asarray(x)
    return np.array([np.sin(x[0]) * x[1], np.exp(x[1]), x[0] * x[2] ** 2, float(x[0]) + x[1]])


def np_vector_jacobian(x):
    return np.array([
        [np.cos(x[0]) * x[1], np.sin(x[0]), 0.0],
        [0.0, np.exp(x[1]), 0.0],
        [x[2] ** 2, 0.0, 2 * x[0] * x[2]],
        [1.0, 1.0, 0.0],
    ])


XB = np.array([0.7, -0.4, 1.3])


@pytest.mark.parametrize("backend", ["finite-differences", "auto"])
def test_black_box_first_order(backend):
    grad, _ = np_scalar_refs(XB)
    J = np_vector_jacobian(XB)
    t, c = np.array([1.0, -2.0, 0.5]), np.array([0.3, 1.0, -1.0, 2.0])
    close(dxserve.gradient(np_scalar, backend, XB), grad, FD_RTOL, scaled=True)
    close(dxserve.jacobian(np_vector, backend, XB), J, FD_RTOL, scaled=True)
    close(dxserve.pushforward(np_vector, backend, XB, (t, -t)), (J @ t, -J @ t), FD_RTOL,
          scaled=True)
    close(dxserve.pullback(np_vector, backend, XB, (c, -c)), (J.T @ c, -J.T @ c), FD_RTOL,
          scaled=True)
    v, g = dxserve.value_and_gradient(np_scalar, backend, XB)
    close(v, np_scalar(XB))


@pytest.mark.parametrize("backend", ["finite-differences", "auto",
                                     SecondOrder(FiniteDifferences(), FiniteDifferences())])
def test_black_box_second_order(backend):
    grad, hess = np_scalar_refs(XB)
    t = np.array([1.0, -2.0, 0.5])
    close(dxserve.hessian(np_scalar, backend, XB), hess, FD2_RTOL, scaled=True)
    close(dxserve.hvp(np_scalar, backend, XB, (t, -t)), (hess @ t, -hess @ t), FD2_RTOL,
          scaled=True)
    g, (hv,) = dxserve.gradient_and_hvp(np_scalar, backend, XB, (t,))
    close(g, grad, FD2_RTOL, scaled=True)


def test_black_box_forward_differences():
    grad, _ = np_scalar_refs(XB)
    close(dxserve.gradient(np_scalar, FiniteDifferences("forward"), XB), grad, 1e-6,
          scaled=True)


def test_black_box_resolves_to_finite_differences():
    fd = FiniteDifferences()
    assert dxserve.resolve("auto", "gradient", np_scalar, XB) == fd
    assert dxserve.resolve("auto", "jacobian", np_vector, XB) == fd
    assert dxserve.resolve("auto", "hvp", np_scalar, XB) == SecondOrder(fd, fd)


@pytest.mark.parametrize("backend", ["jax-reverse", "jax-forward", FWD_REV,
                                     SecondOrder(FiniteDifferences(), JaxReverse())])
def test_black_box_with_jax_backend_is_unsupported(backend):
    op = dxserve.hvp if isinstance(backend, SecondOrder) else dxserve.gradient
    args = (XB, (XB,)) if op is dxserve.hvp else (XB,)
    with pytest.raises(UnsupportedOperatorError) as info:
        op(np_scalar, backend, *args)
    assert info.value.field == "backend"


# --- (d) pytree inputs keep their structure --------------------------------------------
def test_pytree_results_have_x_structure():
    s = sc.BY_NAME["pytree_tanh_regression"]
    t = sc.tangent(s)
    for backend in ("jax-reverse", "jax-forward", "finite-differences"):
        rtol, scaled = (RTOL, False) if backend.startswith("jax") else (FD2_RTOL, True)
        g = dxserve.gradient(s.f, backend, s.x, *s.contexts)
        assert isinstance(g, dict) and sorted(g) == ["b", "w"]
        assert g["w"].shape == (3, 2) and g["b"].shape == (2,)
        close(g, s.gradient, rtol, scaled)
        pb = dxserve.pullback(s.f, backend, s.x, (np.asarray(2.0),), *s.contexts)
        assert isinstance(pb, tuple) and len(pb) == 1 and sorted(pb[0]) == ["b", "w"]
        close(pb, (sc.vjp_ref(s, 2.0),), rtol, scaled)
        hv = dxserve.hvp(s.f, backend, s.x, (t,), *s.contexts)
        assert isinstance(hv, tuple) and sorted(hv[0]) == ["b", "w"]
        assert hv[0]["w"].shape == (3, 2) and hv[0]["b"].shape == (2,)
        close(hv, (s.hvp_ref(t),), rtol, scaled)


def nested(p):
    return p["s"] * jnp.sum(p["layer"]["w"] ** 2) + jnp.sum(p["layer"]["b"])


def test_nested_pytree_gradient():
    p = {"layer": {"w": np.array([[1.0, -2.0], [0.5, 3.0]]), "b": np.array([0.1, 0.2, 0.3])},
         "s": np.asarray(1.5)}
    g = dxserve.gradient(nested, "jax-reverse", p)
    close(g, {"layer": {"w": 2 * 1.5 * p["layer"]["w"], "b": np.ones(3)},
              "s": np.sum(p["layer"]["w"] ** 2)})


# --- (e) Auto's choice ------------------------------------------------------------------
def grow(x):  # R^3 -> R^5
    return jnp.concatenate([jnp.sin(x), x[:2] ** 2])


def shrink(x):  # R^5 -> R^2
    return jnp.stack([jnp.sum(x**2), jnp.prod(x)])


def square(x):  # R^3 -> R^3
    return jnp.tanh(x)


def test_auto_jacobian_mode_follows_sizes():
    assert dxserve.resolve("auto", "jacobian", grow, np.ones(3)) == JaxForward()
    assert dxserve.resolve("auto", "jacobian", square, np.ones(3)) == JaxForward()  # n == m
    assert dxserve.resolve("auto", "jacobian", shrink, np.ones(5)) == JaxReverse()
    assert dxserve.resolve("auto", "value_and_jacobian", shrink, np.ones(5)) == JaxReverse()
    assert dxserve.prepare_jacobian(shrink, "auto", np.ones(5)).resolved == JaxReverse()
    assert dxserve.prepare_jacobian(grow, "auto", np.ones(3)).resolved == JaxForward()


def test_auto_first_order_choices():
    assert dxserve.resolve("auto", "gradient", sin_sq, X3) == JaxReverse()
    assert dxserve.resolve("auto", "pullback", grow, X3) == JaxReverse()
    assert dxserve.resolve("auto", "pushforward", grow, X3) == JaxForward()
    assert dxserve.resolve("auto", "derivative", jnp.sin, 0.5) == JaxForward()
    # explicit first-order backends are used as given
    assert dxserve.resolve(JaxReverse(batch_size=2), "jacobian", grow, X3) == JaxReverse(
        batch_size=2)


# --- (f) contexts are not differentiated -----------------------------------------------
def test_contexts_are_constants():
    A = np.array([[2.0, 1.0, 0.0], [0.0, 3.0, -1.0], [1.0, 0.0, 1.0]])
    sym = 0.5 * (A + A.T)
    for backend in ("jax-reverse", "jax-forward", "auto"):
        g = dxserve.gradient(quad_ctx, backend, X3, A)
        assert g.shape == X3.shape
        close(g, sym @ X3)
        close(dxserve.gradient(quad_ctx, backend, X3, 3 * A), 3 * sym @ X3)
        close(dxserve.hessian(quad_ctx, backend, X3, A), sym)
    close(dxserve.gradient(quad_ctx, "finite-differences", X3, A), sym @ X3, FD_RTOL, True)


def power_ctx(x, k, scale):
    return scale * jnp.sum(x**k)


def test_integer_and_python_contexts():
    k = np.array([1, 2, 3])  # an integer context is fine: it is not differentiated
    g = dxserve.gradient(power_ctx, "jax-reverse", X3, k, 2.0)
    close(g, 2.0 * k * X3 ** (k - 1))
    close(dxserve.gradient(power_ctx, "jax-reverse", X3, k, 0.5), 0.5 * k * X3 ** (k - 1))


def test_context_scenarios_follow_their_references():
    for name in ("vs_quadratic_ctx", "vv_tanh_matvec_ctx"):
        s = sc.BY_NAME[name]
        op = "gradient" if s.y_is_scalar else "jacobian"
        close(getattr(dxserve, op)(s.f, "jax-reverse", s.x, *s.contexts), s.jacobian)


# --- (g) backend descriptors as JSON ----------------------------------------------------
DESCRIPTORS = [
    JaxForward(),
    JaxForward(batch_size=4),
    JaxReverse(),
    JaxReverse(batch_size=1),
    FiniteDifferences(),
    FiniteDifferences("forward"),
    FiniteDifferences(step=1e-3),
    FiniteDifferences("forward", step=1.5e-7, batch_size=8),
    Auto(),
    FWD_REV,
    SecondOrder(JaxReverse(batch_size=2), JaxForward(batch_size=3)),
    SecondOrder(FiniteDifferences("forward", step=1e-4), JaxReverse()),
    SecondOrder(FiniteDifferences(), FiniteDifferences(batch_size=2)),
]


@pytest.mark.parametrize("backend", DESCRIPTORS, ids=lambda b: json.dumps(b.to_json()))
def test_descriptor_json_round_trip(backend):
    wire = json.dumps(backend.to_json())
    back = dxserve.backend_from_json(json.loads(wire))
    assert back == backend
    assert type(back) is type(backend)
    assert json.dumps(back.to_json()) == wire


def test_descriptor_json_forms():
    assert JaxForward(batch_size=4).to_json() == {"type": "jax-forward", "batch_size": 4}
    assert JaxReverse().to_json() == {"type": "jax-reverse"}
    assert FiniteDifferences().to_json() == {"type": "finite-differences"}
    assert FiniteDifferences("forward", step=1e-4).to_json() == {
        "type": "finite-differences", "method": "forward", "step": 1e-4}
    assert FWD_REV.to_json() == {"type": "second-order", "outer": {"type": "jax-forward"},
                                 "inner": {"type": "jax-reverse"}}
    assert Auto().to_json() == {"type": "auto"}
    assert dxserve.backend_from_json(
        {"type": "finite-differences", "method": "central"}) == FiniteDifferences()


@pytest.mark.parametrize(("shorthand", "backend"), [
    ("jax-forward", JaxForward()),
    ("jax-reverse", JaxReverse()),
    ("finite-differences", FiniteDifferences()),
    ("auto", Auto()),
    ({"type": "second-order", "outer": "jax-forward", "inner": "jax-reverse"}, FWD_REV),
])
def test_shorthands(shorthand, backend):
    assert dxserve.backend_from_json(shorthand) == backend


INVALID = [
    (42, "backend"),
    (None, "backend"),
    ({}, "backend.type"),
    ("tensorflow", "backend.type"),
    ({"type": "jax-forward", "batch_size": 0}, "backend.batch_size"),
    ({"type": "jax-forward", "batch_size": True}, "backend.batch_size"),
    ({"type": "jax-reverse", "batch_size": 2.5}, "backend.batch_size"),
    ({"type": "jax-reverse", "step": 0.1}, "backend.step"),
    ({"type": "auto", "batch_size": 2}, "backend.batch_size"),
    ({"type": "finite-differences", "method": "backward"}, "backend.method"),
    ({"type": "finite-differences", "step": 2}, "backend.step"),
    ({"type": "finite-differences", "step": 0}, "backend.step"),
    ({"type": "finite-differences", "step": "0.1"}, "backend.step"),
    ("second-order", "backend.outer"),
    ({"type": "second-order", "outer": "jax-forward"}, "backend.inner"),
    ({"type": "second-order", "outer": "jax-forward",
      "inner": {"type": "finite-differences", "step": 2}}, "backend.inner.step"),
    ({"type": "second-order", "outer": "jax-forward",
      "inner": {"type": "jax-reverse", "batch_size": -1}}, "backend.inner.batch_size"),
    ({"type": "second-order", "outer": {"type": "nope"}, "inner": "jax-reverse"},
     "backend.outer.type"),
    ({"type": "second-order", "outer": "auto", "inner": "jax-reverse"}, "backend.outer"),
    ({"type": "second-order", "outer": {"type": "second-order", "outer": "jax-forward",
                                        "inner": "jax-reverse"}, "inner": "jax-reverse"},
     "backend.outer"),
    ({"type": "second-order", "outer": "jax-forward", "inner": "jax-reverse", "x": 1},
     "backend.x"),
]


@pytest.mark.parametrize(("value", "field"), INVALID, ids=lambda v: json.dumps(v))
def test_invalid_descriptors_name_the_field(value, field):
    with pytest.raises(InvalidBackendError) as info:
        dxserve.backend_from_json(value)
    assert info.value.field == field
    from dxserve.http.problems import status_of  # library errors carry no HTTP status

    assert type(info.value) is InvalidBackendError and status_of(info.value) == 422


def test_operators_reject_invalid_backends():
    with pytest.raises(InvalidBackendError) as info:
        dxserve.gradient(sin_sq, {"type": "jax-reverse", "batch_size": 0}, X3)
    assert info.value.field == "backend.batch_size"
    with pytest.raises(InvalidBackendError):
        JaxForward(batch_size=0)
    with pytest.raises(InvalidBackendError):
        SecondOrder(Auto(), JaxReverse())


def test_result_size_limit_refuses_huge_dense_results(monkeypatch):
    from dxcontract.errors import ResultTooLargeError
    from dxserve.core.preparation import pipeline  # the module whose ``prepare`` reads it

    monkeypatch.setattr(pipeline, "MAX_RESULT_ELEMENTS", 10_000)
    x = np.ones(200)
    with pytest.raises(ResultTooLargeError) as info:
        dxserve.hessian(lambda v: jnp.sum(v**3), "auto", x)  # 200² + ... > 10,000
    from dxserve.http.problems import status_of  # library errors carry no HTTP status

    assert type(info.value) is ResultTooLargeError and status_of(info.value) == 422
    assert info.value.field == "x"
    assert dxserve.hvp(lambda v: jnp.sum(v**3), "auto", x, (x,))[0].shape == (200,)


def test_device_out_of_memory_is_a_503_and_other_failures_a_422():
    from dxcontract.errors import FunctionEvaluationError, OverloadedError
    from dxserve.http.problems import status_of  # library errors carry no HTTP status

    def flaky(x):  # a black box: the probe at x succeeds, the shifted evaluations fail
        if isinstance(x, np.ndarray) and x[0] != 1.0:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 80 GB")
        return float(np.sum(np.asarray(x) ** 2))

    with pytest.raises(OverloadedError) as info:
        dxserve.gradient(flaky, "finite-differences", np.ones(3))
    assert type(info.value) is OverloadedError and status_of(info.value) == 503
    assert info.value.extra["retry_after"] == 5

    def broken(x):
        if isinstance(x, np.ndarray) and x[0] != 1.0:
            raise ValueError("not defined here")
        return float(np.sum(np.asarray(x) ** 2))

    with pytest.raises(FunctionEvaluationError) as info:
        dxserve.gradient(broken, "finite-differences", np.ones(3))
    assert type(info.value) is FunctionEvaluationError and status_of(info.value) == 422
    assert info.value.field == "function"


def test_requests_looked_up_together_compile_once():
    """Concurrent first requests for one signature are looked up before any compiles;
    only the first compiles, the rest reuse its prep."""
    from dxserve.core.preparation import PrepCache, lookup

    f = counted(sin_sq)
    cache = PrepCache()
    x = np.linspace(0.1, 1.0, 4)
    first, second = (lookup("gradient", f, "jax-reverse", x, None, (), None, cache) for _ in "ab")
    assert first.prep is None and second.prep is None
    a = first.prepare(cache)
    traced = len(f.calls)
    b = second.prepare(cache)
    assert b is a and len(f.calls) == traced
