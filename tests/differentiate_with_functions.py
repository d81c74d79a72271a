"""A JAX loss around a numpy step, the step differentiated by finite differences.

``np_step`` is a black box to JAX (numpy, SciPy-style code); ``jnp_step`` is the same
maths in ``jax.numpy``, the reference. ``loss`` wraps either in a JAX body; the served
functions (``--functions tests.differentiate_with_functions``) are that loss with the
numpy step behind ``DifferentiateWith(np_step, FiniteDifferences())`` and the all-JAX
loss, so a server differentiates the first with ``jax-reverse`` or ``auto`` through the
step's finite differences.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

import dxserve

A = np.array([[1.0, 0.5, 0.0, -0.2], [0.2, -1.0, 0.3, 0.1], [0.0, 0.4, 2.0, -0.3]])
X = np.array([0.3, -0.7, 1.1, 0.45])
DATA = np.array([0.5, -1.0, 2.0])

#: calls of the numpy step, with the shape of x each saw (a black box sees one point)
CALLS: list[tuple[int, ...]] = []


def np_step(x: np.ndarray) -> np.ndarray:
    """R^4 -> R^3 in plain numpy (JAX cannot trace it)."""
    x = np.asarray(x)
    CALLS.append(x.shape)
    return np.tanh(A @ x) + 0.1 * x[:3] ** 2


def jnp_step(x):
    return jnp.tanh(A @ x) + 0.1 * x[:3] ** 2


def loss(step: Callable) -> Callable:
    """A JAX body around ``step``: nonlinear in its output and in x beside it."""

    def f(x):
        y = step(x)
        return jnp.sum(jnp.sin(y - DATA) ** 2) + jnp.sum(x[:3] ** 2 * y) + 0.5 * jnp.sum(x**4)

    return f


STEP = dxserve.DifferentiateWith(np_step, dxserve.FiniteDifferences())


@dxserve.function(
    description="a JAX loss whose numpy step is differentiated by finite differences",
    example=(X,),
)
def loss_with_numpy_step(x):
    return loss(STEP)(x)


@dxserve.function(description="the same loss in JAX alone", example=(X,))
def loss_all_jax(x):
    return loss(jnp_step)(x)


def np_step_with_a_domain(x: np.ndarray) -> np.ndarray:
    """``np_step`` that refuses x[0] > 5 (as a solver might refuse to converge)."""
    if float(np.asarray(x)[0]) > 5:
        raise ValueError("x[0] must be at most 5")
    return np_step(x)


@dxserve.function(description="the loss around a step that refuses x[0] > 5", example=(X,))
def loss_with_a_domain(x):
    return loss(dxserve.DifferentiateWith(np_step_with_a_domain, "finite-differences"))(x)
