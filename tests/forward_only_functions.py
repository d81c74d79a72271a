"""Forward-mode-only functions for ``tests/library/test_forward_only.py`` (and its
server): a cube root by Newton's method in a ``lax.while_loop``, which JAX's reverse
mode refuses, so only forward mode (and pullbacks from basis pushforwards) serves it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import dxserve


@dxserve.function
def cbrt(x):
    """x^(1/3) elementwise (x > 0), by 40 Newton steps in a while_loop."""

    def body(s):
        y, i = s
        return y - (y**3 - x) / (3 * y**2), i + 1

    y, _ = jax.lax.while_loop(lambda s: s[1] < 40, body, (jnp.ones_like(x), 0))
    return y


@dxserve.function
def cbrt_energy(x):
    """sum(cbrt(x)^2): gradient (2/3) x^(-1/3), Hessian diag(-(2/9) x^(-4/3))."""
    return jnp.sum(cbrt(x) ** 2)
