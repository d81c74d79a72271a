"""Served functions whose derivatives take a while: scheduling tests and benches.

``heavy_sines`` costs ``ROUNDS`` sine sweeps over x per evaluation, so each basis
vector of its Hessian costs as much; its Hessian is diagonal and known in closed form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import dxserve

ROUNDS = 64
SCALES = 1.0 + np.arange(ROUNDS) / ROUNDS


@dxserve.function(
    description="sum over 64 scales c of sin(c x)^2, plus x^4 / 4, R^n -> R (a costly Hessian)"
)
def heavy_sines(x):
    def body(i, acc):
        c = 1.0 + i / ROUNDS
        return acc + jnp.sum(jnp.sin(c * x) ** 2)

    return jax.lax.fori_loop(0, ROUNDS, body, jnp.zeros((), x.dtype)) + 0.25 * jnp.sum(x**4)


def heavy_sines_hessian(x: np.ndarray) -> np.ndarray:
    """The exact Hessian: diagonal, 2 c^2 cos(2 c x) summed over the scales, plus 3 x^2."""
    diagonal = (2 * SCALES[:, None] ** 2 * np.cos(2 * SCALES[:, None] * x[None, :])).sum(0)
    return np.diag(diagonal + 3 * x**2)
