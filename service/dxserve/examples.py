"""Example functions registered by ``make serve`` (module ``dxserve.examples``).

Each has example arguments, so ``GET /functions/{name}`` shows its arguments' shapes
and dtypes and a request to try.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dxcontract.keys import KeyArray
from dxserve.core.functions import function

_X3 = np.array([1.0, 2.0, 3.0])


@function(
    description="extended Rosenbrock, R^n -> R: sum 100(x[i+1]-x[i]^2)^2 + (1-x[i])^2",
    example=(_X3,),
)
def rosenbrock(x):
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


@function(description="sum of squares, R^n -> R", example=(_X3,))
def sum_of_squares(x):
    return jnp.sum(x**2)


@function(description="elementwise, R^n -> R^n: sin(x) * cumsum(x)", example=(_X3,))
def sin_cumsum(x):
    return jnp.sin(x) * jnp.cumsum(x)


@function(
    description="one tanh layer, R^n -> R^m: tanh(W @ x); context W is (m, n)",
    example=(_X3, np.array([[0.1, 0.2, 0.3], [-0.3, 0.2, -0.1]])),
)
def tanh_layer(x, W):
    return jnp.tanh(W @ x)


@function(description="softmax, R^n -> R^n", example=(_X3,))
def softmax(x):
    return jax.nn.softmax(x)


@function(
    description="least squares loss of a linear model, pytree input "
    "{'w': (d, k), 'b': (k,)}; contexts X (N, d), Y (N, k)",
    example=(
        {"w": np.array([[0.5], [-0.5]]), "b": np.array([0.1])},
        np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]),
        np.array([[1.0], [0.0], [-1.0]]),
    ),
)
def least_squares(params, X, Y):
    residual = X @ params["w"] + params["b"] - Y
    return 0.5 * jnp.sum(residual**2) / X.shape[0]


@function(description="log-density of a standard normal, R^n -> R", example=(_X3,))
def normal_logpdf(x):
    return -0.5 * jnp.sum(x**2) - 0.5 * x.size * jnp.log(2 * jnp.pi)


#: bn_loss's variance floor, and how far its running statistics move toward a batch's
BN_EPS, BN_MOMENTUM = 1e-5, 0.1
_BN_RNG = np.random.default_rng(0)


@function(
    description="batch-normalized linear layer's squared error, Lux-style (ps, batch, st) -> "
    "(loss, new st): call with has_aux for the running mean and variance updated from the "
    "batch; ps {'w': (d, k), 'scale': (k,), 'shift': (k,)}, batch {'x': (N, d), 'y': (N, k)}, "
    "st {'mean': (k,), 'var': (k,)}",
    example=(
        {"w": _BN_RNG.normal(size=(3, 2)), "scale": np.ones(2), "shift": np.zeros(2)},
        {"x": _BN_RNG.normal(size=(4, 3)), "y": _BN_RNG.normal(size=(4, 2))},
        {"mean": np.zeros(2), "var": np.ones(2)},
    ),
)
def bn_loss(ps, batch, st):
    """Training-mode batch norm: normalized by the batch's own statistics; the running
    ones (st) move 10% toward them, returned as the new state beside the loss."""
    h = batch["x"] @ ps["w"]
    mean, var = jnp.mean(h, axis=0), jnp.var(h, axis=0)
    out = (h - mean) / jnp.sqrt(var + BN_EPS) * ps["scale"] + ps["shift"]
    loss = jnp.mean((out - batch["y"]) ** 2)
    new_st = {
        "mean": (1 - BN_MOMENTUM) * st["mean"] + BN_MOMENTUM * mean,
        "var": (1 - BN_MOMENTUM) * st["var"] + BN_MOMENTUM * var,
    }
    return loss, new_st


@function(
    description="noisy sum of squares, R^n -> R: sum x^2 (1 + 0.1 z), z ~ N(0, 1) drawn "
    "with the context key (a typed PRNG key: jax.random.key(0))",
    example=(_X3, KeyArray("threefry2x32", np.zeros(2, np.uint32))),  # jax.random.key(0)
)
def noisy(x, key):
    return jnp.sum(x**2 * (1.0 + 0.1 * jax.random.normal(key, x.shape, x.dtype)))
