"""hvp: Hessian-vector products ``(H t1, ..., H tk)`` of a scalar-valued f.

The outer mode differentiates the inner mode's gradient. Because H is symmetric,
the outer mode may go in its own direction (``Engine.symmetric_products``): a forward outer takes JVPs of the
gradient (forward-over-reverse, the default: about 2-3 gradients' cost), a
reverse outer takes VJPs of it (reverse-over-reverse).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dxserve.core.nesting import call
from dxserve.core.operators import _checks
from dxserve.core.preparation import Family, Inputs, Prep, prepare, register_family


def _check(inputs: Inputs) -> None:
    _checks.scalar_output(inputs, "hvp")
    _checks.differentiable_x(inputs)
    _checks.holomorphic_gradient(inputs, "hvp")
    _checks.tangents_like(inputs, inputs.x, "x")


def _build(f: Callable, outer: Any, inner: Any, inputs: Inputs) -> Callable:
    def run(x, tangents, contexts):
        def grad(u):
            return inner.gradient(lambda v: f(v, *contexts), u)[1]

        g, hvps = outer.over_batch(outer.symmetric_products, grad, x, tangents)
        return {"gradient": g, "hvps": hvps}

    return run


register_family(Family("hvp", _check, _build))


def prepare_hvp(
    f: Callable, backend: Any, x: Any, tangents: Sequence, *contexts: Any,
    batch_axis: int | None = None, has_aux: bool = False, wrt: Any = None,
    cotangent: Any = None,
) -> Prep:
    return prepare("hvp", f, backend, x, tangents, contexts, batch_axis=batch_axis, has_aux=has_aux, wrt=wrt, cotangent=cotangent)


def prepare_gradient_and_hvp(
    f: Callable, backend: Any, x: Any, tangents: Sequence, *contexts: Any,
    batch_axis: int | None = None, has_aux: bool = False, wrt: Any = None,
    cotangent: Any = None,
) -> Prep:
    """Compile ``gradient_and_hvp`` once for this signature (a ``hvp``-family prep)."""
    return prepare(
        "gradient_and_hvp", f, backend, x, tangents, contexts,
        batch_axis=batch_axis, has_aux=has_aux, wrt=wrt, cotangent=cotangent,
    )


def hvp(
    f: Callable, backend: Any, x: Any, tangents: Sequence, *contexts: Any,
    prep: Prep | None = None, batch_axis: int | None = None,
    has_aux: bool = False, wrt: Any = None,
    cotangent: Any = None,
) -> tuple:
    """``(∇²f(x) @ t for t in tangents)``: each has x's structure; ``(hvps, aux)`` with
    ``has_aux``. ``cotangent`` (shaped like an array-valued f's output): the HVPs of
    ``<cotangent, f>``, the derivative in x of f's pullback of it (a JVP of the VJP)."""
    return call(
        "hvp", f, backend, x, tangents, contexts, prep, batch_axis=batch_axis, has_aux=has_aux, wrt=wrt, cotangent=cotangent
    )


def gradient_and_hvp(
    f: Callable, backend: Any, x: Any, tangents: Sequence, *contexts: Any,
    prep: Prep | None = None, batch_axis: int | None = None,
    has_aux: bool = False, wrt: Any = None,
    cotangent: Any = None,
) -> tuple[Any, tuple]:
    """``(∇f(x), (∇²f(x) @ t for t in tangents))``; ``((∇f(x), hvps), aux)`` with ``has_aux``."""
    return call(
        "gradient_and_hvp", f, backend, x, tangents, contexts, prep,
        batch_axis=batch_axis, has_aux=has_aux, wrt=wrt, cotangent=cotangent,
    )
