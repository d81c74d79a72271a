"""JAX forward and reverse mode: the mechanics behind ``jax-forward`` and ``jax-reverse``.

Each mode does natively what it is good at and reaches the other direction by
transposing its own linear map (``jax.linear_transpose``), which is exact and
costs one extra linear pass instead of n.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ._batching import basis, chunked_vmap, flat
from .engine import Fn, Tree


def _columns_to_jacobian(cols: jax.Array, y_shape: tuple, x_shape: tuple) -> jax.Array:
    """``(n, *y.shape)`` stacked J@e_i -> ``y.shape + x.shape``."""
    n = cols.shape[0]
    m = cols.size // n if n else 0
    return jnp.reshape(cols.reshape(n, m).T, (*y_shape, *x_shape))


@dataclass(frozen=True)
class ForwardEngine:
    batch_size: int | None = None
    traced: bool = True
    natural: str = "pushforward"  # the direction this mode computes without transposing

    def pushforward(self, g: Fn, x: Tree, tx: Tree) -> tuple[Tree, Tree]:
        y, lin = jax.linearize(g, x)
        return y, chunked_vmap(lin, tx, self.batch_size)

    def pullback(self, g: Fn, x: Tree, ty: Tree) -> tuple[Tree, Tree]:
        y, lin = jax.linearize(g, x)
        transposed = jax.linear_transpose(lin, x)
        return y, chunked_vmap(lambda c: transposed(c)[0], ty, self.batch_size)

    def gradient(self, g: Fn, x: Tree) -> tuple[jax.Array, Tree]:
        v, unflatten = flat(x)
        y, cols = self.pushforward(lambda u: g(unflatten(u)), v, basis(v.size, v.dtype))
        return y, unflatten(cols)

    def derivative(self, g: Fn, x: jax.Array) -> tuple[Tree, Tree]:
        y, ty = self.pushforward(g, x, jnp.ones((1,), x.dtype))
        return y, jax.tree_util.tree_map(lambda t: t[0], ty)

    def jacobian(self, g: Fn, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        v = x.reshape(-1)
        y, cols = self.pushforward(lambda u: g(u.reshape(x.shape)), v, basis(v.size, v.dtype))
        return y, _columns_to_jacobian(cols, jnp.shape(y), x.shape)


@dataclass(frozen=True)
class ReverseEngine:
    batch_size: int | None = None
    traced: bool = True
    natural: str = "pullback"

    def pullback(self, g: Fn, x: Tree, ty: Tree) -> tuple[Tree, Tree]:
        y, vjp = jax.vjp(g, x)
        return y, chunked_vmap(lambda c: vjp(c)[0], ty, self.batch_size)

    def pushforward(self, g: Fn, x: Tree, tx: Tree) -> tuple[Tree, Tree]:
        y, vjp = jax.vjp(g, x)
        transposed = jax.linear_transpose(lambda c: vjp(c)[0], y)
        return y, chunked_vmap(lambda t: transposed(t)[0], tx, self.batch_size)

    def gradient(self, g: Fn, x: Tree) -> tuple[jax.Array, Tree]:
        y, vjp = jax.vjp(g, x)
        return y, vjp(jnp.ones_like(y))[0]

    def derivative(self, g: Fn, x: jax.Array) -> tuple[Tree, Tree]:
        y, vjp = jax.vjp(g, x)
        leaves, treedef = jax.tree_util.tree_flatten(y)
        parts = []
        for i, leaf in enumerate(leaves):
            rows = basis(leaf.size, leaf.dtype)

            def one(row, i=i):
                cts = [jnp.zeros_like(lf) for lf in leaves]
                cts[i] = row.reshape(leaves[i].shape)
                return vjp(jax.tree_util.tree_unflatten(treedef, cts))[0]

            parts.append(chunked_vmap(one, rows, self.batch_size).reshape(leaf.shape))
        return y, jax.tree_util.tree_unflatten(treedef, parts)

    def jacobian(self, g: Fn, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        y, vjp = jax.vjp(g, x)
        rows = basis(y.size, y.dtype)
        out = chunked_vmap(lambda r: vjp(r.reshape(y.shape))[0], rows, self.batch_size)
        return y, out.reshape(*y.shape, *x.shape)
