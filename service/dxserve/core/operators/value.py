"""value: ``f(x, *contexts)``, compiled once per signature. Any first-order backend is accepted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dxserve.core.nesting import call
from dxserve.core.preparation import Family, Inputs, Prep, prepare, register_family


def _check(inputs: Inputs) -> None:
    pass


def _build(f: Callable, engine: Any, inner: Any, inputs: Inputs) -> Callable:
    def run(x, tangents, contexts):
        return {"value": f(x, *contexts)}

    return run


register_family(Family("value", _check, _build))


def prepare_value(
    f: Callable, backend: Any, x: Any, *contexts: Any,
    batch_axis: int | None = None, has_aux: bool = False, wrt: Any = None,
) -> Prep:
    return prepare("value", f, backend, x, None, contexts, batch_axis=batch_axis, has_aux=has_aux, wrt=wrt)


def value(
    f: Callable, backend: Any, x: Any, *contexts: Any,
    prep: Prep | None = None, batch_axis: int | None = None,
    has_aux: bool = False, wrt: Any = None,
) -> Any:
    """``f(x, *contexts)``: y with f's output structure, shape and dtype (``(y, aux)``
    with ``has_aux``: f's pair, checked to be one)."""
    return call(
        "value", f, backend, x, None, contexts, prep, batch_axis=batch_axis, has_aux=has_aux, wrt=wrt
    )
