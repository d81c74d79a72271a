"""derivative: ``f'(x)`` for scalar x; the result has y's structure and shape.

Forward mode takes one JVP; reverse mode one VJP per output entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dxserve.core.holomorphic import maybe as _declare
from dxserve.core.nesting import call
from dxserve.core.operators import _checks
from dxserve.core.preparation import Family, Inputs, Prep, prepare, register_family


def _check(inputs: Inputs) -> None:
    _checks.scalar_input(inputs, "derivative")
    _checks.differentiable_x(inputs)
    _checks.complex_jacobian(inputs, "derivative")


def _build(f: Callable, engine: Any, inner: Any, inputs: Inputs) -> Callable:
    def run(x, tangents, contexts):
        y, dy = engine.derivative(lambda u: f(u, *contexts), x)
        return {"value": y, "derivative": dy}

    return run


register_family(Family("derivative", _check, _build))


def prepare_derivative(
    f: Callable,
    backend: Any,
    x: Any,
    *contexts: Any,
    batch_axis: int | None = None,
    has_aux: bool = False,
    holomorphic: bool = False,
    wrt: Any = None,
) -> Prep:
    return prepare(
        "derivative",
        _declare(f, holomorphic),
        backend,
        x,
        None,
        contexts,
        batch_axis=batch_axis,
        has_aux=has_aux,
        wrt=wrt,
    )


def prepare_value_and_derivative(
    f: Callable,
    backend: Any,
    x: Any,
    *contexts: Any,
    batch_axis: int | None = None,
    has_aux: bool = False,
    holomorphic: bool = False,
    wrt: Any = None,
) -> Prep:
    """Compile ``value_and_derivative`` once for this signature (a ``derivative``-family prep)."""
    return prepare(
        "value_and_derivative",
        _declare(f, holomorphic),
        backend,
        x,
        None,
        contexts,
        batch_axis=batch_axis,
        has_aux=has_aux,
        wrt=wrt,
    )


def derivative(
    f: Callable,
    backend: Any,
    x: Any,
    *contexts: Any,
    prep: Prep | None = None,
    batch_axis: int | None = None,
    has_aux: bool = False,
    holomorphic: bool = False,
    wrt: Any = None,
) -> Any:
    """``df/dx`` at scalar ``x``: shape ``y.shape``; ``(df/dx, aux)`` with ``has_aux``."""
    return call(
        "derivative",
        _declare(f, holomorphic),
        backend,
        x,
        None,
        contexts,
        prep,
        batch_axis=batch_axis,
        has_aux=has_aux,
        wrt=wrt,
    )


def value_and_derivative(
    f: Callable,
    backend: Any,
    x: Any,
    *contexts: Any,
    prep: Prep | None = None,
    batch_axis: int | None = None,
    has_aux: bool = False,
    holomorphic: bool = False,
    wrt: Any = None,
) -> tuple[Any, Any]:
    """``(f(x), df/dx)`` at scalar ``x``; ``((f(x), aux), df/dx)`` with ``has_aux``."""
    return call(
        "value_and_derivative",
        _declare(f, holomorphic),
        backend,
        x,
        None,
        contexts,
        prep,
        batch_axis=batch_axis,
        has_aux=has_aux,
        wrt=wrt,
    )
