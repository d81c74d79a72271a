"""Functions of complex numbers for the servers of ``tests/client/test_complex_client.py``
(``--functions tests.complex_functions``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import dxserve

EXAMPLE = np.array([1 + 2j, -0.5 + 0.3j])


@dxserve.function(description="|z|^2 + Re z Im z, summed: real-valued, not holomorphic", example=(EXAMPLE,))
def abs2_plus_re_im(z):
    return jnp.sum(jnp.abs(z) ** 2 + jnp.real(z) * jnp.imag(z))


@dxserve.function(description="z^2 sin(z), elementwise: holomorphic", example=(EXAMPLE,))
def z2_sin(z):
    return z**2 * jnp.sin(z)


@dxserve.function(description="Σ exp(i x): complex-valued, of real x", example=(np.zeros(3),))
def phase_sum(x):
    return jnp.sum(jnp.exp(1j * x))


@dxserve.function(description="z conj(z)^2, elementwise: complex-valued, not holomorphic",
                  example=(EXAMPLE,))
def z_conj_z2(z):
    return z * jnp.conj(z) ** 2
