"""pullback (VJP): ``(Jᵀ c1, ..., Jᵀ ck)`` for a batch of output cotangents.

The batch is one vectorized call. Each cotangent has y's structure; each result x's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dxserve.core.nesting import call
from dxserve.core.operators import _checks
from dxserve.core.preparation import Family, Inputs, Prep, prepare, register_family


def _check(inputs: Inputs) -> None:
    _checks.differentiable_x(inputs)
    _checks.tangents_like(inputs, inputs.y, "f(x)")


def _build(f: Callable, engine: Any, inner: Any, inputs: Inputs) -> Callable:
    def run(x, tangents, contexts):
        y, results = engine.over_batch(engine.pullback, lambda u: f(u, *contexts), x, tangents)
        return {"value": y, "pullbacks": results}

    return run


register_family(Family("pullback", _check, _build))


def prepare_pullback(
    f: Callable, backend: Any, x: Any, tangents: Sequence, *contexts: Any,
    batch_axis: int | None = None, has_aux: bool = False, wrt: Any = None,
) -> Prep:
    return prepare(
        "pullback", f, backend, x, tangents, contexts, batch_axis=batch_axis, has_aux=has_aux, wrt=wrt
    )


def prepare_value_and_pullback(
    f: Callable, backend: Any, x: Any, tangents: Sequence, *contexts: Any,
    batch_axis: int | None = None, has_aux: bool = False, wrt: Any = None,
) -> Prep:
    """Compile ``value_and_pullback`` once for this signature (a ``pullback``-family prep)."""
    return prepare(
        "value_and_pullback", f, backend, x, tangents, contexts,
        batch_axis=batch_axis, has_aux=has_aux, wrt=wrt,
    )


def pullback(
    f: Callable, backend: Any, x: Any, tangents: Sequence, *contexts: Any,
    prep: Prep | None = None, batch_axis: int | None = None,
    has_aux: bool = False, wrt: Any = None,
) -> tuple:
    """``(Jᵀ @ c for c in tangents)``: each has x's structure; ``(pullbacks, aux)`` with
    ``has_aux``."""
    return call(
        "pullback", f, backend, x, tangents, contexts, prep, batch_axis=batch_axis, has_aux=has_aux, wrt=wrt
    )


def value_and_pullback(
    f: Callable, backend: Any, x: Any, tangents: Sequence, *contexts: Any,
    prep: Prep | None = None, batch_axis: int | None = None,
    has_aux: bool = False, wrt: Any = None,
) -> tuple[Any, tuple]:
    """``(f(x), (Jᵀ @ c for c in tangents))``; ``((f(x), aux), pullbacks)`` with ``has_aux``."""
    return call(
        "value_and_pullback", f, backend, x, tangents, contexts, prep,
        batch_axis=batch_axis, has_aux=has_aux, wrt=wrt,
    )

