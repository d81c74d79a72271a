"""second_derivative: ``f''(x)`` for scalar x, as outer-derivative of inner-derivative."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dxserve.core.holomorphic import maybe as _declare
from dxserve.core.nesting import call
from dxserve.core.operators import _checks
from dxserve.core.preparation import Family, Inputs, Prep, prepare, register_family


def _check(inputs: Inputs) -> None:
    _checks.scalar_input(inputs, "second_derivative")
    _checks.differentiable_x(inputs)
    _checks.complex_jacobian(inputs, "second_derivative")


def _build(f: Callable, outer: Any, inner: Any, inputs: Inputs) -> Callable:
    def run(x, tangents, contexts):
        def g(u):
            return f(u, *contexts)

        dy, d2y = outer.derivative(lambda u: inner.derivative(g, u)[1], x)
        return {"value": g(x), "derivative": dy, "second_derivative": d2y}

    return run


register_family(Family("second_derivative", _check, _build))


def prepare_second_derivative(
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
        "second_derivative",
        _declare(f, holomorphic),
        backend,
        x,
        None,
        contexts,
        batch_axis=batch_axis,
        has_aux=has_aux,
        wrt=wrt,
    )


def prepare_value_derivative_and_second_derivative(
    f: Callable,
    backend: Any,
    x: Any,
    *contexts: Any,
    batch_axis: int | None = None,
    has_aux: bool = False,
    holomorphic: bool = False,
    wrt: Any = None,
) -> Prep:
    """Compile ``value_derivative_and_second_derivative`` once for this signature (a ``second_derivative``-family prep)."""
    return prepare(
        "value_derivative_and_second_derivative",
        _declare(f, holomorphic),
        backend,
        x,
        None,
        contexts,
        batch_axis=batch_axis,
        has_aux=has_aux,
        wrt=wrt,
    )


def second_derivative(
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
    """``d²f/dx²`` at scalar ``x``: shape ``y.shape``; ``(d²f/dx², aux)`` with ``has_aux``."""
    return call(
        "second_derivative",
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


def value_derivative_and_second_derivative(
    f: Callable,
    backend: Any,
    x: Any,
    *contexts: Any,
    prep: Prep | None = None,
    batch_axis: int | None = None,
    has_aux: bool = False,
    holomorphic: bool = False,
    wrt: Any = None,
) -> tuple[Any, Any, Any]:
    """``(f(x), f'(x), f''(x))`` at scalar ``x``; ``((f(x), aux), f'(x), f''(x))`` with
    ``has_aux``."""
    return call(
        "value_derivative_and_second_derivative",
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
