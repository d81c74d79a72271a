"""jacobian: ``J = ∂f/∂x`` with JAX's shape ``y.shape + x.shape``.

Forward mode stacks JVPs of input basis vectors (columns), reverse mode VJPs of
output basis vectors (rows), ``batch_size`` of them per vectorized call.
For pytree x or f(x) the result is ``jax.jacobian``'s: f(x)'s structure whose every
leaf is an x-structured tree of blocks ``y_leaf.shape + x_leaf.shape``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dxserve.core.holomorphic import maybe as _declare
from dxserve.core.nesting import call
from dxserve.core.operators import _checks
from dxserve.core.preparation import Family, Inputs, Prep, prepare, register_family


def _check(inputs: Inputs) -> None:
    # pytree x and y are served: blocks nested as jax.jacobian nests them
    _checks.differentiable_x(inputs)
    _checks.complex_jacobian(inputs, "jacobian")


def _build(f: Callable, engine: Any, inner: Any, inputs: Inputs) -> Callable:
    def run(x, tangents, contexts):
        y, jac = engine.jacobian(lambda u: f(u, *contexts), x)
        return {"value": y, "jacobian": jac}

    return run


register_family(Family("jacobian", _check, _build))


def prepare_jacobian(
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
        "jacobian",
        _declare(f, holomorphic),
        backend,
        x,
        None,
        contexts,
        batch_axis=batch_axis,
        has_aux=has_aux,
        wrt=wrt,
    )


def prepare_value_and_jacobian(
    f: Callable,
    backend: Any,
    x: Any,
    *contexts: Any,
    batch_axis: int | None = None,
    has_aux: bool = False,
    holomorphic: bool = False,
    wrt: Any = None,
) -> Prep:
    """Compile ``value_and_jacobian`` once for this signature (a ``jacobian``-family prep)."""
    return prepare(
        "value_and_jacobian",
        _declare(f, holomorphic),
        backend,
        x,
        None,
        contexts,
        batch_axis=batch_axis,
        has_aux=has_aux,
        wrt=wrt,
    )


def jacobian(
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
    """``∂f/∂x``: shape ``y.shape + x.shape``; ``(∂f/∂x, aux)`` with ``has_aux``
    (``jax.jacrev(has_aux=True)``)."""
    return call(
        "jacobian",
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


def value_and_jacobian(
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
    """``(f(x), ∂f/∂x)``; ``((f(x), aux), ∂f/∂x)`` with ``has_aux``."""
    return call(
        "value_and_jacobian",
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
