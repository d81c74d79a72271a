"""Functions of several differentiable arguments for the ``wrt`` / ``argnums`` tests
(``--functions tests.wrt_functions``): a least-squares loss of weights and data, an
array-valued layer, one with a typed PRNG key context and one with an integer context.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import dxserve


@dxserve.function(description="sum((data @ w)^2): a loss of the weights and the data")
def wrt_loss(w, data):
    return jnp.sum((data @ w) ** 2)


@dxserve.function(description="tanh(data @ w) * scale: array-valued in three arguments")
def wrt_layer(w, data, scale):
    return jnp.tanh(data @ w) * scale


@dxserve.function(description="sum((data @ w)^2 (1 + 0.1 z)), z drawn from a key context")
def wrt_noisy(w, data, key):
    z = jax.random.normal(key, (data.shape[0], w.shape[1]), w.dtype)
    return jnp.sum((data @ w) ** 2 * (1.0 + 0.1 * z))


@dxserve.function(description="sum(x^power): an integer context")
def wrt_power(x, power):
    return jnp.sum(x**power)
