"""Functions ``operators_vs_jit.py`` times beside the examples, served by name too
(``--functions dxserve.examples --functions jit_functions``, from ``bench/``).

``ode_loss`` and ``ode_state`` solve a damped, coupled oscillator with an adaptive
Bogacki–Shampine (RK23) integrator in a ``lax.while_loop``, as diffrax does: steps
accepted or rejected by an error estimate until ``t1`` (or ``max_steps``). JAX's reverse
mode cannot go through the loop, so ``auto`` takes forward mode for them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import dxserve

#: oscillators in the ODE (its state holds their positions and velocities)
ODE_SIZE = 16
#: parameters: one damping rate per oscillator
ODE_PARAMS = np.linspace(0.1, 0.4, ODE_SIZE)


def mlp_loss(params, X):
    """Mean squared output of a one-hidden-layer tanh network (dict parameters)."""
    h = jnp.tanh(X @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"]) ** 2)


@dxserve.function(description="sin(3t) exp(-t²/10), R -> R", example=(np.float64(0.7),))
def scalar_curve(t):
    return jnp.sin(3.0 * t) * jnp.exp(-0.1 * t * t)


def _field(damping: jax.Array, state: jax.Array) -> jax.Array:
    """d/dt of (q, p): unit masses on a ring of springs, damped by ``damping``."""
    q, p = jnp.split(state, 2)
    coupling = jnp.roll(q, 1) + jnp.roll(q, -1) - 2.0 * q
    return jnp.concatenate([p, -q + 0.5 * coupling - damping * p + 0.1 * jnp.sin(q)])


def solve(
    damping: jax.Array,
    t1: float = 10.0,
    rtol: float = 1e-6,
    atol: float = 1e-8,
    max_steps: int = 4096,
) -> jax.Array:
    """The state at ``t1`` from a fixed start, by adaptive RK23 (Bogacki–Shampine with
    its embedded error estimate and a PI-free step controller) in a ``lax.while_loop``."""
    y0 = jnp.concatenate(
        [jnp.sin(jnp.arange(ODE_SIZE, dtype=damping.dtype)), jnp.zeros(ODE_SIZE, damping.dtype)]
    )

    def step(carry):
        t, y, h, k1, n = carry
        h = jnp.minimum(h, t1 - t)
        k2 = _field(damping, y + 0.5 * h * k1)
        k3 = _field(damping, y + 0.75 * h * k2)
        y_new = y + h * (2.0 * k1 + 3.0 * k2 + 4.0 * k3) / 9.0
        k4 = _field(damping, y_new)
        err = h * (-5.0 * k1 / 72.0 + k2 / 12.0 + k3 / 9.0 - k4 / 8.0)
        scale = atol + rtol * jnp.maximum(jnp.abs(y), jnp.abs(y_new))
        ratio = jnp.sqrt(jnp.mean((err / scale) ** 2))
        accept = ratio <= 1.0
        factor = jnp.clip(0.9 * (1.0 / jnp.maximum(ratio, 1e-10)) ** (1.0 / 3.0), 0.2, 5.0)
        return (
            jnp.where(accept, t + h, t),
            jnp.where(accept, y_new, y),
            h * factor,
            jnp.where(accept, k4, k1),
            n + 1,
        )

    def going(carry):
        t, _, _, _, n = carry
        return (t < t1) & (n < max_steps)

    start = (
        jnp.zeros((), damping.dtype),
        y0,
        jnp.asarray(0.01, damping.dtype),
        _field(damping, y0),
        0,
    )
    _, y, _, _, _ = lax.while_loop(going, step, start)
    return y


@dxserve.function(
    description="ODE fit loss: adaptive RK23 in a while_loop, R^16 -> R", example=(ODE_PARAMS,)
)
def ode_loss(damping):
    y = solve(damping)
    return jnp.sum((y - 0.1) ** 2)


@dxserve.function(
    description="ODE final state: adaptive RK23 in a while_loop, R^16 -> R^32",
    example=(ODE_PARAMS,),
)
def ode_state(damping):
    return solve(damping)
