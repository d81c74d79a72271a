"""Forward-only pieces, as DifferentiationInterface serves them.

``cbrt`` runs Newton's method in a ``lax.while_loop``: JAX's reverse mode refuses it.
A forward-mode backend still answers every operator exactly: ``pullback`` (and so
reverse-mode Jacobians, the inner gradient of second order) from the pushforwards of
x's basis, ``J^T c``. ``dxserve.pullback(cbrt, "jax-forward")`` and ``hvp``/``hessian``
with ``"jax-forward"`` were refused, and ``DifferentiateWith(cbrt, "jax-forward")`` failed
under ``jax.grad`` and ``jax.hessian`` with JAX's reverse-mode error. References are
analytic, float64, rtol 1e-10.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dxserve
from dxclient import Client
from dxserve import DifferentiateWith, JaxForward, SecondOrder
from tests.conftest import ServerProcess, start_server, stop_server
from tests.forward_only_functions import cbrt, cbrt_energy

jax.config.update("jax_enable_x64", True)

X = np.array([2.0, 3.0, 5.0, 0.7])
C = np.array([1.0, -2.0, 0.5, 3.0])
T = np.array([0.3, 1.0, -0.4, 2.0])
RTOL = 1e-10


def d_cbrt(x: np.ndarray) -> np.ndarray:
    return x ** (-2 / 3) / 3


def grad_energy(x: np.ndarray) -> np.ndarray:
    return (2 / 3) * x ** (-1 / 3)


def hess_energy(x: np.ndarray) -> np.ndarray:
    return np.diag(-(2 / 9) * x ** (-4 / 3))


def test_reverse_mode_refuses_the_piece() -> None:
    with pytest.raises(ValueError, match="Reverse-mode"):
        jax.grad(cbrt_energy)(X)


@pytest.mark.parametrize("backend", ["jax-forward", JaxForward(batch_size=2)], ids=str)
def test_a_forward_backend_answers_every_operator(backend: object) -> None:
    (pulled,) = dxserve.pullback(cbrt, backend, X, (C,))
    np.testing.assert_allclose(pulled, C * d_cbrt(X), rtol=RTOL)
    y, pulled = dxserve.value_and_pullback(cbrt, backend, X, (C, 2 * C))
    np.testing.assert_allclose(y, np.cbrt(X), rtol=RTOL)
    np.testing.assert_allclose(pulled[1], 2 * C * d_cbrt(X), rtol=RTOL)
    np.testing.assert_allclose(dxserve.gradient(cbrt_energy, backend, X), grad_energy(X), rtol=RTOL)
    np.testing.assert_allclose(dxserve.jacobian(cbrt, backend, X), np.diag(d_cbrt(X)), rtol=RTOL)
    (hv,) = dxserve.hvp(cbrt_energy, backend, X, (T,))
    np.testing.assert_allclose(hv, hess_energy(X) @ T, rtol=RTOL)
    np.testing.assert_allclose(dxserve.hessian(cbrt_energy, backend, X), hess_energy(X), rtol=RTOL)


def test_forward_over_reverse_stays_where_reverse_mode_traces() -> None:
    """The basis fallback is for pieces reverse mode refuses: elsewhere "jax-forward" is
    still forward-over-reverse for second order (one VJP per HVP, not n JVPs)."""
    prep = dxserve.prepare_hvp(lambda u: jnp.sum(u**3), "jax-forward", X, (T,))
    assert prep.resolved == SecondOrder(JaxForward(), dxserve.JaxReverse())
    prep = dxserve.prepare_hvp(cbrt_energy, "jax-forward", X, (T,))
    assert prep.resolved == SecondOrder(JaxForward(), JaxForward())


def test_differentiate_with_a_forward_piece_under_grad_and_hessian() -> None:
    piece = DifferentiateWith(cbrt, "jax-forward")

    def loss(x):  # a vector piece inside a JAX program
        return jnp.sum(piece(x) ** 2) + jnp.sum(jnp.sin(x))

    want_grad = grad_energy(X) + np.cos(X)
    want_hess = hess_energy(X) - np.diag(np.sin(X))
    np.testing.assert_allclose(jax.grad(loss)(X), want_grad, rtol=RTOL)
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(X), want_grad, rtol=RTOL)
    np.testing.assert_allclose(jax.hessian(loss)(X), want_hess, rtol=RTOL)
    np.testing.assert_allclose(jax.jacrev(piece)(X), np.diag(d_cbrt(X)), rtol=RTOL)
    np.testing.assert_allclose(jax.jvp(piece, (X,), (T,))[1], d_cbrt(X) * T, rtol=RTOL)
    scalar = DifferentiateWith(cbrt_energy, "jax-forward")  # a scalar piece, one backend
    np.testing.assert_allclose(jax.hessian(scalar)(X), hess_energy(X), rtol=RTOL)
    np.testing.assert_allclose(jax.grad(scalar)(X), grad_energy(X), rtol=RTOL)


# --- over HTTP ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("fwd"), modules=("tests.forward_only_functions",))
    try:
        yield server
    finally:
        stop_server(server)


def test_a_forward_backend_over_http(srv: ServerProcess) -> None:
    with Client(srv.url) as client:
        (pulled,) = client.pullback("cbrt", "jax-forward", X, (C,))
        np.testing.assert_allclose(pulled, C * d_cbrt(X), rtol=RTOL)
        (hv,) = client.hvp("cbrt_energy", "jax-forward", X, (T,))
        np.testing.assert_allclose(hv, hess_energy(X) @ T, rtol=RTOL)
        np.testing.assert_allclose(client.hessian("cbrt_energy", "jax-forward", X),
                                   hess_energy(X), rtol=RTOL)
