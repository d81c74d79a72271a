"""Functions one of JAX's modes cannot transform, for the tests of ``Auto``'s fallbacks.

``cbrt_sum`` and ``cbrt_pair`` iterate Newton's method for ∛x in a ``lax.while_loop``
until it converges: forward mode differentiates them, reverse mode does not trace
(JAX cannot transpose a loop of unknown length). ``callback_cbrt_sum`` calls numpy
through ``jax.pure_callback`` without a JVP rule: neither mode traces, finite
differences do. ``cube_sum_vjp`` is a ``jax.custom_vjp`` function: reverse mode only.

A server serves them with ``--functions tests.trace_functions``; the references are
analytic (``tests.references``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import dxserve

X = np.array([0.5, 2.0, 8.0])


def newton_cbrt(a: jax.Array) -> jax.Array:
    """∛a for a > 0, elementwise: Newton's iteration from a until it stops moving."""

    def moving(state):
        i, y, previous = state
        return (i < 200) & jnp.any(jnp.abs(y - previous) > 1e-14 * jnp.abs(y))

    def step(state):
        i, y, _ = state
        return i + 1, y - (y**3 - a) / (3.0 * y**2), y

    _, y, _ = lax.while_loop(moving, step, (0, a, a + 1.0))
    return y


def newton_sqrt(a: jax.Array) -> jax.Array:
    """√a for a > 0, elementwise: Heron's iteration from a until it stops moving."""

    def moving(state):
        i, y, previous = state
        return (i < 200) & jnp.any(jnp.abs(y - previous) > 1e-14 * jnp.abs(y))

    def step(state):
        i, y, _ = state
        return i + 1, 0.5 * (y + a / y), y

    _, y, _ = lax.while_loop(moving, step, (0, a, a + 1.0))
    return y


@dxserve.function(description="Σ ∛xᵢ by Newton in a while_loop", example=(X,))
def cbrt_sum(x: jax.Array) -> jax.Array:
    return jnp.sum(newton_cbrt(x))


@dxserve.function(description="(Σ ∛xᵢ, Σ xᵢ ∛xᵢ) by Newton in a while_loop", example=(X,))
def cbrt_pair(x: jax.Array) -> jax.Array:
    c = newton_cbrt(x)
    return jnp.stack([jnp.sum(c), jnp.sum(x * c)])


@dxserve.function(description="Σ ∛xᵢ by numpy through pure_callback", example=(X,))
def callback_cbrt_sum(x: jax.Array) -> jax.Array:
    c = jax.pure_callback(
        np.cbrt, jax.ShapeDtypeStruct(x.shape, x.dtype), x, vmap_method="sequential"
    )
    return jnp.sum(c)


@jax.custom_vjp
def cube_sum_vjp(x: jax.Array) -> jax.Array:
    return jnp.sum(x**3)


def _cube_fwd(x):
    return jnp.sum(x**3), x


def _cube_bwd(x, ct):
    return (3.0 * x**2 * ct,)


cube_sum_vjp.defvjp(_cube_fwd, _cube_bwd)
