"""hessian: ``∇²f(x)`` of a scalar-valued f, shape ``x.shape + x.shape``.

Batched HVPs over the input basis: the outer mode's Jacobian of the inner mode's
gradient, ``batch_size`` basis tangents per vectorized call. For a pytree x the
result is ``jax.hessian``'s blocks: ``H[p][q]`` of shape ``x[p].shape + x[q].shape``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dxserve.core.holomorphic import maybe as _declare
from dxserve.core.nesting import call
from dxserve.core.operators import _checks
from dxserve.core.preparation import Family, Inputs, Prep, prepare, register_family


def _check(inputs: Inputs) -> None:
    _checks.scalar_output(inputs, "hessian")  # any pytree x: jax.hessian's blocks
    _checks.differentiable_x(inputs)
    _checks.complex_jacobian(inputs, "hessian")
    _checks.holomorphic_gradient(inputs, "hessian")


def _build(f: Callable, outer: Any, inner: Any, inputs: Inputs) -> Callable:
    def run(x, tangents, contexts):
        def g(u):
            return f(u, *contexts)

        grad, hess = outer.jacobian(lambda u: inner.gradient(g, u)[1], x)
        return {"value": g(x), "gradient": grad, "hessian": hess}

    return run


register_family(Family("hessian", _check, _build))


def prepare_hessian(
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
        "hessian",
        _declare(f, holomorphic),
        backend,
        x,
        None,
        contexts,
        batch_axis=batch_axis,
        has_aux=has_aux,
        wrt=wrt,
    )


def prepare_value_gradient_and_hessian(
    f: Callable,
    backend: Any,
    x: Any,
    *contexts: Any,
    batch_axis: int | None = None,
    has_aux: bool = False,
    holomorphic: bool = False,
    wrt: Any = None,
) -> Prep:
    """Compile ``value_gradient_and_hessian`` once for this signature (a ``hessian``-family prep)."""
    return prepare(
        "value_gradient_and_hessian",
        _declare(f, holomorphic),
        backend,
        x,
        None,
        contexts,
        batch_axis=batch_axis,
        has_aux=has_aux,
        wrt=wrt,
    )


def hessian(
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
    """``∇²f(x)``: shape ``x.shape + x.shape``; ``(∇²f(x), aux)`` with ``has_aux``
    (``jax.hessian(has_aux=True)``)."""
    return call(
        "hessian",
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


def value_gradient_and_hessian(
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
    """``(f(x), ∇f(x), ∇²f(x))``; ``((f(x), aux), ∇f(x), ∇²f(x))`` with ``has_aux``."""
    return call(
        "value_gradient_and_hessian",
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
