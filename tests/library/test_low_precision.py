"""bfloat16 and float16 in process: dtype in is dtype out, JAX's own numbers, and
finite differences refused.

For each JAX backend, every operator's result has x's dtype and equals JAX's own
transformation in that dtype to one unit in the last place (the same maths, maybe
associated differently), and is close to the float64 analytic derivative at a
tolerance set by the dtype's 8 (bfloat16) or 11 (float16) significant bits. Finite
differences would step by ~0.2 (bfloat16) or ~0.1 (float16) of x: they are refused
with a 422 that names the backend and what to do instead, also when ``auto`` falls
back to them for a function JAX cannot trace.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dxserve
from dxcontract import dtypes
from dxcontract.errors import PreparationMismatchError, UnsupportedOperatorError
from dxserve import FiniteDifferences, JaxReverse, SecondOrder, Sparse
from dxserve.core.request_batching import agree_to_rounding
from dxserve.examples import rosenbrock, sin_cumsum
from tests.references import rosenbrock_gradient, rosenbrock_hessian

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
LOW = [pytest.param(BF16, id="bfloat16"), pytest.param(F16, id="float16")]
#: relative error against float64, as a fraction of the largest entry: a few roundings
#: of 2**-8 (bfloat16) or 2**-11 (float16); measured 0.5e-2 and 0.5e-3
RTOL = {BF16: 1e-2, F16: 1e-3}
#: x and a tangent, exact in both dtypes
X64 = np.array([0.5, 1.5, -1.0, 0.75, 1.25])
T64 = np.array([1.0, -0.5, 0.25, 2.0, -1.0])
BACKENDS = ["jax-forward", "jax-reverse", "auto"]






def ulps(a: np.ndarray, b: np.ndarray) -> int:
    """Largest distance in units in the last place between two 16-bit float arrays."""
    def ordered(v: np.ndarray) -> np.ndarray:
        bits = np.ascontiguousarray(v).view(np.uint16).astype(np.int64)
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)

    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    return int(np.abs(ordered(a) - ordered(b)).max(initial=0))


def same_dtype_and_jax(got, want, dt: np.dtype) -> np.ndarray:
    """``got`` has dtype ``dt`` and is JAX's ``want`` to one ulp; returns it in numpy."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == dt and want.dtype == dt
    assert ulps(got, want) <= 1, (got, want)
    return got


def close_to_float64(got: np.ndarray, ref: np.ndarray, dt: np.dtype) -> None:
    rtol = RTOL[dt]
    np.testing.assert_allclose(
        got.astype(np.float64), ref, rtol=rtol, atol=rtol * np.abs(ref).max()
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dt", LOW)
def test_gradient_and_jacobian_keep_the_dtype_and_are_jaxs(dt: np.dtype, backend: str) -> None:
    x = X64.astype(dt)
    xj = jnp.asarray(x)
    reverse = backend != "jax-forward"  # auto: reverse for a gradient, and R^5 -> R
    own = jax.grad(rosenbrock)(xj) if reverse else jax.jacfwd(rosenbrock)(xj)
    g = same_dtype_and_jax(dxserve.gradient(rosenbrock, backend, x), own, dt)
    close_to_float64(g, rosenbrock_gradient(X64), dt)
    j = same_dtype_and_jax(dxserve.jacobian(rosenbrock, backend, x), own, dt)
    close_to_float64(j, rosenbrock_gradient(X64), dt)
    # a square Jacobian: auto goes forward (n <= m)
    own = (jax.jacrev if backend == "jax-reverse" else jax.jacfwd)(sin_cumsum)(xj)
    same_dtype_and_jax(dxserve.jacobian(sin_cumsum, backend, x), own, dt)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dt", LOW)
def test_hvp_and_hessian_keep_the_dtype_and_are_jaxs(dt: np.dtype, backend: str) -> None:
    """Every JAX backend's second order is forward-over-reverse."""
    x, t = X64.astype(dt), T64.astype(dt)
    xj = jnp.asarray(x)
    (hv,) = dxserve.hvp(rosenbrock, backend, x, (t,))
    own = jax.jvp(jax.grad(rosenbrock), (xj,), (jnp.asarray(t),))[1]
    hv = same_dtype_and_jax(hv, own, dt)
    close_to_float64(hv, rosenbrock_hessian(X64) @ T64, dt)
    h = same_dtype_and_jax(
        dxserve.hessian(rosenbrock, backend, x), jax.jacfwd(jax.grad(rosenbrock))(xj), dt
    )
    close_to_float64(h, rosenbrock_hessian(X64), dt)
    h2 = dxserve.hessian(rosenbrock, SecondOrder(JaxReverse(), JaxReverse()), x)
    same_dtype_and_jax(h2, jax.jacrev(jax.grad(rosenbrock))(xj), dt)


@pytest.mark.parametrize("dt", LOW)
def test_pytree_leaves_keep_their_dtypes(dt: np.dtype) -> None:
    x = {"a": X64[:3].astype(dt), "b": X64[3:].astype(np.float32)}

    def f(p):
        return jnp.sum(p["a"] ** 2) + jnp.sum(p["b"] ** 3).astype(p["a"].dtype)

    g = dxserve.gradient(f, "jax-reverse", x)
    assert np.asarray(g["a"]).dtype == dt and np.asarray(g["b"]).dtype == np.float32
    same_dtype_and_jax(g["a"], jax.grad(f)(jax.tree.map(jnp.asarray, x))["a"], dt)


@pytest.mark.parametrize(
    "backend",
    [
        "finite-differences",
        FiniteDifferences(method="forward", step=0.01),
        SecondOrder(FiniteDifferences(), JaxReverse()),
        SecondOrder(JaxReverse(), FiniteDifferences()),
        Sparse(dense=FiniteDifferences()),
    ],
    ids=["fd", "fd-forward", "fd-over-reverse", "reverse-over-fd", "sparse-fd"],
)
@pytest.mark.parametrize("dt", LOW)
def test_finite_differences_refuse_low_precision(dt: np.dtype, backend) -> None:
    x = X64.astype(dt)
    operators = ["hessian"] if isinstance(backend, SecondOrder) else ["gradient", "hessian"]
    for operator in operators:
        with pytest.raises(UnsupportedOperatorError) as info:
            getattr(dxserve, operator)(rosenbrock, backend, x)
        err = info.value
        assert err.field == "backend"
        assert "finite-differences" in err.detail and dt.name in err.detail
        assert "use jax-forward or jax-reverse, or send float32/float64" in err.detail


def numpy_only(x):
    """A function JAX cannot trace: ``auto`` falls back to finite differences."""
    return float(np.sum(np.asarray(x, dtype=np.float64) ** 2))


@pytest.mark.parametrize("dt", LOW)
def test_auto_on_a_black_box_refuses_low_precision_too(dt: np.dtype) -> None:
    with pytest.raises(UnsupportedOperatorError) as info:
        dxserve.gradient(numpy_only, "auto", X64.astype(dt))
    assert info.value.field == "backend"
    assert dt.name in info.value.detail and "send float32/float64" in info.value.detail
    # float32 is still served there, by finite differences
    g = dxserve.gradient(numpy_only, "auto", X64.astype(np.float32))
    np.testing.assert_allclose(np.asarray(g), 2 * X64, rtol=1e-3)


def test_float32_finite_differences_are_still_served() -> None:
    g = np.asarray(dxserve.gradient(rosenbrock, "finite-differences", X64.astype(np.float32)))
    assert g.dtype == np.float32
    np.testing.assert_allclose(g, rosenbrock_gradient(X64), rtol=1e-3, atol=1e-2)


def test_a_prep_names_the_low_precision_dtype_it_was_made_for() -> None:
    prep = dxserve.prepare_gradient(rosenbrock, "jax-reverse", X64.astype(BF16))
    g = dxserve.gradient(rosenbrock, "jax-reverse", X64.astype(BF16), prep=prep)
    assert np.asarray(g).dtype == BF16
    with pytest.raises(PreparationMismatchError, match="float16 differs from prepared bfloat16"):
        dxserve.gradient(rosenbrock, "jax-reverse", X64.astype(F16), prep=prep)


def test_the_contract_counts_bfloat16_as_a_float() -> None:
    assert dtypes.is_floating(BF16) and dtypes.is_inexact(BF16) and dtypes.kind(BF16) == "f"
    assert dtypes.is_floating(BF16.newbyteorder(">"))
    assert not dtypes.is_floating(np.dtype("V2")) and not dtypes.is_floating(np.int16)
    assert dtypes.finfo(BF16).eps == 2.0**-7 and dtypes.finfo(F16).eps == 2.0**-10
    # batched bfloat16 rows must match bit for bit: 256 ulps of it would be a factor of 2
    a = np.array([1.0, 2.0, 256.0], BF16)
    assert agree_to_rounding(a, a.copy())
    assert not agree_to_rounding(a, np.array([1.0, 2.0, 258.0], BF16))
