"""JAX forward and reverse mode: the mechanics behind ``jax-forward`` and ``jax-reverse``.

Each mode does natively what it is good at and reaches the other direction by
transposing its own linear map (``jax.linear_transpose``), which is exact and
costs one extra linear pass instead of n. Gradients, derivatives and Jacobians
come from ``Engine``'s fallbacks: columns of JVPs for forward mode, rows of VJPs
for reverse mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from dxserve.core.backends.engine import Engine, Fn
from dxserve.frameworks.jax.tangents import Tree, batch_len, chunked_vmap


@dataclass(frozen=True)
class ForwardEngine(Engine):
    batch_size: int | None = None
    traced: bool = True
    mode = "forward"

    def pushforward(self, g: Fn, x: Tree, tx: Tree) -> tuple[Tree, Tree]:
        k = batch_len(tx)
        if self.batch_size is None or self.batch_size >= k:
            # JVPs, vectorized: the primal is computed once (nothing batches it), one
            # tangent is jax.jvp itself; a linearize would split a while_loop into a
            # primal loop and a tangent loop that runs the primal again
            if k == 1:
                y, t = jax.jvp(g, (x,), (jax.tree_util.tree_map(lambda v: v[0], tx),))
                return y, jax.tree_util.tree_map(lambda v: v[None], t)
            return jax.vmap(lambda t: jax.jvp(g, (x,), (t,)), out_axes=(None, 0))(tx)
        y, lin = jax.linearize(g, x)  # in chunks: the residuals kept once, not the primal
        return y, chunked_vmap(lin, tx, self.batch_size)

    def pullback(self, g: Fn, x: Tree, ty: Tree) -> tuple[Tree, Tree]:
        try:
            y, lin = jax.linearize(g, x)
            transposed = jax.linear_transpose(lin, x)
            return y, chunked_vmap(lambda c: transposed(c)[0], ty, self.batch_size)
        except (ValueError, TypeError, NotImplementedError) as exc:
            if not _untransposable(exc):
                raise
        # A JVP JAX cannot transpose (a lax.while_loop): the Jacobian from the
        # pushforwards of x's basis, then J^T c, as DifferentiationInterface does. Exact.
        return Engine.pullback(self, g, x, ty)


def _untransposable(exc: BaseException) -> bool:
    """Did JAX refuse to transpose (reverse-differentiate) a primitive?"""
    text = str(exc)
    return any(s in text for s in (
        "Reverse-mode differentiation does not work", "Transpose rule", "transpose",
        "linear_transpose", "not implemented",
    ))


@dataclass(frozen=True)
class ReverseEngine(Engine):
    batch_size: int | None = None
    traced: bool = True
    mode = "reverse"

    def pullback(self, g: Fn, x: Tree, ty: Tree) -> tuple[Tree, Tree]:
        y, vjp = jax.vjp(g, x)
        return y, chunked_vmap(lambda c: vjp(c)[0], ty, self.batch_size)

    def pushforward(self, g: Fn, x: Tree, tx: Tree) -> tuple[Tree, Tree]:
        y, vjp = jax.vjp(g, x)
        transposed = jax.linear_transpose(lambda c: vjp(c)[0], y)
        return y, chunked_vmap(lambda t: transposed(t)[0], tx, self.batch_size)

    def gradient(self, g: Fn, x: Tree) -> tuple[jax.Array, Tree]:
        # One VJP, without the batch axis the fallback's pullback adds.
        y, vjp = jax.vjp(g, x)
        return y, vjp(jnp.ones_like(y))[0]
