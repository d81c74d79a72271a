"""gradient: ``∇f(x)`` for scalar-valued f; the result has x's structure.

Reverse mode takes one VJP; forward mode one JVP per input entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dxserve.core.nesting import call
from dxserve.core.operators import _checks
from dxserve.core.preparation import Family, Inputs, Prep, prepare, register_family


def _check(inputs: Inputs) -> None:
    _checks.scalar_output(inputs, "gradient")
    _checks.differentiable_x(inputs)
    _checks.holomorphic_gradient(inputs, "gradient")


def _build(f: Callable, engine: Any, inner: Any, inputs: Inputs) -> Callable:
    def run(x, tangents, contexts):
        y, grad = engine.gradient(lambda u: f(u, *contexts), x)
        return {"value": y, "gradient": grad}

    return run


register_family(Family("gradient", _check, _build))


def prepare_gradient(
    f: Callable, backend: Any, x: Any, *contexts: Any,
    batch_axis: int | None = None, has_aux: bool = False, wrt: Any = None,
) -> Prep:
    return prepare(
        "gradient", f, backend, x, None, contexts, batch_axis=batch_axis, has_aux=has_aux, wrt=wrt
    )


def prepare_value_and_gradient(
    f: Callable, backend: Any, x: Any, *contexts: Any,
    batch_axis: int | None = None, has_aux: bool = False, wrt: Any = None,
) -> Prep:
    """Compile ``value_and_gradient`` once for this signature (a ``gradient``-family prep)."""
    return prepare(
        "value_and_gradient", f, backend, x, None, contexts, batch_axis=batch_axis, has_aux=has_aux, wrt=wrt
    )


def gradient(
    f: Callable, backend: Any, x: Any, *contexts: Any,
    prep: Prep | None = None, batch_axis: int | None = None,
    has_aux: bool = False, wrt: Any = None,
) -> Any:
    """``∇f(x)``: x's structure, shapes and dtypes.

    ``has_aux``: f returns ``(y, aux)``; ``(∇y(x), aux)`` as ``jax.grad(has_aux=True)``."""
    return call(
        "gradient", f, backend, x, None, contexts, prep, batch_axis=batch_axis, has_aux=has_aux, wrt=wrt
    )


def value_and_gradient(
    f: Callable, backend: Any, x: Any, *contexts: Any,
    prep: Prep | None = None, batch_axis: int | None = None,
    has_aux: bool = False, wrt: Any = None,
) -> tuple[Any, Any]:
    """``(f(x), ∇f(x))``.

    ``has_aux``: f returns ``(y, aux)``; ``((y, aux), ∇y(x))`` as
    ``jax.value_and_grad(has_aux=True)``."""
    return call(
        "value_and_gradient", f, backend, x, None, contexts, prep,
        batch_axis=batch_axis, has_aux=has_aux, wrt=wrt,
    )
