"""pushforward (JVP): ``(J t1, ..., J tk)`` for a batch of input tangents.

The batch is one vectorized call. Each tangent has x's structure; each result y's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dxserve.core.nesting import call
from dxserve.core.operators import _checks
from dxserve.core.preparation import Family, Inputs, Prep, prepare, register_family


def _check(inputs: Inputs) -> None:
    _checks.differentiable_x(inputs)
    _checks.tangents_like(inputs, inputs.x, "x")


def _build(f: Callable, engine: Any, inner: Any, inputs: Inputs) -> Callable:
    def run(x, tangents, contexts):
        y, results = engine.over_batch(engine.pushforward, lambda u: f(u, *contexts), x, tangents)
        return {"value": y, "pushforwards": results}

    return run


register_family(Family("pushforward", _check, _build))


def prepare_pushforward(
    f: Callable, backend: Any, x: Any, tangents: Sequence, *contexts: Any,
    batch_axis: int | None = None, has_aux: bool = False, wrt: Any = None,
) -> Prep:
    return prepare(
        "pushforward", f, backend, x, tangents, contexts, batch_axis=batch_axis, has_aux=has_aux, wrt=wrt
    )


def prepare_value_and_pushforward(
    f: Callable, backend: Any, x: Any, tangents: Sequence, *contexts: Any,
    batch_axis: int | None = None, has_aux: bool = False, wrt: Any = None,
) -> Prep:
    """Compile ``value_and_pushforward`` once for this signature (a ``pushforward``-family prep)."""
    return prepare(
        "value_and_pushforward", f, backend, x, tangents, contexts,
        batch_axis=batch_axis, has_aux=has_aux, wrt=wrt,
    )


def pushforward(
    f: Callable, backend: Any, x: Any, tangents: Sequence, *contexts: Any,
    prep: Prep | None = None, batch_axis: int | None = None,
    has_aux: bool = False, wrt: Any = None,
) -> tuple:
    """``(J @ t for t in tangents)``: a tuple as long as ``tangents``; ``(pushforwards,
    aux)`` with ``has_aux``."""
    return call(
        "pushforward", f, backend, x, tangents, contexts, prep,
        batch_axis=batch_axis, has_aux=has_aux, wrt=wrt,
    )


def value_and_pushforward(
    f: Callable, backend: Any, x: Any, tangents: Sequence, *contexts: Any,
    prep: Prep | None = None, batch_axis: int | None = None,
    has_aux: bool = False, wrt: Any = None,
) -> tuple[Any, tuple]:
    """``(f(x), (J @ t for t in tangents))``; ``((f(x), aux), pushforwards)`` with
    ``has_aux``."""
    return call(
        "value_and_pushforward", f, backend, x, tangents, contexts, prep,
        batch_axis=batch_axis, has_aux=has_aux, wrt=wrt,
    )

