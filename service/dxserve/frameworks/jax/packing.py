"""Tangent batches at the executable boundary: k tangents in, one argument per leaf.

Callers hand an operator a tuple of k tangents (pytrees shaped alike). Given to a
compiled program as they are, each tangent's leaves would be arguments of their
own and each result per tangent an output of its own: XLA's compile time then grows
faster than k (bench/compile_shapes.py). So the host stacks the batch leaf by leaf before the call (``pack``): the
program takes one ``(k, *leaf.shape)`` array per leaf, k is only a dimension, and its
compile time does not depend on k. Family builders receive the stacked batch and
return their per-tangent results stacked the same way; ``unpack`` cuts those back
into a tuple of k pytrees after the call: numpy views of the one output, since
cutting a JAX array k ways compiles a program of k outputs, again slower than k.

With a batch of points (``batch_axis=0``) every tangent leaf already leads with the
points, so the tangents' axis goes second: ``(B, k, ...)``; vmapping over the points
then hands each point's builder the usual ``(k, ...)`` batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Tree = Any


def axis_of(batch_axis: int | None) -> int:
    """Where the tangents' axis goes in a packed leaf: 0, or 1 after an axis of points."""
    return 0 if batch_axis is None else 1


def pack(tangents: tuple | None, batch_axis: int | None = None) -> Tree:
    """A tuple of k pytrees shaped alike -> one pytree whose leaves stack them on
    ``axis_of(batch_axis)``; None stays None. Numpy leaves stack on the host, JAX
    arrays where they live."""
    if tangents is None:
        return None
    axis = axis_of(batch_axis)
    return jax.tree_util.tree_map(lambda *leaves: _stack(leaves, axis), *tangents)


def _stack(leaves: tuple, axis: int) -> Any:
    if all(type(v) is np.ndarray for v in leaves):
        return np.stack(leaves, axis=axis)
    return jnp.stack(leaves, axis=axis)


def unpack(batch: Tree, k: int, batch_axis: int | None = None) -> tuple:
    """Inverse of ``pack``: a pytree of stacked leaves -> a tuple of ``k`` pytrees of
    numpy views (a program's outputs are copied to the host once, whole)."""
    axis = axis_of(batch_axis)
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    cut = [list(np.moveaxis(np.asarray(leaf), axis, 0)) for leaf in leaves]
    return tuple(treedef.unflatten([parts[i] for parts in cut]) for i in range(k))


def unpack_results(outputs: tuple, batched: Iterable[int], k: int, batch_axis: int | None) -> tuple:
    """``outputs`` with the entries at ``batched`` (per-tangent results) unpacked."""
    at = frozenset(batched)
    return tuple(
        unpack(out, k, batch_axis) if i in at else out for i, out in enumerate(outputs)
    )


def single(run: Callable, batched: Iterable[int], batch_axis: int | None) -> Callable:
    """``run`` (which takes packed tangents) as a function of one tangent: the program
    compiled from it takes the tangent and returns its results as they are, so a call
    stacks nothing on the host and cuts nothing after (see ``Single``)."""
    axis = axis_of(batch_axis)
    at = frozenset(batched)

    def one(x: Tree, tangent: Tree, contexts: tuple) -> tuple:
        out = run(x, jax.tree_util.tree_map(lambda v: _expand(v, axis), tangent), contexts)
        return tuple(
            jax.tree_util.tree_map(lambda v: _squeeze(v, axis), o) if i in at else o
            for i, o in enumerate(out)
        )

    return one


def _expand(v: Any, axis: int) -> Any:
    """``v`` with a new axis of length one at ``axis``, in ``v``'s own library: numpy
    arrays stay on the host (a numpy framework's float64 kept), JAX arrays and tracers
    in ``jnp``, any other framework's tensor (torch's) by indexing."""
    if isinstance(v, np.ndarray | np.generic):
        return np.expand_dims(v, axis)
    if isinstance(v, jax.Array):
        return jnp.expand_dims(v, axis)
    return v[(slice(None),) * axis + (None,)]


def _squeeze(v: Any, axis: int) -> Any:
    """``v`` without its axis of length one at ``axis`` (the inverse of ``_expand``)."""
    if isinstance(v, np.ndarray | np.generic):
        return np.squeeze(v, axis)
    if isinstance(v, jax.Array):
        return jnp.squeeze(v, axis)
    return v[(slice(None),) * axis + (0,)]


class Single:
    """An executable compiled from ``single(run, ...)``, called with a 1-tuple of tangents.

    Its per-tangent results come back as 1-tuples of the program's own arrays.
    """

    __slots__ = ("executable", "batched")

    def __init__(self, executable: Callable, batched: tuple[int, ...]):
        self.executable = executable
        self.batched = frozenset(batched)

    def __call__(self, x: Tree, tangents: tuple, contexts: tuple) -> tuple:
        out = self.executable(x, tangents[0], contexts)
        return tuple((o,) if i in self.batched else o for i, o in enumerate(out))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.executable, name)


class Packed:
    """An executable that takes packed tangents, called with a tuple of them.

    ``Packed(exe, batched, batch_axis)(x, tangents, contexts)`` packs ``tangents``,
    runs ``exe`` and unpacks the outputs at positions ``batched``. XLA's analyses
    (``memory_analysis``, ``cost_analysis``, ...) are the executable's own.
    """

    __slots__ = ("executable", "batched", "batch_axis")

    def __init__(self, executable: Callable, batched: tuple[int, ...], batch_axis: int | None):
        self.executable = executable
        self.batched = batched
        self.batch_axis = batch_axis

    def __call__(self, x: Tree, tangents: tuple, contexts: tuple) -> tuple:
        out = self.executable(x, pack(tangents, self.batch_axis), contexts)
        return unpack_results(out, self.batched, len(tangents), self.batch_axis)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.executable, name)
