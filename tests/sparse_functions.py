"""Functions with known sparse Jacobians and Hessians, registered with ``@dxserve.function``
(``Settings(functions=["tests.sparse_functions"])``) for the sparse tests and the bench.

Each maps a flat ``x`` of float64 (n,) to a flat ``y`` (Jacobian patterns) or a scalar
(Hessian patterns); ``PATTERNS`` lists them with an input size and, for the Hessian
ones, their contexts.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import dxserve


@dxserve.function(description="tridiagonal: y_i = x_{i-1} - 2 x_i^2 + sin(x_{i+1})")
def sp_tridiagonal(x):
    y = -2.0 * x**2
    y = y.at[1:].add(x[:-1])
    return y.at[:-1].add(jnp.sin(x[1:]))


@dxserve.function(description="banded, bandwidth 5 (|i - j| <= 2): y_i = sum_d (d+3) tanh(x_{i+d})")
def sp_banded(x):
    y = jnp.zeros_like(x)
    n = x.shape[0]
    for d in range(-2, 3):
        lo, hi = max(0, -d), min(n, n - d)
        y = y.at[lo:hi].add((d + 3) * jnp.tanh(x[lo + d : hi + d]))
    return y * (1.0 + x**2)


@dxserve.function(description="arrow-head: a dense first row and column plus the diagonal")
def sp_arrowhead(x):
    head = jnp.sum(x**2)[None]
    rest = x[1:] ** 3 + x[0] * x[1:]
    return jnp.concatenate([head, rest])


_BLOCK = np.array([[2.0, -1.0, 0.5, 0.0], [1.0, 3.0, 0.0, -0.5], [0.0, 0.5, 1.0, 1.0],
                   [-1.0, 0.0, 2.0, 1.0]])  # fmt: skip


@dxserve.function(description="block-diagonal: tanh(A x_b) on blocks of 4")
def sp_block_diagonal(x):
    blocks = jnp.reshape(x, (-1, 4))
    return jnp.reshape(jnp.tanh(blocks @ _BLOCK.T), (-1,))


@dxserve.function(description="2-D 5-point Laplacian on a k x k grid (n = k^2) plus u^3")
def sp_laplacian_2d(x):
    k = int(round(x.shape[0] ** 0.5))
    u = jnp.reshape(x, (k, k))
    p = jnp.pad(u, 1)
    lap = 4.0 * u - p[:-2, 1:-1] - p[2:, 1:-1] - p[1:-1, :-2] - p[1:-1, 2:]
    return jnp.reshape(lap + u**3, (-1,))


@dxserve.function(description="diagonal plus a dense row: y_i = d_i x_i^2, y_0 += sum sin(x)")
def sp_dense_row(x):
    d = jnp.arange(1.0, x.shape[0] + 1.0)
    y = d * x**2
    return y.at[0].add(jnp.sum(jnp.sin(x)))


@dxserve.function(description="sum x_i x_{i+1} + x_i^4 (tridiagonal Hessian)")
def sp_chain_quartic(x):
    return jnp.sum(x[:-1] * x[1:]) + jnp.sum(x**4)


@dxserve.function(description="Lagrangian f(x) + lam . c(x), c_j = x_j^2 + x_{j+1} - 1")
def sp_lagrangian(x, lam):
    return chain_objective(x) + jnp.dot(lam, chain_constraints(x))


@dxserve.function(description="objective sum (x_i - 0.5)^2 + 0.1 sum x_i x_{i+1}")
def chain_objective(x):
    return jnp.sum((x - 0.5) ** 2) + 0.1 * jnp.sum(x[:-1] * x[1:])


@dxserve.function(description="constraints c_j(x) = x_j^2 + x_{j+1} - 1, j < n - 1 (bidiagonal)")
def chain_constraints(x):
    return x[:-1] ** 2 + x[1:] - 1.0


def example_x(n: int, seed: int = 0) -> np.ndarray:
    """A float64 point in (-0.9, 0.9)^n, away from anything special."""
    return np.random.default_rng(seed).uniform(-0.9, 0.9, n)


#: name -> (operator family, n, contexts)
PATTERNS: dict[str, tuple[str, int, tuple]] = {
    "sp_tridiagonal": ("jacobian", 40, ()),
    "sp_banded": ("jacobian", 40, ()),
    "sp_arrowhead": ("jacobian", 40, ()),
    "sp_block_diagonal": ("jacobian", 40, ()),
    "sp_laplacian_2d": ("jacobian", 36, ()),
    "sp_dense_row": ("jacobian", 40, ()),
    "sp_chain_quartic": ("hessian", 40, ()),
    "sp_lagrangian": ("hessian", 40, (np.linspace(-1.0, 1.0, 39),)),
}
