"""Operators inside another transformation: ``jax.grad(lambda y: gradient(f, b, y) ...)``.

Called with traced inputs (a JAX tracer under ``jax.grad``, ``jvp``, ``vmap`` or
``jit``), an operator cannot run a program compiled for concrete arrays. When the
function and the backend's engines trace, the operator's own builder runs on the
tracers instead: the outer transformation sees the JAX expression the operator stands
for, differentiates it (the derivative of a gradient is an HVP, of a pushforward a
second-order pushforward), batches it and compiles it once with everything around it.
A prep, made for concrete arrays, is not used here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dxcontract.backends import Backend, backend_from_json
from dxcontract.errors import DxError, FunctionEvaluationError, UnsupportedOperatorError
from dxcontract.operators import OPERATORS

from .backends import engines_for, resolve_backend
from .frameworks import Framework, framework_of
from .preparation import (
    BATCH_RESULTS,
    CACHE,
    FAMILIES,
    Inputs,
    Prep,
    PrepCache,
    batch_points,
    check_batch_axis,
    normalize,
    over_points,
    probe,
)
from .preparation import call as call_prepared


def call(
    operator: str, f: Callable, backend: Backend | str, x: Any, tangents: Sequence | None,
    contexts: Sequence, prep: Prep | None = None, cache: PrepCache = CACHE,
    batch_axis: int | None = None,
) -> Any:
    """``preparation.call``, or ``traced_call`` when some input is traced: what every
    operator calls. Returns one result, or a tuple of them (DI's order)."""
    fw = framework_of(f)
    if not fw.is_traced((x, tangents, contexts)):
        return call_prepared(operator, f, backend, x, tangents, contexts, prep, cache, batch_axis)
    out = traced_call(
        operator, f, backend_from_json(backend), x, tangents, contexts, fw, batch_axis
    )
    return out[0] if len(out) == 1 else out


def traced_call(
    operator: str, f: Callable, backend: Backend, x: Any, tangents: Sequence | None,
    contexts: Sequence, framework: Framework, batch_axis: int | None = None,
) -> tuple:
    """``operator``'s results (``OPERATORS[operator].results`` order) as traced values of
    ``framework``, for inputs of which some are traced."""
    family = OPERATORS[operator].family
    x, tangents, contexts = normalize(x, tangents, contexts)
    px, pt = x, tangents
    if batch_axis is not None:
        check_batch_axis(batch_axis)
        batch_points(x, tangents, framework)
        px = framework.tree_map(lambda v: v[0], x)
        pt = None if tangents is None else tuple(framework.tree_map(lambda v: v[0], t) for t in tangents)
    # probed on zeros of the traced shapes: a function that cannot trace is called on them
    traced, y = probe(f, _zeros(framework, px), _zeros(framework, contexts), framework)
    resolved = resolve_backend(backend, family, traced=traced, n=_size(framework, px),
                               m=_size(framework, y), framework=framework.name)
    engine, inner = engines_for(resolved, traced=traced)
    if not (traced and engine.traces and (inner is None or inner.traces)):
        raise UnsupportedOperatorError(
            f"{operator} with backend {resolved.to_json()} was called inside a "
            f"{framework.name} transformation, but that backend does not trace this "
            "function; call it outside the transformation, or wrap the function in "
            "dxserve.DifferentiateWith(f, backend) and use a tracing backend outside",
            field="backend",
        )
    engine.use(framework)
    if inner is not None:
        inner.use(framework)
    spec = FAMILIES[family]
    inputs = Inputs(px, pt, contexts, y, framework)
    spec.check(inputs)
    engine.prepare(family, f, inputs, None)
    build = spec.build(f, engine, inner, inputs)
    if batch_axis is not None:
        build = over_points(build, tangents is not None, framework)
    axis = 0 if batch_axis is None else 1
    packed = None if tangents is None else _stack(framework, tangents, axis)
    try:
        out = build(x, packed, contexts)
    except DxError:
        raise
    except Exception as exc:  # an engine's trace failing is the operator's, not the user's
        raise FunctionEvaluationError(
            f"{operator} with backend {resolved.to_json()} failed inside a "
            f"{framework.name} transformation: {type(exc).__name__}: {exc}"[:500],
            field="backend",
        ) from exc
    results = OPERATORS[operator].results
    k = len(tangents or ())
    return tuple(
        _unstack(framework, out[name], k, axis) if name in BATCH_RESULTS else out[name]
        for name in results
    )


def _zeros(framework: Framework, tree: Any) -> Any:
    """Concrete numpy zeros shaped like ``tree``'s traced leaves; other leaves as they are."""
    return framework.tree_map(
        lambda v: np.zeros(v.shape, v.dtype) if framework.is_traced(v) else v, tree
    )


def _stack(framework: Framework, tangents: tuple, axis: int) -> Any:
    return framework.tree_map(lambda *leaves: framework.xp.stack(leaves, axis=axis), *tangents)


def _unstack(framework: Framework, batch: Any, k: int, axis: int) -> tuple:
    take = (lambda v, i: v[i]) if axis == 0 else (lambda v, i: v[:, i])
    return tuple(framework.tree_map(lambda v, i=i: take(v, i), batch) for i in range(k))


def _size(framework: Framework, tree: Any) -> int:
    return sum(math.prod(leaf.shape) for leaf in framework.leaves(tree))
