"""sparsity: the pattern of the Jacobian (or, for scalar-valued f, the Hessian), no values.

Detected once at preparation by the sparse engine (asdex), whatever backend is asked
for (a non-sparse one is used as ``Sparse(backend)``). The result is a boolean
``BCOO`` of shape ``(y.size, x.size)``, or ``(x.size, x.size)`` for a scalar ``f``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dxserve.core.nesting import call
from dxserve.core.operators import _checks
from dxserve.core.preparation import Family, Inputs, Prep, prepare, register_family


def _check(inputs: Inputs) -> None:
    _checks.array_input(inputs, "sparsity")
    _checks.array_output(inputs, "sparsity")
    _checks.differentiable_x(inputs)


def _build(f: Callable, engine: Any, inner: Any, inputs: Inputs) -> Callable:
    def run(x, tangents, contexts):
        return {"sparsity": engine.pattern_bcoo()}

    return run


register_family(Family("sparsity", _check, _build))


def prepare_sparsity(f: Callable, backend: Any, x: Any, *contexts: Any) -> Prep:
    return prepare("sparsity", f, backend, x, None, contexts)


def sparsity(f: Callable, backend: Any, x: Any, *contexts: Any, prep: Prep | None = None) -> Any:
    """The pattern: a boolean BCOO, ``(y.size, x.size)`` (``(x.size, x.size)`` for scalar f)."""
    return call("sparsity", f, backend, x, None, contexts, prep)
