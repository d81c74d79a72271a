"""Derivatives with respect to any argument (``wrt``, JAX's ``argnums``), in process.

Every operator with ``wrt`` is compared with JAX's own transformation with ``argnums``
in float64 (rtol 1e-10; 1e-7 for finite differences); a context is never a silent
zero, and what cannot be differentiated is refused naming the argument. The same
holds for ``DifferentiateWith`` under ``jax.grad``/``jax.hessian``/``jacrev``/``jacfwd``
with ``argnums``, and for an operator nested inside a JAX transformation that moves
a context.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dxserve
from dxcontract.errors import DtypeMismatchError, InvalidArgumentError, PreparationMismatchError
from dxserve import DifferentiateWith
from tests import wrt_functions as m

EXACT, FD = 1e-10, 1e-7
RNG = np.random.default_rng(46)
W = RNG.normal(size=(2, 2))
DATA = RNG.normal(size=(3, 2))
SCALE = np.asarray(1.5)


@pytest.fixture(autouse=True)
def x64() -> Iterator[None]:
    with jax.enable_x64(True):
        yield


def near(got, want, rtol: float) -> None:
    """Leaf by leaf, at the scale of the whole result (some blocks are zeros)."""
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    scale = max(float(np.max(np.abs(w))) for w in want_leaves)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert np.shape(g) == np.shape(w)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=rtol * scale)


def test_the_issue_example_gradient_with_respect_to_the_data() -> None:
    """``jax.grad(loss, argnums=1)``: the data's gradient, not zeros (it was)."""
    w = np.array([[1.0, 2.0], [0.5, -1.0]])
    data = np.array([[1.0, 0.0], [0.0, 1.0]])
    want = jax.grad(m.wrt_loss, argnums=1)(w, data)
    assert np.any(np.asarray(want) != 0)
    near(dxserve.gradient(m.wrt_loss, "auto", w, data, wrt=1), want, EXACT)
    near(
        dxserve.gradient(m.wrt_loss, "auto", w, data, wrt=(0, 1)),
        jax.grad(m.wrt_loss, argnums=(0, 1))(w, data),
        EXACT,
    )


@pytest.mark.parametrize(
    "backend, rtol",
    [
        ("jax-reverse", EXACT),
        ("jax-forward", EXACT),
        ("auto", EXACT),
        ("finite-differences", FD),
    ],
)
@pytest.mark.parametrize("wrt", [1, (0,), (1, 0)], ids=str)
def test_scalar_operators(backend: str, rtol: float, wrt) -> None:
    f, args = m.wrt_loss, (W, DATA)
    near(dxserve.gradient(f, backend, *args, wrt=wrt), jax.grad(f, wrt)(*args), rtol)
    y, g = dxserve.value_and_gradient(f, backend, *args, wrt=wrt)
    near((y, g), jax.value_and_grad(f, wrt)(*args), rtol)
    hessian_backend = (
        "auto"
        if backend == "auto"
        else dxserve.SecondOrder(
            dxserve.backend_from_json(backend), dxserve.backend_from_json(backend)
        )
    )
    near(
        dxserve.hessian(f, hessian_backend, *args, wrt=wrt),
        jax.hessian(f, wrt)(*args),
        rtol if backend != "finite-differences" else 1e-5,
    )
    t = jax.tree.map(lambda a: RNG.normal(size=np.shape(a)), jax.grad(f, wrt)(*args))
    (hv,) = dxserve.hvp(f, "auto", *args[:1], (t,), *args[1:], wrt=wrt)
    _, want = jax.jvp(
        lambda *a: jax.grad(f, wrt)(*_merged(a, args, wrt)),
        _chosen(args, wrt),
        _tangent_tuple(t, wrt),
    )
    near(hv, want, EXACT)


def _chosen(args: tuple, wrt) -> tuple:
    return (args[wrt],) if isinstance(wrt, int) else tuple(args[k] for k in wrt)


def _tangent_tuple(t, wrt) -> tuple:
    return (t,) if isinstance(wrt, int) else tuple(t)


def _merged(chosen: tuple, args: tuple, wrt) -> list:
    out = list(args)
    for k, v in zip((wrt,) if isinstance(wrt, int) else wrt, chosen, strict=True):
        out[k] = v
    return out


@pytest.mark.parametrize(
    "backend, rtol",
    [
        ("jax-reverse", EXACT),
        ("jax-forward", EXACT),
        ("finite-differences", FD),
    ],
)
@pytest.mark.parametrize("wrt", [2, (0, 1, 2), (2, 0)], ids=str)
def test_array_operators(backend: str, rtol: float, wrt) -> None:
    f, args = m.wrt_layer, (W, DATA, SCALE)
    near(dxserve.jacobian(f, backend, *args, wrt=wrt), jax.jacrev(f, wrt)(*args), rtol)
    chosen = _chosen(args, wrt)
    t = tuple(RNG.normal(size=np.shape(a)) for a in chosen)
    t1 = t[0] if isinstance(wrt, int) else t
    (push,) = dxserve.pushforward(f, backend, W, (t1,), DATA, SCALE, wrt=wrt)
    _, want = jax.jvp(lambda *a: f(*_merged(a, args, wrt)), chosen, t)
    near(push, want, rtol)
    c = RNG.normal(size=np.shape(want))
    (pull,) = dxserve.pullback(f, backend, W, (c,), DATA, SCALE, wrt=wrt)
    _, vjp = jax.vjp(lambda *a: f(*_merged(a, args, wrt)), *chosen)
    near(pull, vjp(c)[0] if isinstance(wrt, int) else vjp(c), rtol)


def test_derivative_of_a_scalar_context() -> None:
    near(
        dxserve.derivative(m.wrt_layer, "auto", W, DATA, SCALE, wrt=2),
        jax.jacfwd(m.wrt_layer, 2)(W, DATA, SCALE),
        EXACT,
    )


def test_batch_axis_applies_to_the_arguments_named() -> None:
    datas = np.stack([DATA, 2 * DATA, -DATA])
    got = dxserve.gradient(m.wrt_loss, "auto", W, datas, wrt=1, batch_axis=0)
    near(got, jax.vmap(jax.grad(m.wrt_loss, 1), (None, 0))(W, datas), EXACT)


def test_nested_under_jax_grad_moving_a_context() -> None:
    """An operator inside jax.grad whose context moves: its derivative there, exact."""

    def outer(d):
        return jnp.sum(dxserve.gradient(m.wrt_loss, "jax-reverse", W, d) ** 2)

    def ref(d):
        return jnp.sum(jax.grad(m.wrt_loss)(W, d) ** 2)

    near(jax.grad(outer)(DATA), jax.grad(ref)(DATA), EXACT)
    # and a backend that does not trace: the gradient's mixed block, one HVP over both
    fd = dxserve.FiniteDifferences()
    near(
        jax.grad(lambda d: jnp.sum(dxserve.gradient(m.wrt_loss, fd, W, d) ** 2))(DATA),
        jax.grad(ref)(DATA),
        1e-5,
    )


def np_loss(w, data):
    return float(np.sum((np.asarray(data) @ np.asarray(w)) ** 2))


def np_layer(w, data, scale):
    return np.tanh(np.asarray(data) @ np.asarray(w)) * np.asarray(scale)


@pytest.mark.parametrize(
    "piece, backend, rtol",
    [
        (m.wrt_loss, "jax-reverse", EXACT),
        (np_loss, "finite-differences", FD),
    ],
    ids=["jax", "numpy-fd"],
)
@pytest.mark.parametrize("argnums", [1, (0, 1)], ids=str)
def test_differentiate_with_argnums_scalar(piece, backend: str, rtol: float, argnums) -> None:
    g = DifferentiateWith(piece, backend)
    near(jax.grad(g, argnums)(W, DATA), jax.grad(m.wrt_loss, argnums)(W, DATA), rtol)
    near(
        jax.hessian(g, argnums)(W, DATA),
        jax.hessian(m.wrt_loss, argnums)(W, DATA),
        rtol if rtol == EXACT else 1e-5,
    )
    datas = np.stack([DATA, 2 * DATA])
    near(
        jax.vmap(jax.grad(g, argnums), (None, 0))(W, datas),
        jax.vmap(jax.grad(m.wrt_loss, argnums), (None, 0))(W, datas),
        rtol,
    )
    near(jax.jit(jax.grad(g, argnums))(W, DATA), jax.grad(m.wrt_loss, argnums)(W, DATA), rtol)


@pytest.mark.parametrize(
    "piece, backend, rtol",
    [
        (m.wrt_layer, "jax-reverse", EXACT),
        (np_layer, "finite-differences", FD),
    ],
    ids=["jax", "numpy-fd"],
)
@pytest.mark.parametrize("argnums", [1, (0, 1, 2)], ids=str)
def test_differentiate_with_argnums_array(piece, backend: str, rtol: float, argnums) -> None:
    g = DifferentiateWith(piece, backend)
    for transform in (jax.jacrev, jax.jacfwd):
        near(
            transform(g, argnums)(W, DATA, SCALE),
            transform(m.wrt_layer, argnums)(W, DATA, SCALE),
            rtol,
        )


def test_cotangent_hvp_is_the_derivative_of_the_pullback() -> None:
    c = RNG.normal(size=(3, 2))
    s = RNG.normal(size=W.shape)

    def pullback_of(w):
        return jax.vjp(lambda u: m.wrt_layer(u, DATA, SCALE), w)[1](c)[0]

    _, want = jax.jvp(pullback_of, (W,), (s,))
    (got,) = dxserve.hvp(m.wrt_layer, "auto", W, (s,), DATA, SCALE, cotangent=c)
    near(got, want, EXACT)
    grad, (got,) = dxserve.gradient_and_hvp(m.wrt_layer, "auto", W, (s,), DATA, SCALE, cotangent=c)
    near(grad, pullback_of(W), EXACT)
    with pytest.raises(InvalidArgumentError, match="cotangent") as info:
        dxserve.hvp(m.wrt_layer, "auto", W, (s,), DATA, SCALE, cotangent=np.ones(3))
    assert info.value.field == "cotangent"


def test_what_cannot_be_differentiated_is_refused_naming_it() -> None:
    x = np.arange(3.0)
    with pytest.raises(DtypeMismatchError, match=r"contexts\[0\].*int64") as info:
        dxserve.gradient(m.wrt_power, "auto", x, np.asarray(3), wrt=1)
    assert info.value.field == "wrt"
    with pytest.raises(DtypeMismatchError, match=r"contexts\[1\].*key") as info:
        dxserve.gradient(m.wrt_noisy, "auto", W, DATA, jax.random.key(0), wrt=(0, 2))
    assert info.value.field == "wrt[1]"
    with pytest.raises(InvalidArgumentError, match="names no argument") as info:
        dxserve.gradient(m.wrt_loss, "auto", W, DATA, wrt=2)
    assert info.value.field == "wrt"
    for bad in (-1, (0, 0), (), "1", 1.0, True):
        with pytest.raises(InvalidArgumentError):
            dxserve.gradient(m.wrt_loss, "auto", W, DATA, wrt=bad)


def test_a_prep_made_with_wrt_is_used_with_it() -> None:
    prep = dxserve.prepare_gradient(m.wrt_loss, "auto", W, DATA, wrt=1)
    near(
        dxserve.gradient(m.wrt_loss, "auto", W, DATA, prep=prep, wrt=1),
        jax.grad(m.wrt_loss, 1)(W, DATA),
        EXACT,
    )
    with pytest.raises(PreparationMismatchError, match="wrt=1") as info:
        dxserve.gradient(m.wrt_loss, "auto", W, DATA, prep=prep)
    assert info.value.field == "wrt"
