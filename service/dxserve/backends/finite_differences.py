"""Finite differences: the mechanics behind ``finite-differences``.

Works on any callable. When JAX can trace the function the differences are
taken inside one compiled, vmapped program (and can themselves be differentiated,
e.g. a JAX outer mode over a finite-difference gradient); when it cannot (plain
numpy code), the same formulas run eagerly in numpy, one evaluation per tangent.

Step: ``h = step * max(1, max|x|)``; by default ``step = eps**(1/3)`` for central
differences (error O(h²), ~1e-10 relative in float64, ~1e-4 in float32) and
``eps**(1/2)`` for forward differences (error O(h), ~1e-8 / ~1e-3). Nested inside
another finite difference (second order), the defaults coarsen to ``eps**(1/4)``
and ``eps**(1/3)`` so the two truncation errors balance (~1e-8 in float64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._batching import basis, chunked_vmap, loop_map
from .engine import Fn, Tree

tmap = jax.tree_util.tree_map


def _np_flat(x: Tree) -> tuple[np.ndarray, Any]:
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


@dataclass(frozen=True)
class FiniteDifferencesEngine:
    method: str = "central"
    step: float | None = None
    batch_size: int | None = None
    traced: bool = True
    nested: bool = False  # True inside another finite difference: coarser default step
    natural: str = "pushforward"

    # --- helpers ---------------------------------------------------------
    @property
    def xp(self) -> Any:
        return jnp if self.traced else np

    def _map(self, fn: Fn, batch: Tree) -> Tree:
        return (chunked_vmap if self.traced else loop_map)(fn, batch, self.batch_size)

    def _flat(self, x: Tree) -> tuple[Any, Any]:
        if self.traced:
            return jax.flatten_util.ravel_pytree(x)
        return _np_flat(x)

    def _h(self, x: Tree) -> Any:
        leaves = jax.tree_util.tree_leaves(x)
        dtype = leaves[0].dtype
        eps = float(np.finfo(dtype).eps)
        power = {("central", False): 1 / 3, ("forward", False): 1 / 2,
                 ("central", True): 1 / 4, ("forward", True): 1 / 3}[(self.method, self.nested)]
        base = self.step if self.step is not None else eps**power
        xp = self.xp
        scale = 1.0
        for leaf in leaves:
            if leaf.size:
                scale = xp.maximum(scale, xp.max(xp.abs(leaf)))
        if self.traced:
            return jnp.asarray(base * scale, dtype)
        return float(base * scale)

    # --- the five primitives --------------------------------------------
    def pushforward(self, g: Fn, x: Tree, tx: Tree) -> tuple[Tree, Tree]:
        y = g(x)
        h = self._h(x)

        def shifted(t: Tree, sign: float) -> Tree:
            return g(tmap(lambda a, b: a + (sign * h) * b, x, t))

        if self.method == "central":
            def one(t: Tree) -> Tree:
                return tmap(lambda p, m: (p - m) / (2 * h), shifted(t, 1.0), shifted(t, -1.0))
        else:
            def one(t: Tree) -> Tree:
                return tmap(lambda p, y0: (p - y0) / h, shifted(t, 1.0), y)

        return y, self._map(one, tx)

    def _columns(self, g: Fn, x: Tree) -> tuple[Tree, Any, Any]:
        """``(g(x), cols, unflatten)`` with ``cols`` stacked J@e_i over flat x."""
        v, unflatten = self._flat(x)
        eye = basis(v.size, v.dtype) if self.traced else np.eye(v.size, dtype=v.dtype)
        y, cols = self.pushforward(lambda u: g(unflatten(u)), v, eye)
        return y, cols, unflatten

    def pullback(self, g: Fn, x: Tree, ty: Tree) -> tuple[Tree, Tree]:
        xp = self.xp
        y, cols, unflatten = self._columns(g, x)
        col_leaves = jax.tree_util.tree_leaves(cols)
        ct_leaves = jax.tree_util.tree_leaves(ty)
        k = ct_leaves[0].shape[0]
        n = col_leaves[0].shape[0]
        total = 0
        for col, ct in zip(col_leaves, ct_leaves, strict=True):
            total = total + xp.reshape(ct, (k, -1)) @ xp.reshape(col, (n, -1)).T
        return y, self._map(unflatten, total)

    def gradient(self, g: Fn, x: Tree) -> tuple[Any, Tree]:
        y, cols, unflatten = self._columns(g, x)
        return y, unflatten(cols)

    def derivative(self, g: Fn, x: Any) -> tuple[Tree, Tree]:
        one = self.xp.ones((1,), x.dtype)
        y, ty = self.pushforward(g, x, one)
        return y, tmap(lambda t: t[0], ty)

    def jacobian(self, g: Fn, x: Any) -> tuple[Any, Any]:
        xp = self.xp
        y, cols, _ = self._columns(g, x)
        n = cols.shape[0]
        m = int(np.prod(np.shape(y)))
        return y, xp.reshape(xp.reshape(cols, (n, m)).T, (*np.shape(y), *np.shape(x)))
