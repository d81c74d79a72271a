"""Functions of custom pytree nodes (``NamedTuple``s, registered dataclasses) for the
server of ``tests/library/test_custom_nodes.py``: a Lux-style layer ``Layer(weight,
bias)`` read by attribute, in x and in contexts."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

import dxserve


class Layer(NamedTuple):
    weight: jax.Array
    bias: jax.Array


@dxserve.function
def layer_loss(p, data):
    """sum((data @ p.weight + p.bias)^2) + |p.weight|^4 / 10: p a node with fields weight, bias."""
    return jnp.sum((data @ p.weight + p.bias) ** 2) + 0.1 * jnp.sum(p.weight**2) ** 2


@dxserve.function
def layer_out(p, data):
    """tanh(data @ p.weight + p.bias): a vector of p."""
    return jnp.tanh(data @ p.weight + p.bias).ravel()


@dxserve.function
def through_layer(w, p):
    """sum(tanh(w @ p.weight + p.bias)^2) + sum(w^4): the layer is a context."""
    return jnp.sum(jnp.tanh(w @ p.weight + p.bias) ** 2) + jnp.sum(w**4)


@dxserve.function
def layer_map(p):
    """Layer(weight=p.weight * p.bias, bias=sin(p.bias)): a node-valued function."""
    return type(p)(p.weight * p.bias, jnp.sin(p.bias))
