"""The contract of a first-order engine, and DifferentiationInterface's fallbacks.

Operators own the maths and call only the methods of ``Engine``; an engine owns the
mechanics of one mode: how to take a pushforward or a pullback, and how to compile
what the operators build from them. An engine implements at least one of
``pushforward`` and ``pullback``; gradient, derivative, Jacobian and the other
direction fall back on it, as DI's operators do. An engine overrides a fallback
where it can do better (JAX's reverse mode reaches pushforwards by transposing its
VJP, for instance, instead of building the Jacobian).

``g`` is a function of the active input alone (contexts are already closed over);
tangent batches carry a leading axis. Arrays, pytrees, maps and compilation come from
the function's ``Framework`` (``engine.ops``), so the fallbacks hold for any framework.

Engines and their fallbacks see real numbers only: for a function with complex inputs
or outputs, preparation uses each engine's ``for_complex`` form (by default
``real_parts.RealParts``, which gives it the real and imaginary parts and answers in
JAX's convention).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import numpy as np

from dxserve.frameworks import Framework, astype, get_framework

Tree = Any

Fn = Callable[[Tree], Tree]
Mode = Literal["forward", "reverse"]


class Engine:
    """Base class of engines: override ``pushforward`` or ``pullback`` (or both).

    They are called from several threads at once (device workers, compile threads):
    an engine over an AD library with process-wide state holds the framework's lock
    (an ``RLock``: second order nests engines) around its calls into that library.

    Class attributes an engine sets:

    * ``traces``: True when the engine's maths runs under its framework's transforms
      (``jit``, ``vmap``), or inside whatever its framework's ``compile`` returns (a
      framework without a compiler); False for engines that need concrete arrays (a
      numpy engine beside JAX). An operator is compiled only when every engine it uses
      traces and the framework's ``probe`` says the function traces; only a compiled
      operator has an estimate (budgets) and runs in chunks with progress.
    * ``mode``: the direction the engine computes without help. Fallbacks use it to
      pick the cheaper way (columns for forward, rows for reverse). Left unset, it is
      the direction the subclass overrides.
    """

    traces: ClassVar[bool] = True
    mode: ClassVar[Mode]
    #: Tangents per vectorized call (None: the whole batch at once).
    batch_size: int | None = None
    #: False when the function is a black box: the engine then gets concrete arrays.
    traced: bool = True
    #: the function's framework (set by ``use`` at preparation; None: the default, JAX)
    framework: Framework | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        forward = cls.pushforward is not Engine.pushforward
        reverse = cls.pullback is not Engine.pullback
        if not (forward or reverse):
            raise TypeError(f"{cls.__name__} must implement pushforward or pullback")
        if "mode" not in cls.__dict__ and not hasattr(cls, "mode"):
            cls.mode = "forward" if forward else "reverse"

    def use(self, framework: Framework) -> Engine:
        """This engine, computing in ``framework`` (engines are made per preparation)."""
        object.__setattr__(self, "framework", framework)  # frozen dataclass engines too
        return self

    # --- array helpers: the framework's, its eager companion on black boxes ----
    @property
    def ops(self) -> Framework:
        """The framework this engine computes in for the current function."""
        framework = self.framework or get_framework()
        return framework if self.traced and self.traces else framework.eager()

    @property
    def xp(self) -> Any:
        """The array module this engine computes with for the current function."""
        return self.ops.xp

    def map(self, fn: Fn, batch: Tree) -> Tree:
        """``fn`` over the leading axis of ``batch``, ``batch_size`` items at a time."""
        return self.ops.map(fn, batch, self.batch_size)

    def flatten(self, x: Tree) -> tuple[Any, Callable[[Any], Tree]]:
        """``(vector, unflatten)`` of a pytree of arrays."""
        return self.ops.ravel(x)

    def basis(self, n: int, dtype: Any) -> Any:
        """The ``(n, n)`` identity: row i is the i-th basis tangent."""
        return self.xp.eye(n, dtype=dtype)

    # --- the two primitives -----------------------------------------------------
    def pushforward(self, g: Fn, x: Tree, tx: Tree) -> tuple[Tree, Tree]:
        """``(g(x), J @ t for t in tx)``; ``tx`` has x's structure plus a leading axis.

        Fallback: the Jacobian from pullbacks of y's basis rows, then ``J @ t``.
        """
        y, rows, unflatten_x = self._rows(g, x)  # rows: (m, n)
        xp = self.xp
        t_flat = self.map(lambda t: self.flatten(t)[0], tx)  # (k, n)
        products = xp.reshape(t_flat, (t_flat.shape[0], -1)) @ xp.reshape(rows, (rows.shape[0], -1)).T
        return y, self.map(lambda r: _unflatten_like(self.ops, r, y), products)

    def pullback(self, g: Fn, x: Tree, ty: Tree) -> tuple[Tree, Tree]:
        """``(g(x), J^T @ c for c in ty)``; ``ty`` has y's structure plus a leading axis.

        Fallback: the Jacobian from pushforwards of x's basis columns, then ``J^T @ c``.
        """
        xp = self.xp
        y, cols, unflatten = self._columns(g, x)
        col_leaves = self.ops.leaves(cols)
        ct_leaves = self.ops.leaves(ty)
        k = ct_leaves[0].shape[0]
        n = col_leaves[0].shape[0]
        total = 0
        for col, ct in zip(col_leaves, ct_leaves, strict=True):
            total = total + xp.reshape(ct, (k, -1)) @ xp.reshape(col, (n, -1)).T
        return y, self.map(unflatten, total)

    # --- what follows from them -------------------------------------------------
    def gradient(self, g: Fn, x: Tree) -> tuple[Any, Tree]:
        """``(g(x), ∇g(x))`` for scalar ``g``; the gradient has x's structure."""
        if self.mode == "reverse":
            y = self.ops.eval_shape(g, x)
            ones = self.xp.ones((1, *np.shape(y)), _dtype_of(y))
            y, grads = self.pullback(g, x, ones)
            return y, self.ops.tree_map(lambda leaf: leaf[0], grads)
        y, cols, unflatten = self._columns(g, x)
        return y, unflatten(cols)

    def derivative(self, g: Fn, x: Any) -> tuple[Tree, Tree]:
        """``(g(x), g'(x))`` for scalar ``x``; the derivative has y's structure."""
        y, ty = self.pushforward(g, x, self.xp.ones((1,), x.dtype))
        return y, self.ops.tree_map(lambda t: t[0], ty)

    def jacobian(self, g: Fn, x: Tree) -> tuple[Tree, Tree]:
        """``(g(x), J)``; for array x and y ``J.shape == y.shape + x.shape``.

        For pytrees, ``J`` nests as ``jax.jacobian``'s: y's structure whose every leaf is
        an x-structured tree of blocks of shape ``y_leaf.shape + x_leaf.shape``, cut from
        the flat ``(m, n)`` map, so every engine (finite differences, plug-ins) gives them.
        """
        xp = self.xp
        if self.mode == "reverse":
            y, rows, _ = self._rows(g, x)  # (m, n) over flat y and flat x
            if _is_leaf(x) and _is_leaf(y):
                return y, xp.reshape(rows, (*np.shape(y), *np.shape(x)))
            sizes = [math.prod(np.shape(v)) for v in self.ops.leaves(y)]
            return y, _blocks(self.ops, _split(rows, sizes, axis=0), y, x)
        y, cols, _ = self._columns(g, x)  # y's structure, leaves (n, *y_leaf.shape)
        col_leaves = self.ops.leaves(cols)
        n = col_leaves[0].shape[0] if col_leaves else 0
        if _is_leaf(x) and _is_leaf(y):
            m = int(np.prod(np.shape(y)))
            return y, xp.reshape(xp.reshape(cols, (n, m)).T, (*np.shape(y), *np.shape(x)))
        return y, _blocks(self.ops, [xp.reshape(c, (n, -1)).T for c in col_leaves], y, x)

    def symmetric_products(self, g: Fn, x: Tree, tx: Tree) -> tuple[Tree, Tree]:
        """``(g(x), J @ t for t in tx)`` for a ``g`` whose Jacobian is symmetric (a
        gradient, so J is a Hessian): J t = J^T t, so the engine takes its own mode."""
        if self.mode == "reverse":
            return self.pullback(g, x, tx)
        return self.pushforward(g, x, tx)

    def over_batch(
        self, primitive: Callable[[Fn, Tree, Tree], tuple[Tree, Tree]], g: Fn, x: Tree,
        batch: Tree,
    ) -> tuple[Tree, Tree]:
        """``primitive(g, x, batch)`` on a packed batch of tangents (every leaf stacked on
        a leading axis of k, see ``packing``): ``(g(x), results stacked alike)``."""
        return primitive(g, x, batch)

    def for_complex(self, name: str) -> Engine | None:
        """The engine to use for a function with complex inputs or outputs, answering in
        JAX's convention; None (the default): this engine wrapped in ``RealParts``, which
        hands it the real and imaginary parts as real arrays. An engine that follows the
        convention natively may return itself; one that cannot serve complex numbers
        raises ``UnsupportedOperatorError`` (``name``: the backend, for messages)."""
        return None

    # --- preparation hooks ----------------------------------------------------------
    def prepare(self, family: str, f: Callable, inputs: Any, limits: Any = None) -> None:
        """Look at the function once, at preparation, before the operator is built
        (``inputs``: ``preparation.Inputs``; ``limits``: the server's ``ComputeLimits``,
        None in the library). Plain engines need nothing; the sparse engine detects and
        colours the pattern here, with ``limits.sparsity``."""

    @property
    def nbytes(self) -> int:
        """Host and device bytes this engine holds beyond compiled code (a sparse
        engine's pattern); what a byte-bounded cache of preps counts."""
        return 0

    def result_elements(self, family: str, n: int, m: int, k: int) -> int | None:
        """Numbers ``family``'s results hold here, when this engine knows better than
        the operator table (a sparse Jacobian holds nnz, not m * n); None: the table's."""
        return None

    def report(self) -> dict[str, Any]:
        """What preparation found, for the prep and ``POST /prepare``'s answer
        (the sparse engine: ``{"sparsity": {...}}``); nothing for plain engines."""
        return {}

    def held_bytes(self) -> int:
        """Bytes this engine keeps between calls beyond its compiled executables (the
        sparse engine: its pattern, colouring and index arrays), for the byte bounds of
        the caches that hold preps; nothing for plain engines."""
        return 0

    # --- compilation --------------------------------------------------------------
    def compile(self, fn: Callable, args: tuple, key: Any = None) -> Callable:
        """``fn`` compiled for ``args`` (or ``fn`` itself where it cannot be traced).

        ``key`` (see ``Framework.executable_key``) persists the executable across restarts.
        """
        if not (self.traced and self.traces):
            return fn
        return self.ops.compile(fn, args, key)

    # --- fallback helpers ---------------------------------------------------------
    def _columns(self, g: Fn, x: Tree) -> tuple[Tree, Any, Callable]:
        """``(g(x), cols, unflatten)``: cols stacks ``J @ e_i`` over flat x, shape (n, *y)."""
        v, unflatten = self.flatten(x)
        n = math.prod(v.shape)  # (not v.size: a method on some frameworks' arrays)
        y, cols = self.pushforward(lambda u: g(unflatten(u)), v, self.basis(n, v.dtype))
        return y, cols, unflatten

    def _rows(self, g: Fn, x: Tree) -> tuple[Any, Any, Callable]:
        """``(g(x), rows, unflatten)``: rows stacks flat ``J^T @ e_j`` over flat y, (m, n)."""
        xp = self.xp
        ops = self.ops
        shape_y = ops.eval_shape(g, x)
        if _is_leaf(shape_y):
            m = int(np.prod(np.shape(shape_y)))
            eye = self.basis(m, _dtype_of(shape_y))
            y, out = self.pullback(g, x, xp.reshape(eye, (m, *np.shape(shape_y))))
        else:  # a pytree y: row j of the basis, cut into y's leaves
            leaves, y_def = ops.flatten(shape_y)
            sizes = [math.prod(np.shape(v)) for v in leaves]
            m = sum(sizes)
            eye = self.basis(m, np.result_type(*[_dtype_of(v) for v in leaves]))
            parts = _split(eye, sizes, axis=1)
            cotangents = [
                astype(xp, xp.reshape(p, (m, *np.shape(v))), _dtype_of(v))
                for p, v in zip(parts, leaves, strict=True)
            ]
            y, out = self.pullback(g, x, ops.unflatten(y_def, cotangents))
        flat_rows = self.map(lambda r: self.flatten(r)[0], out)
        _, unflatten = self.flatten(x)
        return y, flat_rows, unflatten


def _is_leaf(tree: Any) -> bool:
    """An array (or its shape spec), not a pytree node."""
    return not isinstance(tree, dict | list | tuple) and hasattr(tree, "shape")


def _split(a: Any, sizes: list[int], axis: int) -> list[Any]:
    """``a`` cut along ``axis`` into consecutive pieces of ``sizes`` (zero sizes allowed)."""
    out, at = [], 0
    for size in sizes:
        index = [slice(None)] * a.ndim
        index[axis] = slice(at, at + size)
        out.append(a[tuple(index)])
        at += size
    return out


def _blocks(ops: Framework, rows: list[Any], y: Tree, x: Tree) -> Tree:
    """``jax.jacobian``'s nesting from ``rows[i]``, the ``(y_leaf_i.size, x.size)`` rows of
    the flat Jacobian belonging to y's i-th leaf: y's structure of x-structured blocks."""
    xp = ops.xp
    x_leaves, x_def = ops.flatten(x)
    y_leaves, y_def = ops.flatten(y)
    sizes = [math.prod(np.shape(v)) for v in x_leaves]
    nested = []
    for part, y_leaf in zip(rows, y_leaves, strict=True):
        blocks = [
            astype(xp, xp.reshape(b, (*np.shape(y_leaf), *np.shape(x_leaf))), _dtype_of(x_leaf))
            for b, x_leaf in zip(_split(part, sizes, axis=1), x_leaves, strict=True)
        ]
        nested.append(ops.unflatten(x_def, blocks))
    return ops.unflatten(y_def, nested)


def _dtype_of(y: Any) -> Any:
    return y.dtype if hasattr(y, "dtype") else np.asarray(y).dtype


def _unflatten_like(ops: Framework, flat: Any, y: Tree) -> Tree:
    """A flat ``(y.size,)`` vector in ``y``'s structure and shapes."""
    xp = ops.xp
    if _is_leaf(y):
        return xp.reshape(flat, np.shape(y))
    leaves, y_def = ops.flatten(y)
    parts = _split(flat, [math.prod(np.shape(v)) for v in leaves], axis=0)
    return ops.unflatten(
        y_def, [xp.reshape(p, np.shape(v)) for p, v in zip(parts, leaves, strict=True)]
    )
