"""dxserve operators inside jax.grad, jax.hessian, jax.jvp, jax.jit and jax.vmap.

Each operator called on traced values stands for the JAX expression it computes: the
outer transformation differentiates, batches and compiles it. References are JAX's own
transformations of the same function, in float64 at rtol 1e-10.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dxserve
from dxserve import JaxForward, JaxReverse, SecondOrder

RTOL = 1e-10


@pytest.fixture(autouse=True)
def x64() -> Iterator[None]:
    with jax.enable_x64(True):
        yield


def scalar(x):
    return jnp.sum(jnp.sin(x) * x**2) + jnp.prod(x[:2]) + jnp.sum(jnp.cumsum(x) ** 3) / 10


def vector(x):
    return jnp.concatenate([jnp.sin(x) * jnp.cumsum(x), x[:2] ** 3])


X = np.linspace(0.3, 1.2, 4)
T = np.array([0.5, -1.0, 2.0, 0.25])
W = np.array([1.0, -0.5, 0.3, 2.0, -1.5, 0.7])  # a cotangent of vector's output
POINTS = np.stack([X, 1.5 * X, -X])

FIRST = {"jax-forward": JaxForward(), "jax-reverse": JaxReverse()}
SECOND = {
    "fwd-over-rev": SecondOrder(JaxForward(), JaxReverse()),
    "rev-over-fwd": SecondOrder(JaxReverse(), JaxForward()),
    "rev-over-rev": SecondOrder(JaxReverse(), JaxReverse()),
    "fwd-over-fwd": SecondOrder(JaxForward(), JaxForward()),
}

# (operator under test as a function of x, the same thing written with JAX alone)
FIRST_ORDER: dict[str, Callable] = {
    "gradient": lambda b: (lambda x: dxserve.gradient(scalar, b, x), jax.grad(scalar)),
    "jacobian": lambda b: (lambda x: dxserve.jacobian(vector, b, x), jax.jacrev(vector)),
    "pushforward": lambda b: (
        lambda x: dxserve.pushforward(vector, b, x, (T,))[0],
        lambda x: jax.jvp(vector, (x,), (T,))[1],
    ),
    "pullback": lambda b: (
        lambda x: dxserve.pullback(vector, b, x, (W,))[0],
        lambda x: jax.vjp(vector, x)[1](W)[0],
    ),
}
SECOND_ORDER: dict[str, Callable] = {
    "hvp": lambda b: (
        lambda x: dxserve.hvp(scalar, b, x, (T,))[0],
        lambda x: jax.jvp(jax.grad(scalar), (x,), (T,))[1],
    ),
    "hessian": lambda b: (lambda x: dxserve.hessian(scalar, b, x), jax.hessian(scalar)),
}
CASES = [(op, name, b) for op in FIRST_ORDER for name, b in FIRST.items()] + [
    (op, name, b) for op in SECOND_ORDER for name, b in SECOND.items()
]


def _pair(op: str, backend) -> tuple[Callable, Callable]:
    return {**FIRST_ORDER, **SECOND_ORDER}[op](backend)


def _close(got, want) -> None:
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=1e-12)


@pytest.mark.parametrize(("op", "name", "backend"), CASES, ids=[f"{o}-{n}" for o, n, _ in CASES])
def test_under_jit_vmap_and_derivatives(op: str, name: str, backend) -> None:
    ours, ref = _pair(op, backend)
    _close(jax.jit(ours)(X), ref(X))
    _close(jax.vmap(ours)(POINTS), jax.vmap(ref)(POINTS))
    _close(jax.jacfwd(ours)(X), jax.jacfwd(ref)(X))  # the derivative of the operator
    _close(jax.jacrev(ours)(X), jax.jacrev(ref)(X))
    _close(jax.jvp(ours, (X,), (T,))[1], jax.jvp(ref, (X,), (T,))[1])


@pytest.mark.parametrize("name", list(FIRST))
def test_grad_and_hessian_of_a_loss_of_the_gradient(name: str) -> None:
    """The issue's expression: ``jax.grad`` of a loss of ``dxserve.gradient``."""
    backend = FIRST[name]

    def ours(y):
        return jnp.sum(dxserve.gradient(scalar, backend, y) ** 2)

    def ref(y):
        return jnp.sum(jax.grad(scalar)(y) ** 2)

    _close(jax.grad(ours)(X), jax.grad(ref)(X))
    _close(jax.hessian(ours)(X), jax.hessian(ref)(X))
    _close(jax.jit(jax.grad(ours))(X), jax.grad(ref)(X))


def test_backend_by_name_and_value_and_forms() -> None:
    y, g = jax.jit(lambda x: dxserve.value_and_gradient(scalar, "jax-reverse", x))(X)
    _close(y, scalar(X))
    _close(g, jax.grad(scalar)(X))
    y, J = jax.jit(lambda x: dxserve.value_and_jacobian(vector, "auto", x))(X)
    _close(J, jax.jacrev(vector)(X))


def test_jit_compiles_once() -> None:
    traces = []

    def outer(x):
        traces.append(1)
        return dxserve.gradient(scalar, JaxReverse(), x)

    jitted = jax.jit(outer)
    for k in range(3):
        _close(jitted(X + k), jax.grad(scalar)(X + k))
    assert len(traces) == 1


def test_contexts_and_batch_axis_under_tracing() -> None:
    def f(x, scale):
        return scale * jnp.sum(x**3)

    got = jax.grad(lambda s: jnp.sum(dxserve.gradient(f, "jax-reverse", X, s)))(2.0)
    _close(got, np.sum(3 * X**2))
    got = jax.jit(lambda xs: dxserve.gradient(scalar, "jax-forward", xs, batch_axis=0))(POINTS)
    _close(got, jax.vmap(jax.grad(scalar))(POINTS))


def test_a_prep_is_used_outside_tracing_and_traced_inside() -> None:
    prep = dxserve.prepare_gradient(scalar, "jax-reverse", X)
    _close(dxserve.gradient(scalar, "jax-reverse", X, prep=prep), jax.grad(scalar)(X))
    _close(
        jax.jit(lambda x: dxserve.gradient(scalar, "jax-reverse", x, prep=prep))(X),
        jax.grad(scalar)(X),
    )


def test_a_backend_that_cannot_trace_is_named() -> None:
    def black_box(x):
        return float(np.sum(np.asarray(x) ** 2))

    with pytest.raises(dxserve.UnsupportedOperatorError, match="gradient with backend") as info:
        jax.jit(lambda x: dxserve.gradient(black_box, "finite-differences", x))(X)
    assert "DifferentiateWith" in str(info.value)


def test_has_aux_under_transformations() -> None:
    def with_state(x):
        return scalar(x), {"norm": jnp.sum(x**2)}

    (y, aux), g = jax.jit(
        lambda x: dxserve.value_and_gradient(with_state, "jax-reverse", x, has_aux=True)
    )(X)
    (y_ref, aux_ref), g_ref = jax.value_and_grad(with_state, has_aux=True)(X)
    _close(y, y_ref)
    _close(aux["norm"], aux_ref["norm"])
    _close(g, g_ref)
    got = jax.grad(lambda x: jnp.sum(dxserve.gradient(with_state, "jax-forward", x, has_aux=True)[0] ** 2))(X)
    _close(got, jax.grad(lambda x: jnp.sum(jax.grad(scalar)(x) ** 2))(X))
