"""Complex numbers follow JAX's convention on every backend.

For z = x + iy and a real-valued f, ``jax.grad`` answers ∂f/∂x - i ∂f/∂y; ``jax.jvp`` is
the map t -> ∂f/∂x Re t + ∂f/∂y Im t; ``jax.vjp`` its transpose under Re Σ c w. Every
operator is checked here against JAX's own transformation of the same function:

* gradient: ``jax.grad`` (``holomorphic=True`` for a complex-valued f);
* jacobian and derivative of complex x: only with ``holomorphic=True`` (``jax.jacfwd``'s
  ``holomorphic=True``), refused otherwise as ``jax.jacfwd`` refuses them; of real x,
  ``jax.jacfwd``;
* pushforward / pullback: ``jax.jvp`` / ``jax.vjp``;
* hessian and second_derivative of complex x: ``jax.hessian(f, holomorphic=True)`` for f
  declared holomorphic, refused otherwise (as ``jax.hessian`` refuses them); hvp:
  ``jax.jvp(jax.grad(f))``.

So ``J @ t`` is the pushforward along t, and ``H @ t`` the HVP, for every case that answers.

Exact backends at rtol 1e-10 in complex128, finite differences at their own tolerances
(measured worst cases below, with headroom), complex64 looser. Backends that cannot
honour the convention refuse with ``UnsupportedOperatorError`` naming the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dxserve
from dxcontract.errors import DtypeMismatchError, UnsupportedOperatorError
from dxserve import (
    FiniteDifferences,
    JaxForward,
    JaxReverse,
    SecondOrder,
    Sparse,
    backend_from_json,
)
from dxserve.core.backends.finite_differences import uses_finite_differences
from dxserve.core.holomorphic import declared
from dxserve.core.limits import ComputeLimits

jax.config.update("jax_enable_x64", True)  # the references, in complex128

# --- the bullet's example ---------------------------------------------------------------
Z = np.array([1 + 2j, -0.5 + 0.3j])


def example(z):
    return jnp.sum(jnp.abs(z) ** 2 + jnp.real(z) * jnp.imag(z))


def example_gradient(z: np.ndarray) -> np.ndarray:
    """By hand: ∂f/∂x = 2x + y, ∂f/∂y = 2y + x, so ∂f/∂x - i ∂f/∂y."""
    x, y = z.real, z.imag
    return (2 * x + y) - 1j * (2 * y + x)


EVERY_BACKEND = [
    "jax-reverse", "auto", "jax-forward", "finite-differences",
    JaxForward(batch_size=1), JaxReverse(batch_size=1), FiniteDifferences("forward"),
    Sparse(), {"type": "sparse", "dense": "finite-differences"},
]  # fmt: skip


@pytest.mark.parametrize("backend", EVERY_BACKEND, ids=str)
def test_the_example_gradient_on_every_backend(backend: Any) -> None:
    want = np.array([4 - 5j, -0.7 - 0.1j])
    np.testing.assert_allclose(example_gradient(Z), want, rtol=1e-15)
    np.testing.assert_allclose(jax.grad(example)(Z), want, rtol=1e-15)
    got = np.asarray(dxserve.gradient(example, backend, Z))
    assert got.dtype == np.complex128 and got.shape == (2,)
    fd = uses_finite_differences(backend_from_json(backend))
    np.testing.assert_allclose(got, want, rtol=1e-6 if fd else 1e-12, atol=1e-6 if fd else 0)


# --- the grid -----------------------------------------------------------------------------
W = 0.7 - 0.4j  # the scalar input of derivative and second_derivative
ZS = np.array([1 + 2j, -0.5 + 0.3j, 0.25 - 0.8j])


def r_scalar(z):  # real-valued, not holomorphic, coupling the entries
    return (
        jnp.sum(jnp.abs(z) ** 2 + jnp.real(z) * jnp.imag(z))
        + jnp.sin(jnp.real(z[0])) * jnp.imag(z[1]) ** 3
        + jnp.real(z[0] * jnp.conj(z[2])) ** 2
    )


def r_vector(z):
    return jnp.stack(
        [r_scalar(z), jnp.real(z[1]) * jnp.imag(z[2]) ** 2 + jnp.imag(z[0]), jnp.abs(z[0] * z[1])]
    )


def h_scalar(z):  # holomorphic
    return jnp.sum(z**2 * jnp.sin(z)) + z[0] * z[1] * z[2]


def h_vector(z):
    return z**2 * jnp.sin(jnp.roll(z, 1)) + jnp.exp(z[0]) * z


def r_of_scalar(w):
    return jnp.stack(
        [jnp.abs(w) ** 2 + jnp.real(w) * jnp.imag(w) ** 2, jnp.sin(jnp.real(w)) * jnp.imag(w)]
    )


def h_of_scalar(w):
    return jnp.stack([w**3 * jnp.exp(w), jnp.sin(w) / (1 + w**2)])


#: operator -> (x, real-valued function, holomorphic function)
OPERANDS: dict[str, tuple[Any, Callable, Callable]] = {
    "gradient": (ZS, r_scalar, h_scalar),
    "jacobian": (ZS, r_vector, h_vector),
    "pushforward": (ZS, r_vector, h_vector),
    "pullback": (ZS, r_vector, h_vector),
    "hessian": (ZS, r_scalar, h_scalar),
    "hvp": (ZS, r_scalar, h_scalar),
    "derivative": (np.asarray(W), r_of_scalar, h_of_scalar),
    "second_derivative": (np.asarray(W), r_of_scalar, h_of_scalar),
}
T1 = np.array([0.3 - 0.7j, 1.1 + 0.4j, -0.2 + 0.9j])
T2 = np.array([-1.0 + 0.5j, 0.2 - 0.1j, 0.6 + 0.6j])


def _holo(f: Callable, x: Any) -> bool:
    return jnp.iscomplexobj(jax.eval_shape(f, x))


def _jac(f: Callable, x: Any) -> Any:
    """JAX's Jacobian: jacrev for real-valued f, jacfwd(holomorphic=True) for complex f."""
    return jax.jacfwd(f, holomorphic=True)(x) if _holo(f, x) else jax.jacrev(f)(x)


def _grad(f: Callable) -> Callable:
    return lambda u: jax.grad(f, holomorphic=_holo(f, u))(u)


def _cotangents(f: Callable, x: Any, dtype: Any) -> tuple:
    y = jax.eval_shape(f, x)
    base = np.arange(1.0, 1.0 + np.prod(y.shape)).reshape(y.shape)
    if _holo(f, x):
        return (base * (0.5 - 0.2j)).astype(dtype), (base[::-1] * (-0.3 + 1j)).astype(dtype)
    real = np.finfo(dtype).dtype
    return (0.5 * base).astype(real), (-base[::-1]).astype(real)


def reference(operator: str, f: Callable, x: Any, dtype: Any) -> Any:
    """JAX's own answer (in complex128; ``dtype`` picks the tangents)."""
    x = np.asarray(x, np.complex128)
    ts = (T1, T2)
    if operator == "gradient":
        return _grad(f)(x)
    if operator in ("jacobian", "derivative"):
        return _jac(f, x)
    if operator == "pushforward":
        return tuple(jax.jvp(f, (x,), (t.astype(dtype).astype(np.complex128),))[1] for t in ts)
    if operator == "pullback":
        _, vjp = jax.vjp(f, x)
        return tuple(vjp(jnp.asarray(c, np.result_type(c, np.float64)))[0]
                     for c in _cotangents(f, x, dtype))
    if operator == "hessian":
        return jax.jacfwd(_grad(f), holomorphic=True)(x)
    if operator == "hvp":
        return tuple(jax.jvp(_grad(f), (x,), (t.astype(dtype).astype(np.complex128),))[1]
                     for t in ts)
    if operator == "second_derivative":
        return jax.jacfwd(lambda u: _jac(f, u), holomorphic=True)(x)
    raise AssertionError(operator)


#: the operators whose result is a Jacobian matrix: refused for complex x unless f is
#: declared holomorphic, as jax.jacfwd and jax.hessian refuse it
JACOBIANS = ("jacobian", "derivative", "hessian", "second_derivative")


def run(operator: str, f: Callable, backend: Any, x: Any) -> Any:
    if operator in JACOBIANS:
        return getattr(dxserve, operator)(f, backend, x, holomorphic=True)
    if operator in ("pushforward", "hvp"):
        return getattr(dxserve, operator)(f, backend, x, (T1.astype(x.dtype), T2.astype(x.dtype)))
    if operator == "pullback":
        return dxserve.pullback(f, backend, x, _cotangents(f, x, x.dtype))
    return getattr(dxserve, operator)(f, backend, x)


SECOND = ("hessian", "hvp", "second_derivative")
# id -> (backend, operators it is checked on, tolerance key)
GRID_BACKENDS: dict[str, tuple[Any, tuple[str, ...] | None, str]] = {
    "jax-forward": ("jax-forward", None, "exact"),
    "jax-reverse": ("jax-reverse", None, "exact"),
    "auto": ("auto", None, "exact"),
    "fwd-bs2": (JaxForward(batch_size=2), None, "exact"),
    "so(rev,fwd)": (SecondOrder(JaxReverse(), JaxForward()), SECOND, "exact"),
    "so(rev,rev)": (SecondOrder(JaxReverse(), JaxReverse()), SECOND, "exact"),
    "sparse-column": (Sparse(coloring="column"), ("jacobian", "hessian"), "exact"),
    "sparse-row": (Sparse(coloring="row"), ("jacobian",), "exact"),
    "fd-central": ("finite-differences", None, "fd"),
    "fd-forward": (FiniteDifferences("forward"), tuple(o for o in OPERANDS if o not in SECOND),
                   "fd-forward"),
    "so(fd,rev)": (SecondOrder(FiniteDifferences(), JaxReverse()), SECOND, "fd-over-exact"),
}  # fmt: skip

# Exact backends: elementwise rtol. Finite differences: max|a - e| <= tol * max(1, max|e|)
# per result. Measured worst cases over this grid (complex128 / complex64), and the bounds
# (headroom 10-100x):
#   exact                          5.6e-16 / 3.0e-7     -> 1e-10 / 1e-5
#   central (first order)          7.9e-11 / 5.5e-5     -> 1e-8  / 1e-3
#   central over central (second)  3.4e-8  / 7.8e-4     -> 1e-6  / 2e-2
#   forward (first order)          4.0e-8  / 8.2e-4     -> 1e-6  / 1e-2
#   central over exact (second)    6.4e-11 / 4.0e-5     -> 1e-8  / 1e-3
TOL = {
    ("exact", "complex128"): 1e-10, ("exact", "complex64"): 1e-5,
    ("fd", "complex128"): 1e-8, ("fd", "complex64"): 1e-3,
    ("fd-second", "complex128"): 1e-6, ("fd-second", "complex64"): 2e-2,
    ("fd-forward", "complex128"): 1e-6, ("fd-forward", "complex64"): 1e-2,
    ("fd-over-exact", "complex128"): 1e-8, ("fd-over-exact", "complex64"): 1e-3,
}  # fmt: skip


def _cases() -> list:
    out = []
    for dtype in ("complex128", "complex64"):
        for bid, (backend, ops, tol) in GRID_BACKENDS.items():
            for operator in OPERANDS:
                if ops is not None and operator not in ops:
                    continue
                key = "fd-second" if tol == "fd" and operator in SECOND else tol
                if (key, dtype) not in TOL:
                    continue
                for kind in ("real", "holomorphic"):
                    if kind == "real" and operator in JACOBIANS:
                        continue  # refused: test_jacobians_of_complex_x_need_holomorphic
                    if bid.startswith("sparse") and operator == "hessian" and kind == "holomorphic":
                        continue  # refused: test_sparse_refusals
                    out.append(pytest.param(
                        operator, kind, backend, key, dtype,
                        id=f"{operator}-{kind}-{bid}-{dtype}",
                    ))
    return _one_dtype_each_in_make_test(out)


def _one_dtype_each_in_make_test(cases: list) -> list:
    """Each (operator, kind, backend) runs at one dtype in ``make test``, complex128 and
    complex64 in turn; its other dtype is marked slow (``make test-slow``, which CI runs)."""
    triples: list[str] = []
    for p in cases:
        triple = p.id.rsplit("-", 1)[0]
        if triple not in triples:
            triples.append(triple)
    dtypes = ("complex128", "complex64")
    fast = {f"{t}-{dtypes[i % 2]}" for i, t in enumerate(triples)}
    return [p if p.id in fast else pytest.param(*p.values, id=p.id, marks=pytest.mark.slow)
            for p in cases]


def _close(got: Any, want: Any, key: str, dtype: str) -> None:
    tol = TOL[(key, dtype)]
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    if key == "exact":
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()) / 10)
    else:
        assert np.abs(got - want).max() <= tol * max(1.0, np.abs(want).max()), (got, want)


@pytest.mark.parametrize(("operator", "kind", "backend", "key", "dtype"), _cases())
def test_against_jax(operator: str, kind: str, backend: Any, key: str, dtype: str) -> None:
    x0, real_f, holo_f = OPERANDS[operator]
    f = real_f if kind == "real" else holo_f
    x = np.asarray(x0).astype(dtype)
    got = run(operator, f, backend, x)
    want = reference(operator, f, x, dtype)
    if hasattr(got, "todense"):  # sparse: the flat (m, n) matrix
        got = np.asarray(got.todense()).reshape(np.shape(want))
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert np.asarray(g).dtype == _at_precision(w, dtype)
            _close(g, w, key, dtype)
    else:
        assert np.asarray(got).dtype == _at_precision(want, dtype)
        _close(got, want, key, dtype)


def _at_precision(want: Any, dtype: str) -> np.dtype:
    """JAX's dtype at x's precision: complex wherever JAX's answer is."""
    return np.dtype(dtype) if jnp.iscomplexobj(want) else np.finfo(dtype).dtype


def test_holomorphic_references_are_jaxs_holomorphic_transformations() -> None:
    """For holomorphic f the references above are JAX's ``holomorphic=True`` ones."""
    np.testing.assert_allclose(
        reference("hessian", h_scalar, ZS, np.complex128), jax.hessian(h_scalar, holomorphic=True)(ZS)
    )
    np.testing.assert_allclose(
        reference("jacobian", h_vector, ZS, np.complex128), jax.jacrev(h_vector, holomorphic=True)(ZS)
    )


# --- more structure: values, pytrees, batches, real x with complex f ---------------------
@pytest.mark.parametrize("backend", ["jax-forward", "jax-reverse", "finite-differences"])
def test_values_come_back_complex(backend: str) -> None:
    y, g = dxserve.value_and_gradient(h_scalar, backend, ZS)
    np.testing.assert_allclose(y, h_scalar(ZS), rtol=1e-14)
    assert np.asarray(y).dtype == np.complex128
    y, j = dxserve.value_and_jacobian(h_vector, backend, ZS, holomorphic=True)
    assert np.asarray(y).dtype == np.complex128 and np.asarray(j).dtype == np.complex128
    np.testing.assert_allclose(y, h_vector(ZS), rtol=1e-14)


def tree_f(x):  # real-valued, of a pytree holding a complex leaf and a real one
    z, r = x["z"], x["r"]
    return jnp.sum(jnp.abs(z) ** 2 * r) + jnp.real(z[0]) * jnp.imag(z[1]) * r[1] ** 2


def tree_vector(x):
    return {"a": jnp.stack([tree_f(x), jnp.imag(x["z"][0]) * x["r"][0]]), "b": x["z"] * x["r"]}


TREE = {"z": np.array([1 + 2j, -0.5 + 0.3j]), "r": np.array([0.7, -1.3])}
TREE_T = {"z": np.array([0.2 - 1j, 0.4 + 0.1j]), "r": np.array([1.0, 0.5])}


def _tree_close(got: Any, want: Any, rtol: float) -> None:
    g_leaves, g_def = jax.tree_util.tree_flatten(got)
    w_leaves, w_def = jax.tree_util.tree_flatten(want)
    assert g_def == w_def
    for g, w in zip(g_leaves, w_leaves, strict=True):
        assert np.asarray(g).shape == np.asarray(w).shape
        assert np.asarray(g).dtype == np.asarray(w).dtype, (g, w)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("backend", ["jax-forward", "jax-reverse", "auto", "finite-differences"])
def test_pytrees_with_complex_leaves(backend: str) -> None:
    rtol = 1e-6 if backend == "finite-differences" else 1e-10
    _tree_close(dxserve.gradient(tree_f, backend, TREE), jax.grad(tree_f)(TREE), rtol)
    # x has a complex leaf and a real one: no Jacobian (jax.jacfwd refuses it, with
    # holomorphic=True too, which needs every leaf complex)
    for holomorphic, error in ((False, UnsupportedOperatorError), (True, DtypeMismatchError)):
        with pytest.raises(error) as info:
            dxserve.jacobian(tree_vector, backend, TREE, holomorphic=holomorphic)
        assert info.value.field == "holomorphic"
        with pytest.raises(error):
            dxserve.hessian(tree_f, backend, TREE, holomorphic=holomorphic)
    (pushed,) = dxserve.pushforward(tree_vector, backend, TREE, (TREE_T,))
    _tree_close(pushed, jax.jvp(tree_vector, (TREE,), (TREE_T,))[1], rtol)
    cot = {"a": np.array([1.0, -2.0]), "b": np.array([0.5 + 1j, -1.0 + 0.25j])}
    (pulled,) = dxserve.pullback(tree_vector, backend, TREE, (cot,))
    _tree_close(pulled, jax.vjp(tree_vector, TREE)[1](cot)[0], rtol)
    second = 1e-5 if backend == "finite-differences" else 1e-10
    (hv,) = dxserve.hvp(tree_f, backend, TREE, (TREE_T,))
    _tree_close(hv, jax.jvp(jax.grad(tree_f), (TREE,), (TREE_T,))[1], second)


@pytest.mark.parametrize("backend", ["jax-forward", "auto", "finite-differences"])
def test_batches_of_complex_points(backend: str) -> None:
    zs = np.stack([ZS, ZS * (0.5 - 1j), -ZS.conj()])
    rtol = 1e-6 if backend == "finite-differences" else 1e-10
    got = dxserve.gradient(r_scalar, backend, zs, batch_axis=0)
    np.testing.assert_allclose(got, np.stack([jax.grad(r_scalar)(z) for z in zs]), rtol=rtol, atol=rtol)
    got = dxserve.jacobian(h_vector, backend, zs, batch_axis=0, holomorphic=True)
    want = np.stack([jax.jacfwd(h_vector, holomorphic=True)(z) for z in zs])
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)
    ts = np.stack([T1, T2, T1 + T2])
    (got,) = dxserve.hvp(r_scalar, backend, zs, (ts,), batch_axis=0)
    want = np.stack([jax.jvp(jax.grad(r_scalar), (z,), (t,))[1] for z, t in zip(zs, ts, strict=True)])
    np.testing.assert_allclose(got, want, rtol=100 * rtol, atol=100 * rtol)


def phase(x):  # complex-valued, of real x
    return jnp.exp(1j * x) * x[::-1]


@pytest.mark.parametrize("backend", ["jax-forward", "jax-reverse", "auto", "finite-differences",
                                     Sparse(coloring="row")], ids=str)
def test_complex_valued_functions_of_real_x(backend: Any) -> None:
    x = np.array([0.3, -1.2, 2.0])
    rtol = 1e-6 if uses_finite_differences(backend_from_json(backend)) else 1e-10
    jac = dxserve.jacobian(phase, backend, x)
    jac = np.asarray(jac.todense()) if hasattr(jac, "todense") else np.asarray(jac)
    assert jac.dtype == np.complex128
    np.testing.assert_allclose(jac, jax.jacfwd(phase)(x), rtol=rtol, atol=rtol)
    if isinstance(backend, Sparse):
        return
    c = np.array([1 - 1j, 0.5j, 2.0 + 0j])
    (pulled,) = dxserve.pullback(phase, backend, x, (c,))
    assert np.asarray(pulled).dtype == np.float64
    np.testing.assert_allclose(pulled, jax.vjp(phase, x)[1](c)[0], rtol=rtol, atol=rtol)
    (pushed,) = dxserve.pushforward(phase, backend, x, (np.array([1.0, 2.0, -1.0]),))
    np.testing.assert_allclose(pushed, jax.jvp(phase, (x,), (np.array([1.0, 2.0, -1.0]),))[1],
                               rtol=rtol, atol=rtol)
    d = dxserve.derivative(lambda s: phase(s * x), backend, np.asarray(0.8))
    np.testing.assert_allclose(d, jax.jacfwd(lambda s: phase(s * x))(0.8), rtol=rtol, atol=rtol)


# --- refusals ---------------------------------------------------------------------------
def test_a_gradient_of_a_complex_valued_function_needs_complex_x() -> None:
    """jax.grad refuses complex outputs unless holomorphic=True, which needs complex x."""
    for operator in ("gradient", "hessian"):
        with pytest.raises(DtypeMismatchError) as info:
            getattr(dxserve, operator)(lambda x: jnp.sum(jnp.exp(1j * x)), "auto", np.ones(3))
        assert info.value.field == "x" and "jacobian" in info.value.detail
    with pytest.raises(DtypeMismatchError):
        dxserve.hvp(lambda x: jnp.sum(jnp.exp(1j * x)), "auto", np.ones(3), (np.ones(3),))
    # with complex x it is the holomorphic gradient
    np.testing.assert_allclose(
        dxserve.gradient(lambda z: jnp.sum(jnp.exp(1j * z)), "auto", ZS),
        jax.grad(lambda z: jnp.sum(jnp.exp(1j * z)), holomorphic=True)(ZS),
    )


def test_sparse_refusals() -> None:
    # JAX's Hessian of a real function of complex x is not symmetric: no star colouring
    with pytest.raises(UnsupportedOperatorError) as info:
        dxserve.hessian(r_scalar, Sparse(), ZS)
    assert info.value.field == "holomorphic"  # no Hessian of a real f of complex x at all
    with pytest.raises(UnsupportedOperatorError) as info:
        dxserve.hessian(h_scalar, Sparse(coloring="column"), ZS, holomorphic=True)
    assert info.value.field == "backend" and "jax-reverse" in info.value.detail
    # the same function's real-part Hessian still runs star-coloured on real x
    x = np.array([0.4, -1.0, 2.0])
    np.testing.assert_allclose(
        np.asarray(dxserve.hessian(r_scalar, Sparse(), x).todense()), jax.hessian(r_scalar)(x),
        rtol=1e-10,
    )


def test_complex_jacobians_run_one_shot_under_chunking_limits() -> None:
    """Basis chunks are of real basis vectors; complex x runs in one call, correct."""
    z = (np.linspace(0.1, 1.0, 24) + 1j * np.linspace(-1.0, 0.5, 24))
    for backend in ("jax-forward", "jax-reverse"):
        prep = dxserve.core.preparation.prepare(
            "jacobian", declared(h_vector), backend, z, None, (),
            limits=ComputeLimits(chunk_from=4),
        )
        assert not prep.chunked("jacobian")
        (jac,) = prep.run("jacobian", z, None, ())
        np.testing.assert_allclose(jac, jax.jacfwd(h_vector, holomorphic=True)(z), rtol=1e-10)


def test_black_box_numpy_functions_of_complex_x() -> None:
    """A function JAX cannot trace: auto takes finite differences of its real and
    imaginary parts, one evaluation at a time."""

    def black_box(z):
        return float(np.sum(np.abs(z) ** 2 + np.real(z) * np.imag(z)))

    np.testing.assert_allclose(dxserve.gradient(black_box, "auto", Z), example_gradient(Z), rtol=1e-8)
    (hv,) = dxserve.hvp(black_box, "auto", Z, (Z[::-1],))
    np.testing.assert_allclose(
        hv, jax.jvp(jax.grad(example), (Z,), (Z[::-1],))[1], rtol=1e-6, atol=1e-6
    )
    (pushed,) = dxserve.pushforward(lambda z: np.sin(z) * z, "auto", ZS, (T1,))
    np.testing.assert_allclose(pushed, jax.jvp(lambda z: jnp.sin(z) * z, (ZS,), (T1,))[1], rtol=1e-8)


# --- Jacobians of complex x: holomorphic functions only ---------------------------------
def z_conj_z2(z):  # z conj(z)^2: not holomorphic
    return z * jnp.conj(z) ** 2


JAC_BACKENDS = ["jax-forward", "jax-reverse", "auto", "finite-differences",
                SecondOrder(JaxReverse(), JaxForward())]


@pytest.mark.parametrize("backend", JAC_BACKENDS, ids=str)
@pytest.mark.parametrize(
    ("operator", "f", "x"),
    [("jacobian", z_conj_z2, ZS), ("jacobian", r_vector, ZS), ("hessian", r_scalar, ZS),
     ("derivative", z_conj_z2, np.asarray(W)), ("derivative", r_of_scalar, np.asarray(W)),
     ("second_derivative", r_of_scalar, np.asarray(W)),
     ("value_and_jacobian", z_conj_z2, ZS), ("value_gradient_and_hessian", r_scalar, ZS)],
)
def test_jacobians_of_complex_x_need_holomorphic(operator: str, f: Callable, x: Any, backend: Any) -> None:
    """Without the declaration, a Jacobian of complex x is refused as jax.jacfwd and
    jax.hessian refuse it; the problem names holomorphic and its fix."""
    if isinstance(backend, SecondOrder) and "hessian" not in operator and "second" not in operator:
        return  # a first-order operator takes no second-order backend
    for ref in (jax.jacfwd, jax.hessian):
        with pytest.raises(TypeError, match="holomorphic"):
            ref(f)(x)
    with pytest.raises(UnsupportedOperatorError) as info:
        getattr(dxserve, operator)(f, backend, x)
    assert info.value.field == "holomorphic" and info.value.fix == {"holomorphic": True}
    assert "holomorphic=True" in info.value.detail


def test_the_finding_jacobian_is_refused_and_pushforward_answers() -> None:
    """f(z) = z conj(z)^2: J @ t = pushforward(t) cannot hold for any complex matrix J
    (the pushforward 4-13j along t = 1 at z = (1+2j) is not complex-linear in t)."""
    z, t = np.array([1 + 2j]), np.array([1.0 + 0j])
    (pushed,) = dxserve.pushforward(z_conj_z2, "auto", z, (t,))
    np.testing.assert_allclose(pushed, jax.jvp(z_conj_z2, (z,), (t,))[1], rtol=1e-15)
    with pytest.raises(UnsupportedOperatorError):
        dxserve.jacobian(z_conj_z2, "auto", z)
    # declared holomorphic (wrongly here), it is JAX's holomorphic=True answer, ∂f/∂Re z
    np.testing.assert_allclose(
        dxserve.jacobian(z_conj_z2, "auto", z, holomorphic=True),
        jax.jacfwd(z_conj_z2, holomorphic=True)(z), rtol=1e-12,
    )


@pytest.mark.parametrize("backend", JAC_BACKENDS[:4], ids=str)
def test_declared_jacobians_agree_with_pushforwards_and_hvps(backend: Any) -> None:
    """Every complex Jacobian that answers is the matrix of the pushforward: J @ t ==
    pushforward(t), H @ t == hvp(t), f''(w) t == derivative's pushforward."""
    fd = uses_finite_differences(backend_from_json(backend))
    rtol = 1e-7 if fd else 1e-10
    jac = dxserve.jacobian(h_vector, backend, ZS, holomorphic=True)
    pushed = dxserve.pushforward(h_vector, backend, ZS, (T1, T2))
    for t, p in zip((T1, T2), pushed, strict=True):
        np.testing.assert_allclose(np.asarray(jac) @ t, p, rtol=rtol)
    hess = dxserve.hessian(h_scalar, backend, ZS, holomorphic=True)
    np.testing.assert_allclose(hess, jax.hessian(h_scalar, holomorphic=True)(ZS), rtol=100 * rtol)
    for t, hv in zip((T1, T2), dxserve.hvp(h_scalar, backend, ZS, (T1, T2)), strict=True):
        np.testing.assert_allclose(np.asarray(hess) @ t, hv, rtol=100 * rtol)
    w, s = np.asarray(W), np.asarray(0.3 - 1.1j)
    d = dxserve.derivative(h_of_scalar, backend, w, holomorphic=True)
    (pushed,) = dxserve.pushforward(h_of_scalar, backend, w, (s,))
    np.testing.assert_allclose(np.asarray(d) * s, pushed, rtol=rtol)
    d2 = dxserve.second_derivative(h_of_scalar, backend, w, holomorphic=True)
    np.testing.assert_allclose(
        d2, jax.jacfwd(jax.jacfwd(h_of_scalar, holomorphic=True), holomorphic=True)(w),
        rtol=100 * rtol,
    )


def test_holomorphic_needs_complex_leaves_everywhere() -> None:
    """As JAX's holomorphic=True: complex x and complex f(x)."""
    with pytest.raises(DtypeMismatchError) as info:
        dxserve.jacobian(r_vector, "auto", ZS, holomorphic=True)  # real-valued
    assert info.value.field == "holomorphic" and "f(x)" in info.value.detail
    with pytest.raises(DtypeMismatchError) as info:
        dxserve.jacobian(phase, "auto", np.ones(3), holomorphic=True)  # real x
    assert info.value.field == "holomorphic"


def test_real_x_needs_no_declaration() -> None:
    """A Jacobian of real x (complex-valued f too) is jax.jacfwd's, declared or not."""
    x = np.array([0.3, -1.2, 2.0])
    np.testing.assert_allclose(dxserve.jacobian(phase, "auto", x), jax.jacfwd(phase)(x), rtol=1e-12)
    np.testing.assert_allclose(dxserve.hessian(lambda u: jnp.sum(u**3), "auto", x),
                               jax.hessian(lambda u: jnp.sum(u**3))(x), rtol=1e-12)
