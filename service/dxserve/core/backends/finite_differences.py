"""Finite differences: the mechanics behind ``finite-differences``.

Works on any callable, in any framework. When the function's framework can trace it
the differences are taken inside one compiled, vmapped program (and can themselves be
differentiated, e.g. a JAX outer mode over a finite-difference gradient); when it
cannot (plain numpy code beside JAX), the same formulas run eagerly in numpy, one
evaluation per tangent.
Everything but the pushforward comes from ``Engine``'s fallbacks (the Jacobian's
columns, one pushforward of the basis).

Step: ``h = step * max(1, max|x|)``; by default ``step = eps**(1/3)`` for central
differences (error O(h²), ~1e-10 relative in float64, ~1e-4 in float32) and
``eps**(1/2)`` for forward differences (error O(h), ~1e-8 / ~1e-3). Nested inside
another finite difference (second order), the defaults coarsen to ``eps**(1/4)``
and ``eps**(1/3)`` so the two truncation errors balance (~1e-8 in float64).

Complex x reaches the engine as its real and imaginary parts (``real_parts``): the
differences step along both, with the step of the real dtype under complex64/complex128.

float16 and bfloat16 inputs are refused (``refuse_low_precision``): their steps are
~0.1 and ~0.2 of ``max(1, max|x|)`` (bfloat16 keeps 8 bits), and what comes out is no derivative.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dxcontract import dtypes
from dxcontract.backends import Backend, FiniteDifferences
from dxcontract.errors import UnsupportedOperatorError
from dxserve.core.backends.engine import Engine, Fn, Tree


@dataclass(frozen=True)
class FiniteDifferencesEngine(Engine):
    method: str = "central"
    step: float | None = None
    batch_size: int | None = None
    traced: bool = True
    nested: bool = False  # True inside another finite difference: coarser default step

    def _h(self, x: Tree) -> Any:
        leaves = self.ops.leaves(x)
        dtype = self.xp.real(leaves[0]).dtype  # complex64/128: float32/64's step, a real h
        eps = float(self.xp.finfo(dtype).eps)  # the framework's own dtypes (torch's)
        power = {("central", False): 1 / 3, ("forward", False): 1 / 2,
                 ("central", True): 1 / 4, ("forward", True): 1 / 3}[(self.method, self.nested)]
        base = self.step if self.step is not None else eps**power
        xp = self.xp
        scale = 1.0
        for leaf in leaves:
            if leaf.size:
                scale = xp.maximum(scale, xp.max(xp.abs(leaf)))
        if self.traced:
            return xp.asarray(base * scale, dtype)
        return float(base * scale)

    def pushforward(self, g: Fn, x: Tree, tx: Tree) -> tuple[Tree, Tree]:
        y = g(x)
        h = self._h(x)
        tmap = self.ops.tree_map

        def shifted(t: Tree, sign: float) -> Tree:
            return g(tmap(lambda a, b: a + (sign * h) * b, x, t))

        if self.method == "central":
            def one(t: Tree) -> Tree:
                return tmap(lambda p, m: (p - m) / (2 * h), shifted(t, 1.0), shifted(t, -1.0))
        else:
            def one(t: Tree) -> Tree:
                return tmap(lambda p, y0: (p - y0) / h, shifted(t, 1.0), y)

        return y, self.map(one, tx)


def uses_finite_differences(backend: Backend) -> bool:
    """Does the concrete descriptor ``backend`` take finite differences anywhere (itself,
    a second-order backend's outer or inner, a sparse backend's dense one)?"""
    if isinstance(backend, FiniteDifferences):
        return True
    if not dataclasses.is_dataclass(backend):
        return False
    return any(
        uses_finite_differences(value)
        for value in (getattr(backend, f.name) for f in dataclasses.fields(backend))
        if dataclasses.is_dataclass(value) and hasattr(value, "type")
    )


def refuse_low_precision(backend: Backend, leaves: Iterable[Any], *, traced: bool) -> None:
    """``UnsupportedOperatorError`` (422, field ``backend``) when ``backend`` (concrete)
    takes finite differences of an x with a float16 or bfloat16 leaf."""
    low = next(
        (np.dtype(leaf.dtype) for leaf in leaves if np.dtype(leaf.dtype) in dtypes.LOW_PRECISION),
        None,
    )
    if low is None or not uses_finite_differences(backend):
        return
    eps = float(dtypes.finfo(low).eps)
    if traced:
        fix = "use jax-forward or jax-reverse, or send float32/float64"
    else:  # auto falls back to finite differences; JAX's modes cannot serve either
        fix = "JAX cannot trace this function, so send float32/float64"
    raise UnsupportedOperatorError(
        f"finite-differences cannot differentiate {low.name} x: its step would be "
        f"{eps ** (1 / 3):.2g} of max(1, max|x|) (cbrt of {low.name}'s eps {eps:.2g}), too coarse "
        f"for a derivative; {fix}",
        field="backend",
    )
