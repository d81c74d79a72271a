"""dxserve operators inside jax.grad, jax.hessian, jax.jvp, jax.jit and jax.vmap.

Each operator called on traced values stands for the JAX expression it computes: the
outer transformation differentiates, batches and compiles it. References are JAX's own
transformations of the same function, in float64 at rtol 1e-10. With a backend that
cannot trace (finite differences of a numpy black box, a numpy engine) the operator
runs outside the transformation and its derivatives are the next operators of that
backend, checked at finite-difference tolerances (see ``FD_FIRST``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dxserve
from dxserve import Engine, JaxForward, JaxReverse, SecondOrder

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


# --- a backend that cannot trace: finite differences of a numpy black box ---------------
#
# The operator runs outside the transformation on concrete arrays; its derivatives are
# the next operators with the same backend. References: JAX's transformations of the
# same function written in jax.numpy. Tolerances, normwise (max error over max entry):
# central differences with the default step eps^(1/3) (~6e-6) err by ~1e-10 at first
# order, so rtol 1e-7 leaves a thousandfold margin; second order takes differences of
# differences with steps eps^(1/4) (~1e-4), ~2e-8, so rtol 1e-5.

FD = "finite-differences"
FD_FIRST, FD_SECOND = 1e-7, 1e-5


def np_scalar(x):
    x = np.asarray(x)
    return float(np.sum(np.sin(x) * x**2) + np.prod(x[:2]) + np.sum(np.cumsum(x) ** 3) / 10)


def np_vector(x):
    x = np.asarray(x)
    return np.concatenate([np.sin(x) * np.cumsum(x), x[:2] ** 3])


def _near(got, want, rtol: float) -> None:
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=rtol, atol=rtol * np.max(np.abs(want)))


# (the operator on the black box, the same thing written with JAX alone)
BLACK_BOX: dict[str, tuple[Callable, Callable]] = {
    "gradient": (lambda x: dxserve.gradient(np_scalar, FD, x), jax.grad(scalar)),
    "jacobian": (lambda x: dxserve.jacobian(np_vector, FD, x), jax.jacobian(vector)),
    "pushforward": (
        lambda x: dxserve.pushforward(np_vector, FD, x, (T,))[0],
        lambda x: jax.jvp(vector, (x,), (T,))[1],
    ),
    "pullback": (
        lambda x: dxserve.pullback(np_vector, FD, x, (W,))[0],
        lambda x: jax.vjp(vector, x)[1](W)[0],
    ),
    "value": (lambda x: dxserve.value(np_vector, FD, x), vector),
}
BLACK_BOX_SECOND: dict[str, tuple[Callable, Callable]] = {
    "hvp": (
        lambda x: dxserve.hvp(np_scalar, FD, x, (T,))[0],
        lambda x: jax.jvp(jax.grad(scalar), (x,), (T,))[1],
    ),
    "hessian": (lambda x: dxserve.hessian(np_scalar, FD, x), jax.hessian(scalar)),
}


@pytest.mark.parametrize("op", list(BLACK_BOX))
def test_a_black_box_under_jit_vmap_and_derivatives(op: str) -> None:
    ours, ref = BLACK_BOX[op]
    _near(jax.jit(ours)(X), ref(X), FD_FIRST)
    _near(jax.vmap(ours)(POINTS), jax.vmap(ref)(POINTS), FD_FIRST)
    # the derivative of a first-order operator is second order of the function
    _near(jax.jacfwd(ours)(X), jax.jacfwd(ref)(X), FD_SECOND)
    _near(jax.jit(jax.jacrev(ours))(X), jax.jacrev(ref)(X), FD_SECOND)
    _near(jax.vmap(jax.jacrev(ours))(POINTS), jax.vmap(jax.jacrev(ref))(POINTS), FD_SECOND)
    _near(jax.jvp(ours, (X,), (T,))[1], jax.jvp(ref, (X,), (T,))[1], FD_SECOND)


@pytest.mark.parametrize("op", list(BLACK_BOX_SECOND))
def test_second_order_operators_of_a_black_box(op: str) -> None:
    ours, ref = BLACK_BOX_SECOND[op]
    _near(jax.jit(ours)(X), ref(X), FD_SECOND)
    _near(jax.vmap(ours)(POINTS), jax.vmap(ref)(POINTS), FD_SECOND)
    # third order of the function: refused, naming the operator and the backend
    with pytest.raises(TypeError, match=rf"{op} with backend .*finite-differences.*third"):
        jax.jacfwd(ours)(X)


def test_grad_and_hessian_of_losses_of_a_black_box() -> None:
    def ours(y):  # a loss of a gradient: second order of the function
        return jnp.sum(dxserve.gradient(np_scalar, FD, y) ** 2)

    def ref(y):
        return jnp.sum(jax.grad(scalar)(y) ** 2)

    _near(jax.grad(ours)(X), jax.grad(ref)(X), FD_SECOND)
    _near(jax.jit(jax.grad(ours))(X), jax.grad(ref)(X), FD_SECOND)

    def loss(value):  # a loss of the value: jax.hessian through pullbacks and HVPs of <c, f>
        return lambda y: jnp.sum(jnp.sin(value(y)) ** 2)

    black = loss(lambda y: dxserve.value(np_vector, "auto", y))
    _near(jax.grad(black)(X), jax.grad(loss(vector))(X), FD_FIRST)
    _near(jax.hessian(black)(X), jax.hessian(loss(vector))(X), FD_SECOND)
    _near(jax.jit(jax.hessian(black))(X), jax.hessian(loss(vector))(X), FD_SECOND)
    want = jax.vmap(jax.hessian(loss(vector)))(POINTS)
    _near(jax.vmap(jax.hessian(black))(POINTS), want, FD_SECOND)
    # tangents are differentiated too: an HVP is linear in its tangent
    hvp_t = jax.jacfwd(lambda t: dxserve.hvp(np_scalar, FD, X, (t,))[0])(T)
    _near(hvp_t, jax.hessian(scalar)(X), FD_SECOND)
    # jax.hessian over losses of a pushforward and a pullback in their tangents: 2 JᵀJ, 2 JJᵀ
    J = jax.jacobian(vector)(X)
    push = jax.hessian(lambda t: jnp.sum(dxserve.pushforward(np_vector, FD, X, (t,))[0] ** 2))
    _near(push(T), 2 * J.T @ J, FD_FIRST)
    pull = jax.jit(jax.hessian(lambda c: jnp.sum(dxserve.pullback(np_vector, FD, X, (c,))[0] ** 2)))
    _near(pull(W), 2 * J @ J.T, FD_FIRST)


def test_combined_operators_scalar_inputs_and_batches_of_a_black_box() -> None:
    y, g = jax.jit(lambda x: dxserve.value_and_gradient(np_scalar, FD, x))(X)
    _near(y, scalar(X), 1e-15)
    _near(g, jax.grad(scalar)(X), FD_FIRST)
    v, g, H = jax.jit(lambda x: dxserve.value_gradient_and_hessian(np_scalar, FD, x))(X)
    _near(H, jax.hessian(scalar)(X), FD_SECOND)
    got = jax.jit(lambda xs: dxserve.gradient(np_scalar, FD, xs, batch_axis=0))(POINTS)
    _near(got, jax.vmap(jax.grad(scalar))(POINTS), FD_FIRST)

    def np_curve(s):
        s = float(np.asarray(s))
        return np.array([np.sin(s) * s, np.exp(0.3 * s)])

    def curve(s):
        return jnp.stack([jnp.sin(s) * s, jnp.exp(0.3 * s)])

    s0 = np.asarray(0.7)
    d = jax.jit(lambda s: dxserve.derivative(np_curve, FD, s))(s0)
    _near(d, jax.jacfwd(curve)(s0), FD_FIRST)
    d_of_d = jax.jacfwd(lambda s: dxserve.derivative(np_curve, FD, s))(s0)
    _near(d_of_d, jax.jacfwd(jax.jacfwd(curve))(s0), FD_SECOND)
    d2 = jax.jit(lambda s: dxserve.second_derivative(np_curve, FD, s))(s0)
    _near(d2, jax.jacfwd(jax.jacfwd(curve))(s0), FD_SECOND)


@dataclass(frozen=True)
class NumpyCentral:
    """Central differences in numpy, relative step 1e-4: an engine that needs concrete
    arrays (the step suits its own second order, differences of differences)."""

    type: ClassVar[str] = "test-numpy-central"

    def to_json(self) -> dict:
        return {"type": self.type}


@dataclass(frozen=True)
class NumpyCentralEngine(Engine):
    traced: bool = True
    traces = False

    def pushforward(self, g, x, tx):
        x = np.asarray(x)
        h = 1e-4 * max(1.0, float(np.max(np.abs(x))))
        diffs = [(np.asarray(g(x + h * t)) - np.asarray(g(x - h * t))) / (2 * h) for t in np.asarray(tx)]
        return np.asarray(g(x)), np.stack(diffs)


def test_a_numpy_plugin_engine_on_a_jax_function_under_jit() -> None:
    """An engine that needs concrete arrays, on a function JAX traces: the value is the
    function itself, the derivatives the engine's, through callbacks."""
    dxserve.register_backend(
        NumpyCentral, lambda b, *, traced, nested: NumpyCentralEngine(traced)
    )
    ours = jax.jit(jax.grad(lambda x: jnp.sum(dxserve.gradient(scalar, NumpyCentral(), x) ** 2)))
    _near(ours(X), jax.grad(lambda x: jnp.sum(jax.grad(scalar)(x) ** 2))(X), FD_SECOND)
    y = jax.jit(lambda x: dxserve.value(scalar, NumpyCentral(), x))(X)
    _near(y, scalar(X), 1e-15)


def test_what_a_black_box_cannot_give_is_named() -> None:
    def f(x, scale):
        return float(scale) * float(np.sum(np.asarray(x) ** 3))

    # a context is differentiated too (the gradient's mixed derivative, one HVP)
    got = jax.grad(lambda s: jnp.sum(dxserve.gradient(f, FD, X, s)))(2.0)
    _near(got, np.sum(3 * X**2), FD_SECOND)
    # a JAX mode cannot run a black box: the way out is named
    with pytest.raises(dxserve.UnsupportedOperatorError, match="finite-differences"):
        jax.jit(lambda x: dxserve.gradient(np_scalar, "jax-reverse", x))(X)
    # a sparse result cannot come back through a callback
    with pytest.raises(dxserve.UnsupportedOperatorError, match="sparse"):
        sparse = dxserve.Sparse(dense=dxserve.FiniteDifferences())
        jax.jit(lambda x: dxserve.jacobian(np_vector, sparse, x))(X)
    # third order of the function through a loss of the value
    with pytest.raises(TypeError, match="third"):
        jax.jacfwd(jax.hessian(lambda y: jnp.sum(dxserve.value(np_vector, FD, y) ** 2)))(X)


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
