"""Functions of typed PRNG keys for the key tests (``--functions tests.key_functions``).

``noisy`` itself is an example (``dxserve.examples``); these add a key array context,
a key in a pytree context and functions that return keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import dxserve


@dxserve.function(description="sum x^2 (1 + 0.1 z) with z drawn per key of a key array")
def noisy_keys(x, keys):
    z = jax.vmap(lambda k: jax.random.normal(k, x.shape, x.dtype))(keys)
    return jnp.sum(x**2 * (1.0 + 0.1 * jnp.mean(z, axis=0)))


@dxserve.function(description="noisy sum of squares, the key in a dict context")
def noisy_tree(x, state):
    return jnp.sum(
        x**2 * (1.0 + state["scale"] * jax.random.normal(state["key"], x.shape, x.dtype))
    )


@dxserve.function(description="(noisy sum of squares, the next key): a key in the output")
def noisy_step(x, key):
    key, sub = jax.random.split(key)
    return jnp.sum(x**2 * (1.0 + 0.1 * jax.random.normal(sub, x.shape, x.dtype))), key


@dxserve.function(description="the keys split from a key, (n,) keys, and x's sum")
def split_keys(x, key):
    return {"keys": jax.random.split(key, x.shape[0]), "total": jnp.sum(x)}


@dxserve.function(description="(x's sum, a key made from no key): a key only in the output")
def seeded(x):
    return jnp.sum(x), jax.random.key(7)
