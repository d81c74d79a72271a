"""The contract every first-order engine fulfils.

Operators own the maths and call only these five primitives; an engine owns the
mechanics of one mode. ``g`` is a function of the active input alone (contexts
are already closed over), tangent batches carry a leading axis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

Tree = Any
Fn = Callable[[Tree], Tree]


class Engine(Protocol):
    #: False when the engine calls ``g`` on concrete arrays (black-box functions).
    traced: bool
    batch_size: int | None
    #: "pushforward" or "pullback": the direction computed without a transpose.
    natural: str

    def pushforward(self, g: Fn, x: Tree, tx: Tree) -> tuple[Tree, Tree]:
        """``(g(x), J @ t for t in tx)``; ``tx`` has x's structure plus a leading axis."""

    def pullback(self, g: Fn, x: Tree, ty: Tree) -> tuple[Tree, Tree]:
        """``(g(x), J^T @ c for c in ty)``; ``ty`` has y's structure plus a leading axis."""

    def gradient(self, g: Fn, x: Tree) -> tuple[Any, Tree]:
        """``(g(x), ∇g(x))`` for scalar ``g``; the gradient has x's structure."""

    def derivative(self, g: Fn, x: Any) -> tuple[Tree, Tree]:
        """``(g(x), g'(x))`` for scalar ``x``; the derivative has y's structure."""

    def jacobian(self, g: Fn, x: Any) -> tuple[Any, Any]:
        """``(g(x), J)`` for array x and y; ``J.shape == y.shape + x.shape``."""
