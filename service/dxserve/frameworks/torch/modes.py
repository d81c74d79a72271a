"""PyTorch forward and reverse mode: the mechanics behind ``torch-forward`` and
``torch-reverse``, on ``torch.func``.

As the JAX modes do, each mode computes natively what it is good at and reaches the
other direction through its own linear map: torch has no ``linear_transpose``, but the
VJP ``c -> J^T c`` is linear in ``c``, so the VJP of the VJP gives ``J t``, and the VJP
of the JVP ``t -> J t`` gives ``J^T c``: one extra linear pass each, exact, instead of
n. Tangent batches are ``torch.func.vmap``ped (``batch_size`` at a time: ``chunk_size``;
one tangent is one plain call).
Gradients, derivatives and Jacobians come from ``Engine``'s fallbacks (columns of JVPs
forward, rows of VJPs reverse), except reverse mode's gradient: one backward pass. Where
it is not inside a ``torch.func`` transform (an HVP's outer mode, a batch of points),
that pass is ``torch.autograd.grad`` itself: in eager mode ``torch.func.vjp`` costs
several times more per call on small inputs (0.14 against 0.07 ms at n = 10), and the
two compute the same products.

The engines run inside a torch program (``frameworks/torch.py``): ``g`` takes and
returns tensors and pytrees of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.func import jvp, vjp

from dxserve.core.backends.engine import Engine, Fn
from dxserve.frameworks.torch.framework import batch_map, tree_map

Tree = Any


def _zeros_like(tree: Tree) -> Tree:
    return tree_map(torch.zeros_like, tree)


@dataclass(frozen=True)
class TorchForwardEngine(Engine):
    batch_size: int | None = None
    traced: bool = True
    mode = "forward"

    def pushforward(self, g: Fn, x: Tree, tx: Tree) -> tuple[Tree, Tree]:
        ys, pushed = batch_map(lambda t: jvp(g, (x,), (t,)), tx, self.batch_size)
        # the primal does not depend on the tangent: vmap hands it back expanded, a view
        return tree_map(lambda v: v[0], ys), pushed

    def pullback(self, g: Fn, x: Tree, ty: Tree) -> tuple[Tree, Tree]:
        y = g(x)
        # t -> J t is linear: its VJP at any t (zero) is c -> J^T c
        _, transposed = vjp(lambda t: jvp(g, (x,), (t,))[1], _zeros_like(x))
        return y, batch_map(lambda c: transposed(c)[0], ty, self.batch_size)


@dataclass(frozen=True)
class TorchReverseEngine(Engine):
    batch_size: int | None = None
    traced: bool = True
    mode = "reverse"

    def pullback(self, g: Fn, x: Tree, ty: Tree) -> tuple[Tree, Tree]:
        y, pull = vjp(g, x)
        return y, batch_map(lambda c: pull(c)[0], ty, self.batch_size)

    def pushforward(self, g: Fn, x: Tree, tx: Tree) -> tuple[Tree, Tree]:
        y, pull = vjp(g, x)
        # c -> J^T c is linear: its VJP at any c (zero) is t -> J t
        _, transposed = vjp(lambda c: pull(c)[0], _zeros_like(y))
        return y, batch_map(lambda t: transposed(t)[0], tx, self.batch_size)

    def gradient(self, g: Fn, x: Tree) -> tuple[Any, Tree]:
        # One VJP, without the batch axis the fallback's pullback adds.
        found = _autograd_gradient(g, x)
        if found is not None:
            return found
        y, pull = vjp(g, x)
        return y, pull(torch.ones_like(y))[0]


def _autograd_gradient(g: Fn, x: Tree) -> tuple[Any, Tree] | None:
    """``(g(x), ∇g(x))`` from one ``torch.autograd.grad`` pass, or None where autograd's
    own API cannot run: inside a ``torch.func`` transform (its tensors refuse
    ``requires_grad_``) or while ``torch.compile`` traces (transforms trace whole)."""
    if torch.compiler.is_compiling():
        return None
    made: list[torch.Tensor] = []

    def watched(v: torch.Tensor) -> torch.Tensor:
        leaf = v.detach().requires_grad_(True)
        made.append(leaf)
        return leaf

    with torch.enable_grad():
        try:
            xs = tree_map(watched, x)
        except RuntimeError:  # a transform's wrapped tensor, or a dtype without gradients
            return None
        y = g(xs)
        if not y.requires_grad:  # f does not depend on x here
            return y, tree_map(torch.zeros_like, x)
        grads = iter(torch.autograd.grad(y, made, allow_unused=True))
    # tree_map visits x's leaves in the order ``watched`` saw them
    return y.detach(), tree_map(
        lambda v: _materialized(next(grads), v), x
    )


def _materialized(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad
