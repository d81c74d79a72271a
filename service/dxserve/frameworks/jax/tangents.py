"""Tangent batches: chunked maps over their leading axis, flattening."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

Tree = Any


def batch_len(batch: Tree) -> int:
    """Length of the leading (batch) axis shared by every leaf."""
    return jax.tree_util.tree_leaves(batch)[0].shape[0]


def chunked_vmap(fn: Callable[[Tree], Tree], batch: Tree, batch_size: int | None) -> Tree:
    """``vmap(fn)(batch)``, evaluated ``batch_size`` items per vectorized call.

    Chunks run one after another inside one compiled program (``lax.map``), so
    memory grows with ``batch_size`` rather than with the whole batch.
    """
    k = batch_len(batch)
    if k == 1:  # no batch axis inside the program: the same HLO as the hand-written maths
        out = fn(jax.tree_util.tree_map(lambda leaf: leaf[0], batch))
        return jax.tree_util.tree_map(lambda leaf: leaf[None], out)
    if batch_size is None or batch_size >= k:
        return jax.vmap(fn)(batch)
    chunks = -(-k // batch_size)
    pad = chunks * batch_size - k

    def to_chunks(leaf):
        leaf = jnp.concatenate([leaf, jnp.zeros((pad, *leaf.shape[1:]), leaf.dtype)]) if pad else leaf
        return leaf.reshape(chunks, batch_size, *leaf.shape[1:])

    out = jax.lax.map(jax.vmap(fn), jax.tree_util.tree_map(to_chunks, batch))
    return jax.tree_util.tree_map(lambda o: o.reshape(chunks * batch_size, *o.shape[2:])[:k], out)


def loop_map(fn: Callable[[Tree], Tree], batch: Tree, batch_size: int | None = None) -> Tree:
    """The same contract as ``chunked_vmap`` for functions JAX cannot trace."""
    k = batch_len(batch)
    outs = [fn(jax.tree_util.tree_map(lambda leaf, i=i: leaf[i], batch)) for i in range(k)]
    return jax.tree_util.tree_map(lambda *leaves: np.stack([np.asarray(v) for v in leaves]), *outs)


def flat(x: Tree) -> tuple[jax.Array, Callable[[jax.Array], Tree]]:
    """Flatten a pytree of arrays to one vector and return the inverse."""
    return ravel_pytree(x)


def np_flat(x: Tree) -> tuple[np.ndarray, Callable[[np.ndarray], Tree]]:
    """``flat`` in numpy, for engines that work on concrete arrays."""
    leaves, treedef = jax.tree_util.tree_flatten(x)
    leaves = [np.asarray(leaf) for leaf in leaves]
    vec = np.concatenate([leaf.ravel() for leaf in leaves]) if leaves else np.zeros(0)
    shapes = [leaf.shape for leaf in leaves]
    sizes = np.cumsum([leaf.size for leaf in leaves])[:-1]

    def unflatten(v: np.ndarray) -> Tree:
        parts = np.split(np.asarray(v), sizes)
        return jax.tree_util.tree_unflatten(
            treedef, [p.reshape(s) for p, s in zip(parts, shapes, strict=True)]
        )

    return vec, unflatten


def basis(n: int, dtype: Any) -> jax.Array:
    """The ``(n, n)`` identity: row i is the i-th basis tangent."""
    return jnp.eye(n, dtype=dtype)
