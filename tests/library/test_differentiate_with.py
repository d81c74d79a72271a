"""dxserve.DifferentiateWith: a piece of a JAX program differentiated by another backend.

The main case: a JAX loss around a numpy step (``tests/differentiate_with_functions``)
under ``jax.grad``, ``jax.hessian``, ``jax.jit`` and ``jax.vmap``, against the same loss
written in JAX alone. Tolerances are normwise (max error over max entry): the step's
central differences (step eps^(1/3) ~ 6e-6) err by ~1e-10 at first order, so rtol 1e-7
leaves a thousandfold margin; second order takes differences of differences at
eps^(1/4) ~ 1e-4, ~2e-8, so rtol 1e-5. A backend that traces (``jax-forward``) is
exact: rtol 1e-12.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dxserve
from dxcontract.errors import DxError
from dxcontract.jax_rules import LINEAR_MAP
from dxserve import DifferentiateWith, FiniteDifferences, JaxForward, SecondOrder
from tests import differentiate_with_functions as m

FIRST, SECOND, EXACT = 1e-7, 1e-5, 1e-12
X = m.X
POINTS = np.stack([X, 0.5 * X, -X, X + 0.2])


@pytest.fixture(autouse=True)
def x64() -> Iterator[None]:
    with jax.enable_x64(True):
        yield


def near(got, want, rtol: float) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        w = np.asarray(w)
        np.testing.assert_allclose(np.asarray(g), w, rtol=rtol, atol=rtol * np.max(np.abs(w)))


OURS, REF = m.loss(m.STEP), m.loss(m.jnp_step)
# (transformation of the loss, tolerance)
TRANSFORMS: dict[str, tuple[Callable, float]] = {
    "value": (lambda f: f, EXACT),
    "grad": (jax.grad, FIRST),
    "jit-grad": (lambda f: jax.jit(jax.grad(f)), FIRST),
    "hessian": (jax.hessian, SECOND),
    "jit-hessian": (lambda f: jax.jit(jax.hessian(f)), SECOND),
    "jacfwd-jacfwd": (lambda f: jax.jacfwd(jax.jacfwd(f)), SECOND),
    "jacrev-jacrev": (lambda f: jax.jacrev(jax.jacrev(f)), SECOND),
    "jacrev-jacfwd": (lambda f: jax.jit(jax.jacrev(jax.jacfwd(f))), SECOND),
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_a_numpy_step_in_a_jax_loss_matches_the_all_jax_loss(name: str) -> None:
    transform, rtol = TRANSFORMS[name]
    near(transform(OURS)(X), transform(REF)(X), rtol)


def test_vmap_of_value_gradient_and_hessian() -> None:
    near(jax.vmap(OURS)(POINTS), jax.vmap(REF)(POINTS), EXACT)
    near(jax.jit(jax.vmap(jax.grad(OURS)))(POINTS), jax.vmap(jax.grad(REF))(POINTS), FIRST)
    near(jax.vmap(jax.hessian(OURS))(POINTS), jax.vmap(jax.hessian(REF))(POINTS), SECOND)
    # the numpy step never sees a batch: the backend cannot vectorize it, so it loops
    m.CALLS.clear()
    jax.vmap(jax.grad(OURS))(POINTS)
    assert m.CALLS and set(m.CALLS) == {X.shape}


def test_the_step_itself_under_every_transformation() -> None:
    t, w = np.array([0.5, -1.0, 2.0, 0.25]), np.array([1.0, -0.5, 0.3])
    near(jax.jvp(m.STEP, (X,), (t,))[1], jax.jvp(m.jnp_step, (X,), (t,))[1], FIRST)
    near(jax.vjp(m.STEP, X)[1](w), jax.vjp(m.jnp_step, X)[1](w), FIRST)
    near(jax.jacfwd(m.STEP)(X), jax.jacfwd(m.jnp_step)(X), FIRST)
    near(jax.jit(jax.jacrev(m.STEP))(X), jax.jacrev(m.jnp_step)(X), FIRST)
    near(jax.jacfwd(jax.jacfwd(m.STEP))(X), jax.jacfwd(jax.jacfwd(m.jnp_step))(X), SECOND)
    near(jax.jacrev(jax.jacrev(m.STEP))(X), jax.jacrev(jax.jacrev(m.jnp_step))(X), SECOND)
    near(jax.vmap(jax.jacrev(m.STEP))(POINTS), jax.vmap(jax.jacrev(m.jnp_step))(POINTS), FIRST)


def test_outside_transformations_it_is_the_function() -> None:
    got = m.STEP(X)
    assert type(got) is np.ndarray
    np.testing.assert_array_equal(got, m.np_step(X))
    assert "np_step" in repr(m.STEP) and "finite-differences" in repr(m.STEP)


def test_jit_traces_once() -> None:
    traces = []

    def counted(x):
        traces.append(1)
        return OURS(x)

    step = jax.jit(jax.grad(counted))
    for k in range(3):
        near(step(X + 0.1 * k), jax.grad(REF)(X + 0.1 * k), FIRST)
    assert len(traces) == 1


# --- a scalar piece, with a context and a pytree --------------------------------------


def np_energy(x, data):
    x, data = np.asarray(x), np.asarray(data)
    return float(np.sum(np.cos(x) * data[: x.size]) + np.sum(x**3) / 6)


def jnp_energy(x, data):
    return jnp.sum(jnp.cos(x) * data[: x.size]) + jnp.sum(x**3) / 6


def test_a_scalar_numpy_piece_with_a_context() -> None:
    energy = DifferentiateWith(np_energy, "finite-differences")
    data = np.array([1.0, -2.0, 0.5, 3.0])

    def loss(e):
        return lambda x: jnp.exp(-0.1 * e(x, data)) + jnp.sum(x * e(2 * x, data))

    near(jax.grad(loss(energy))(X), jax.grad(loss(jnp_energy))(X), FIRST)
    near(jax.hessian(loss(energy))(X), jax.hessian(loss(jnp_energy))(X), SECOND)
    near(jax.vmap(jax.grad(loss(energy)))(POINTS), jax.vmap(jax.grad(loss(jnp_energy)))(POINTS), FIRST)
    # a context is differentiated too (as JAX's argnums), never a silent zero
    near(jax.grad(energy, argnums=1)(X, data), jax.grad(jnp_energy, argnums=1)(X, data), FIRST)
    got, want = (
        jax.hessian(e, argnums=(0, 1))(X, data) for e in (energy, jnp_energy)
    )  # blocks of zeros among them: compared at the scale of the whole Hessian
    scale = max(float(np.max(np.abs(w))) for w in jax.tree.leaves(want))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=SECOND * scale)


def test_a_pytree_x() -> None:
    def np_f(p):
        return float(np.sum(np.asarray(p["a"]) ** 2) * np.asarray(p["b"]) + np.sin(np.asarray(p["b"])))

    def f(p):
        return jnp.sum(p["a"] ** 2) * p["b"] + jnp.sin(p["b"])

    p = {"a": X, "b": np.asarray(0.7)}
    wrapped = DifferentiateWith(np_f, FiniteDifferences())
    near(jax.grad(wrapped)(p), jax.grad(f)(p), FIRST)
    near(jax.hessian(wrapped)(p), jax.hessian(f)(p), SECOND)


# --- a backend that traces: forward mode forced on a piece ----------------------------


def sqrt_sin(x):
    """sum(sqrt(x) sin(x)), the square root by Newton's iteration in a while_loop:
    JAX's forward mode differentiates it, its reverse mode cannot."""

    def body(carry):
        z, k = carry
        return 0.5 * (z + x / z), k + 1

    z, _ = jax.lax.while_loop(lambda c: c[1] < 40, body, (jnp.ones_like(x), 0))
    return jnp.sum(z * jnp.sin(x))


def sqrt_sin_ref(x):
    return jnp.sum(jnp.sqrt(x) * jnp.sin(x))


def test_forward_mode_forced_on_a_while_loop() -> None:
    x = np.array([0.5, 1.3, 2.0, 0.9])

    def loss(e):
        return lambda y: e(y) ** 2 + jnp.sum(jnp.log(y) * e(y))

    with pytest.raises(ValueError, match="Reverse-mode differentiation does not work"):
        jax.grad(loss(sqrt_sin))(x)
    forced = DifferentiateWith(sqrt_sin, "jax-forward")
    near(jax.grad(loss(forced))(x), jax.grad(loss(sqrt_sin_ref))(x), EXACT)
    near(jax.jit(jax.grad(loss(forced)))(x), jax.grad(loss(sqrt_sin_ref))(x), EXACT)
    xs = np.stack([x, 2 * x])
    near(jax.vmap(jax.grad(loss(forced)))(xs), jax.vmap(jax.grad(loss(sqrt_sin_ref)))(xs), EXACT)
    # traced in line: the piece's forward-mode expressions, no callback
    program = str(jax.make_jaxpr(jax.grad(loss(forced)))(x))
    assert "callback" not in program and LINEAR_MAP not in program
    # second order: DI's rule makes jax-forward forward-over-reverse, which reverses the
    # loop; forward over forward does not
    both = DifferentiateWith(sqrt_sin, SecondOrder(JaxForward(), JaxForward()))
    near(jax.hessian(loss(both))(x), jax.hessian(loss(sqrt_sin_ref))(x), EXACT)


def test_finite_differences_of_a_jax_function() -> None:
    step = DifferentiateWith(m.jnp_step, FiniteDifferences())
    got = jax.jit(jax.grad(m.loss(step)))(X)
    near(got, jax.grad(REF)(X), FIRST)
    # the value is the JAX function itself; the derivatives are the backend's linear maps
    program = str(jax.make_jaxpr(jax.grad(m.loss(step)))(X))
    assert LINEAR_MAP in program and "pure_callback" not in program
    near(jax.vmap(jax.grad(m.loss(step)))(POINTS), jax.vmap(jax.grad(REF))(POINTS), FIRST)
    near(jax.hessian(m.loss(step))(X), jax.hessian(REF)(X), SECOND)


# --- careless and hostile uses ------------------------------------------------------


def test_what_it_cannot_do_is_named() -> None:
    with pytest.raises(TypeError, match="needs a function"):
        DifferentiateWith(3.0, "finite-differences")
    with pytest.raises(DxError, match="no-such-backend"):
        DifferentiateWith(m.np_step, "no-such-backend")
    # a JAX mode on a black box: the way out is named
    black_jax = DifferentiateWith(m.np_step, "jax-reverse")
    with pytest.raises(dxserve.UnsupportedOperatorError, match="finite-differences"):
        jax.grad(m.loss(black_jax))(X)
    # third order of the numpy step: refused, naming the wrapper and its backend
    with pytest.raises(TypeError, match=r"DifferentiateWith\(np_step.*third"):
        jax.jacfwd(jax.hessian(OURS))(X)
    # the step fails on a wrong shape: the function's error, on x
    with pytest.raises(DxError, match="x"):
        jax.grad(lambda y: jnp.sum(m.STEP(y)))(np.ones(7))
    # ... or refuses a point while the compiled program runs: its message comes through
    with pytest.raises(Exception, match="x.0. must be at most 5"):
        jax.jit(jax.grad(m.loss_with_a_domain))(np.array([10.0, 0.0, 0.0, 0.0]))
