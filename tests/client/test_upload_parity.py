"""Uploads on par with module functions: complex and bfloat16 x, typed PRNG key
contexts, through ``client.register`` and a real server.

``client.register`` refused complex x and bfloat16 x ("must be real floating point")
and failed on a key context ("Cannot interpret 'key<fry>' as a data type"). Each answer
is checked against JAX's own transformation of the same function in float64 / complex128
(rtol 1e-10), or exactly where the arithmetic is exact (bfloat16).
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dxclient import Client
from dxcontract.errors import UnsupportedOperatorError
from tests.conftest import ServerProcess, start_server, stop_server

jax.config.update("jax_enable_x64", True)

Z = np.array([1 + 2j, -0.5 + 0.3j, 0.25 - 0.8j])
T = np.array([0.3 - 0.7j, 1.1 + 0.4j, -0.2 + 0.9j])
RTOL = 1e-10


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("uploads"), modules=("dxserve.examples",))
    try:
        yield server
    finally:
        stop_server(server)


def energy(z):  # real-valued, not holomorphic
    return jnp.sum(jnp.abs(z) ** 4 + jnp.real(z) * jnp.imag(z) ** 2)


def holo(z):
    return z**2 * jnp.sin(z)


def test_complex_x(srv: ServerProcess) -> None:
    with Client(srv.url) as client:
        f = client.register(energy, Z, name="up_complex_energy", replace=True)
        g = client.gradient(f, "auto", Z)
        assert g.dtype == np.complex128
        np.testing.assert_allclose(g, jax.grad(energy)(Z), rtol=RTOL)
        (hv,) = client.hvp(f, "auto", Z, (T,))
        np.testing.assert_allclose(hv, jax.jvp(jax.grad(energy), (Z,), (T,))[1], rtol=RTOL)
        with pytest.raises(UnsupportedOperatorError) as info:  # as jax.hessian refuses it
            client.hessian(f, "auto", Z)
        assert info.value.field == "holomorphic"
        h = client.register(holo, Z, name="up_complex_holo", replace=True)
        jac = client.jacobian(h, "auto", Z, holomorphic=True)
        np.testing.assert_allclose(jac, jax.jacfwd(holo, holomorphic=True)(Z), rtol=RTOL)
        (pushed,) = client.pushforward(h, "auto", Z, (T,))
        np.testing.assert_allclose(np.asarray(jac) @ T, pushed, rtol=RTOL)
        (pulled,) = client.pullback(h, "auto", Z, (T,))
        np.testing.assert_allclose(pulled, jax.vjp(holo, Z)[1](T)[0], rtol=RTOL)


def test_bfloat16_x(srv: ServerProcess) -> None:
    x = np.array([1.0, -2.0, 0.5], dtype=ml_dtypes.bfloat16)

    def sq(x):
        return jnp.sum(x * x)

    with Client(srv.url) as client:
        f = client.register(sq, x, name="up_bf16_sq", replace=True)
        g = client.gradient(f, "jax-reverse", x)
    assert g.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(g.astype(np.float64), 2 * x.astype(np.float64))  # exact


def test_a_key_context(srv: ServerProcess) -> None:
    key = jax.random.key(7)
    x = np.array([1.0, 2.0, -0.5])

    def noisy(x, k):
        return jnp.sum(jnp.sin(x) * jax.random.normal(k, x.shape))

    with Client(srv.url) as client:
        f = client.register(noisy, x, key, name="up_key_noisy", replace=True)
        g = client.gradient(f, "auto", x, key)
        other = client.gradient(f, "auto", x, jax.random.key(8))
    np.testing.assert_allclose(g, jax.grad(noisy)(x, key), rtol=RTOL)
    np.testing.assert_allclose(other, jax.grad(noisy)(x, jax.random.key(8)), rtol=RTOL)


def test_has_aux_with_integer_aux(srv: ServerProcess) -> None:
    """Integer outputs (a has_aux function's counts) are carried along, not
    differentiated: the derivative maps cover the floating-point outputs."""
    x = np.array([0.3, -1.2, 2.0])

    def loss(x):
        return jnp.sum(jnp.sin(x) * x**2), {"count": jnp.sum(x > 0), "scaled": 2 * x}

    with Client(srv.url) as client:
        f = client.register(loss, x, name="up_aux_int", replace=True)
        g, aux = client.gradient(f, "auto", x, has_aux=True)
        want_g, want_aux = jax.grad(loss, has_aux=True)(x)
        np.testing.assert_allclose(g, want_g, rtol=RTOL)
        assert int(aux["count"]) == 2 and np.issubdtype(np.asarray(aux["count"]).dtype, np.integer)
        np.testing.assert_allclose(aux["scaled"], want_aux["scaled"], rtol=RTOL)
        (v, aux2), g2 = client.value_and_gradient(f, "jax-forward", x, has_aux=True)
        np.testing.assert_allclose(g2, want_g, rtol=RTOL)
        assert int(aux2["count"]) == 2
        h, _ = client.hessian(f, "auto", x, has_aux=True)
        np.testing.assert_allclose(h, jax.hessian(lambda u: loss(u)[0])(x), rtol=RTOL)
        (hv,), _ = client.hvp(f, "auto", x, (x,), has_aux=True)
        np.testing.assert_allclose(hv, jax.hessian(lambda u: loss(u)[0])(x) @ x, rtol=RTOL)
