# ruff: noqa: F722, F821 (jaxtyping's shape strings are not forward references)
"""Module functions whose shapes are declared by annotations (jaxtyping's form), for
the tests of shapes enforced at the door."""

import jax.numpy as jnp
from jaxtyping import Array, Float

import dxserve


@dxserve.function(description="log-density of a normal, theta = (mean, scale)")
def logp(theta: Float[Array, "2"], data: Float[Array, "n"]) -> Float[Array, ""]:
    return -0.5 * jnp.sum((data - theta[0]) ** 2) / theta[1] ** 2 - data.size * jnp.log(theta[1])


@dxserve.function(description="W @ x with the sizes named: W is (m, n), x is (n,)")
def named_layer(x: Float[Array, "n"], W: Float[Array, "m n"]) -> Float[Array, "m"]:
    return jnp.tanh(W @ x)
