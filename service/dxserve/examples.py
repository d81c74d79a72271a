"""Example functions registered by ``make serve`` (module ``dxserve.examples``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .functions import function


@function(description="extended Rosenbrock, R^n -> R: sum 100(x[i+1]-x[i]^2)^2 + (1-x[i])^2")
def rosenbrock(x):
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


@function(description="sum of squares, R^n -> R")
def sum_of_squares(x):
    return jnp.sum(x**2)


@function(description="elementwise, R^n -> R^n: sin(x) * cumsum(x)")
def sin_cumsum(x):
    return jnp.sin(x) * jnp.cumsum(x)


@function(description="one tanh layer, R^n -> R^m: tanh(W @ x); context W is (m, n)")
def tanh_layer(x, W):
    return jnp.tanh(W @ x)


@function(description="softmax, R^n -> R^n")
def softmax(x):
    return jax.nn.softmax(x)


@function(
    description="least squares loss of a linear model, pytree input "
    "{'w': (d, k), 'b': (k,)}; contexts X (N, d), Y (N, k)"
)
def least_squares(params, X, Y):
    residual = X @ params["w"] + params["b"] - Y
    return 0.5 * jnp.sum(residual**2) / X.shape[0]


@function(description="log-density of a standard normal, R^n -> R")
def normal_logpdf(x):
    return -0.5 * jnp.sum(x**2) - 0.5 * x.size * jnp.log(2 * jnp.pi)
