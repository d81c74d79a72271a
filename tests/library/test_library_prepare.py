"""The library's public surface: every operator has ``prepare_<op>``; no JAX-named aliases.

Each ``prepare_<op>`` compiles once; the operator called with that prep returns what
it returns without one (exactly: the same executable computes both), and a call with
another signature is refused. ``dxserve.jvp`` / ``dxserve.vjp`` do not exist: they
would return DI's batches, not ``jax.jvp``'s ``(y, t)`` or ``jax.vjp``'s
``(y, pullback)``, so ``y, t = jvp(...)`` would unpack silently and wrongly.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dxserve
from dxclient import AsyncClient, Client
from dxcontract.operators import OPERATORS


def rosenbrock(x):
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def sin_cumsum(x):
    return jnp.sin(x) * jnp.cumsum(x)


def scalar_in(x):
    return jnp.stack([jnp.sin(x) * x, jnp.exp(0.5 * x)])


X = np.array([0.3, -0.7, 1.1])
T = (np.array([1.0, 0.0, -1.0]), np.array([0.5, 2.0, 0.25]))


def _inputs(op: str) -> tuple[Any, tuple, tuple]:
    """(f, x, extra positional args) for ``op``."""
    family = OPERATORS[op].family
    if family in ("derivative", "second_derivative"):
        return scalar_in, np.float64(0.4), ()
    if family in ("jacobian", "pushforward"):
        return sin_cumsum, X, (T,) if family == "pushforward" else ()
    if family == "pullback":
        return sin_cumsum, X, (T,)  # cotangents shaped like f(x): (3,)
    return rosenbrock, X, (T,) if OPERATORS[op].takes_tangents else ()


def _equal(a: Any, b: Any) -> None:
    if hasattr(a, "toarray"):  # sparse results
        a, b = a.toarray(), b.toarray()
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.parametrize("op", sorted(OPERATORS))
def test_every_operator_has_its_prepare(op: str) -> None:
    f, x, extra = _inputs(op)
    prepare = getattr(dxserve, f"prepare_{op}")
    run = getattr(dxserve, op)
    assert f"prepare_{op}" in dxserve.__all__ and op in dxserve.__all__
    prep = prepare(f, "auto", x, *extra)
    assert prep.operator == op
    _equal(run(f, "auto", x, *extra, prep=prep), run(f, "auto", x, *extra))
    if np.ndim(x):  # another signature: refused, naming what differs
        with pytest.raises(dxserve.PreparationMismatchError):
            run(f, "auto", np.ones(4), *((tuple(np.ones(4) for _ in T),) if extra else ()), prep=prep)


def test_value_and_prepares_against_jax() -> None:
    """The ``value_and_*`` preps compute the right numbers (float64, against JAX)."""
    with dxserve.float64_scope():
        g = jax.grad(rosenbrock)(X)
        H = jax.hessian(rosenbrock)(X)
    # sin(x_i) * S_i with S_i = sum_{j<=i} x_j: J_ij = cos(x_i) S_i [i=j] + sin(x_i) [j<=i]
    J = np.diag(np.cos(X) * np.cumsum(X)) + np.sin(X)[:, None] * np.tril(np.ones((3, 3)))
    prep = dxserve.prepare_value_and_gradient(rosenbrock, "auto", X)
    v, grad = dxserve.value_and_gradient(rosenbrock, "auto", X, prep=prep)
    np.testing.assert_allclose(grad, g, rtol=1e-12)
    prep = dxserve.prepare_value_gradient_and_hessian(rosenbrock, "auto", X)
    _, grad, hess = dxserve.value_gradient_and_hessian(rosenbrock, "auto", X, prep=prep)
    np.testing.assert_allclose(hess, H, rtol=1e-12)
    prep = dxserve.prepare_gradient_and_hvp(rosenbrock, "auto", X, T)
    grad, hvps = dxserve.gradient_and_hvp(rosenbrock, "auto", X, T, prep=prep)
    np.testing.assert_allclose(hvps[1], H @ T[1], rtol=1e-12)
    prep = dxserve.prepare_value_and_jacobian(sin_cumsum, "auto", X)
    _, jac = dxserve.value_and_jacobian(sin_cumsum, "auto", X, prep=prep)
    np.testing.assert_allclose(jac, J, rtol=1e-12)
    prep = dxserve.prepare_value_and_pushforward(sin_cumsum, "auto", X, T)
    _, pf = dxserve.value_and_pushforward(sin_cumsum, "auto", X, T, prep=prep)
    np.testing.assert_allclose(pf[0], J @ T[0], rtol=1e-12)
    prep = dxserve.prepare_value_and_pullback(sin_cumsum, "auto", X, T)
    _, pb = dxserve.value_and_pullback(sin_cumsum, "auto", X, T, prep=prep)
    np.testing.assert_allclose(pb[1], J.T @ T[1], rtol=1e-12)


def test_jax_names_are_not_aliases() -> None:
    for name in ("jvp", "vjp"):
        assert not hasattr(dxserve, name) and name not in dxserve.__all__
        assert not hasattr(Client, name) and not hasattr(AsyncClient, name)
    assert "jvp" not in OPERATORS and "vjp" not in OPERATORS


@pytest.mark.parametrize("op", sorted(o for o in OPERATORS if o != "sparsity"))
def test_a_prep_called_again_answers_the_same_straight_from_its_executable(op: str) -> None:
    """The second call with a prep takes its executable straight (``Ready``): the same
    numbers as the first call and as a call without a prep, for one tangent and two;
    inputs that need normalizing or differ take the full path (normalized, or refused)."""
    f, x, extra = _inputs(op)
    for tangents in ((T[:1],), (T,)) if extra else ((),):
        prep = getattr(dxserve, f"prepare_{op}")(f, "auto", x, *tangents)
        run = getattr(dxserve, op)
        first = run(f, "auto", x, *tangents, prep=prep)
        assert op in prep.ready  # made by the first call
        _equal(run(f, "auto", x, *tangents, prep=prep), first)
        _equal(run(f, "auto", x, *tangents), first)
        listed = x.tolist() if np.ndim(x) else float(x)  # normalized by the full path
        _equal(run(f, "auto", listed, *tangents, prep=prep), first)
        if np.ndim(x):
            with pytest.raises(dxserve.PreparationMismatchError):
                run(f, "auto", np.ones(4), *tangents, prep=prep)
            with pytest.raises(dxserve.PreparationMismatchError):
                run(f, "auto", x.astype(np.float32), *tangents, prep=prep)
        with dxserve.float64_scope():  # a JAX array of x's dtype goes straight too
            xj = jnp.asarray(x)
        _equal(run(f, "auto", xj, *tangents, prep=prep), first)


def test_a_ready_prep_inside_a_transformation_traces() -> None:
    prep = dxserve.prepare_gradient(rosenbrock, "auto", X)
    dxserve.gradient(rosenbrock, "auto", X, prep=prep)  # makes its Ready
    with dxserve.float64_scope():
        hvp = jax.jvp(lambda u: dxserve.gradient(rosenbrock, "auto", u, prep=prep), (X,), (T[0],))[1]
        want = jax.jvp(jax.grad(rosenbrock), (X,), (T[0],))[1]
    np.testing.assert_allclose(hvp, want, rtol=1e-12)


def test_a_ready_prep_of_a_pytree_checks_its_structure() -> None:
    def loss(p):
        return jnp.sum(p["a"] ** 2) + jnp.sum(jnp.sin(p["b"]))

    p = {"a": np.arange(3.0), "b": np.ones(2)}
    prep = dxserve.prepare_gradient(loss, "auto", p)
    first = dxserve.gradient(loss, "auto", p, prep=prep)
    _equal(dxserve.gradient(loss, "auto", p, prep=prep), first)
    with pytest.raises(dxserve.PreparationMismatchError):
        dxserve.gradient(loss, "auto", {"a": np.arange(3.0), "c": np.ones(2)}, prep=prep)
