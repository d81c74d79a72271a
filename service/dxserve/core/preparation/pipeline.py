"""Prepare: probe, resolve, validate, build and compile an operator for one signature.

``prepare(operator, f, backend, x, tangents, contexts)`` probes the function,
resolves the backend (``Auto`` tries its choices in turn until one compiles),
validates the inputs and bounds the result's size, builds the operator's function
and compiles it into a ``Prep``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from dxcontract.backends import Auto, Backend, backend_from_json
from dxcontract.errors import (
    DxError,
    FunctionEvaluationError,
    InvalidArgumentError,
    ResultTooLargeError,
    UnsupportedOperatorError,
)
from dxcontract.operators import OPERATORS
from dxserve.core import holomorphic
from dxserve.core.backends import engines_for, refuse_low_precision
from dxserve.core.backends.engine import Engine
from dxserve.core.backends.real_parts import ComplexRefused, has_complex
from dxserve.core.backends.selection import candidates
from dxserve.core.chunking import chunker_for, slicer_for
from dxserve.core.limits import ComputeLimits
from dxserve.core.preparation.batches import (
    _first_point,
    batch_points,
    check_batch_axis,
    over_points,
    primary,
    refuse_aux,
    split_aux,
    with_aux,
    with_cotangent,
)
from dxserve.core.preparation.explain import _auto_reason, _cannot, _name, _why
from dxserve.core.preparation.inputs import (
    Tree,
    _extent,
    _signature_of,
    normalize,
    probe,
    tree_size,
)
from dxserve.core.preparation.prep import FAMILIES, Inputs, Prep
from dxserve.core.wrt import refuse_cotangent, select
from dxserve.frameworks import Framework, framework_of

if TYPE_CHECKING:
    from dxserve.core.preparation.cache import PrepCache


_log = logging.getLogger("dxserve.compile")

#: Largest number of result elements one call may produce by default: a Jacobian or
#: Hessian grows with n², and an out-of-memory device is worse than a clear 422.
MAX_RESULT_ELEMENTS = 2**27


def _check_result_size(
    family: str,
    inputs: Inputs,
    limit: int,
    engine: Engine | None = None,
    points: int = 1,
    aux: Tree = None,
) -> int:
    """The number of results ``family`` returns here (``ResultTooLargeError`` past ``limit``).

    ``engine`` may count them itself (a sparse Jacobian holds nnz numbers, not m * n).
    ``inputs`` are one point's; ``points`` of them are computed (a batch counts whole).
    ``aux``: the spec of a has_aux function's auxiliary output, returned too."""
    n, m = tree_size(inputs.framework, inputs.x), tree_size(inputs.framework, inputs.y)
    k = len(inputs.tangents or ())
    counted = engine.result_elements(family, n, m, k) if engine is not None else None
    elements = OPERATORS[family].result_elements(n, m, k) if counted is None else counted
    # The same rule over the nominal sizes (zero dimensions as ones), so zero-size
    # inputs with huge dimensions are refused here, before XLA lays out their shapes.
    extent = (
        elements
        if counted is not None
        else OPERATORS[family].result_elements(
            _extent(inputs.framework, inputs.x), _extent(inputs.framework, inputs.y), k
        )
    )
    if aux is not None:
        elements += tree_size(inputs.framework, aux)
        extent += _extent(inputs.framework, aux)
    elements, extent = elements * points, extent * points
    if points > 1 and elements > limit:
        raise ResultTooLargeError(
            f"{family} of a batch of {points:,} points (batch_axis=0) would return "
            f"{elements:,} numbers ({elements // points:,} per point), over the limit of "
            f"{limit:,}; send at most {max(1, limit // max(1, elements // points)):,} points "
            "per request, or raise DXSERVE_MAX_RESULT_ELEMENTS",
            field="x",
        )
    if elements <= limit < extent:
        raise ResultTooLargeError(
            f"{family} here would return zero-size arrays whose other dimensions span "
            f"{extent:,} elements, over the limit of {limit:,}",
            field="x",
        )
    if elements > limit:
        raise ResultTooLargeError(
            f"{family} here would return {elements:,} numbers, over the limit of "
            f"{limit:,}; use pushforward/pullback/hvp on fewer tangents, "
            "or raise DXSERVE_MAX_RESULT_ELEMENTS",
            field="x",
        )
    return elements


def prepare(
    operator: str,
    f: Callable,
    backend: Backend | str,
    x: Any,
    tangents: Sequence | None,
    contexts: Sequence,
    cache: PrepCache | None = None,
    max_result_elements: int | None = None,
    limits: ComputeLimits | None = None,
    batch_axis: int | None = None,
    has_aux: bool = False,
    wrt: Any = None,
    cotangent: Any = None,
) -> Prep:
    """Probe, resolve, validate, build and compile ``operator`` for these inputs.

    With a ``cache``, backends that resolve to the same concrete one (``"auto"``
    and ``SecondOrder(JaxForward(), JaxReverse())`` for an HVP, say) share one
    compiled executable. Float64 inputs trace and compile in float64.
    ``max_result_elements`` defaults to ``MAX_RESULT_ELEMENTS``. ``limits``: per-request
    bounds on XLA's estimate of each compiled executable (None: unbounded, the library's
    default; the server passes its settings). ``batch_axis=0``: x's leaves and the
    tangents' lead with an axis of B points, results come back stacked as (B, ...).
    ``has_aux``: f returns ``(output, aux)``; ``output`` is differentiated and aux
    returned as the last result. ``wrt``: the arguments differentiated (``dxserve.core.wrt``;
    None: x); the prep is made for their ``Selected`` function, which later calls with
    the same ``wrt`` find again.
    """
    if wrt is not None:
        f, x, contexts = select(f, x, contexts, wrt)
    if cotangent is not None:  # the HVP family: <cotangent, f> (see ``wrt``)
        refuse_cotangent(operator, has_aux)
        f, contexts = with_cotangent(f, x, contexts, cotangent)
    if max_result_elements is None:
        max_result_elements = MAX_RESULT_ELEMENTS
    backend = backend_from_json(backend)  # parsed here, once: below it is a descriptor
    with framework_of(f).precision_scope():
        return _prepare(
            operator,
            f,
            backend,
            x,
            tangents,
            contexts,
            cache,
            max_result_elements,
            limits,
            batch_axis,
            has_aux,
        )


def _prepare(
    operator: str,
    f: Callable,
    backend: Backend,
    x: Any,
    tangents: Sequence | None,
    contexts: Sequence,
    cache: PrepCache | None,
    max_result_elements: int,
    limits: ComputeLimits | None = None,
    batch_axis: int | None = None,
    has_aux: bool = False,
) -> Prep:
    family = OPERATORS[operator].family
    fw = framework_of(f)
    x, tangents, contexts = normalize(x, tangents, contexts)
    points, px, pt = 1, x, tangents  # one point's x and tangents: what is checked and built
    if batch_axis is not None:
        check_batch_axis(batch_axis)
        points = batch_points(x, tangents, fw)
        px = _first_point(fw, x)
        pt = None if tangents is None else tuple(_first_point(fw, t) for t in tangents)
    traced, y = probe(f, px, contexts, fw)
    aux, output = None, f  # output: the function the family differentiates
    if has_aux:
        refuse_aux(operator)
        y, aux = split_aux(f, y)
        output = primary(f)
    n, m = tree_size(fw, px), tree_size(fw, y)
    choices = candidates(backend, family, traced=traced, n=n, m=m, framework=fw.name)
    failed: list[tuple[Backend, str]] = []  # Auto's choices whose transformation failed
    for i, resolved in enumerate(choices):
        reason = (
            _auto_reason(family, traced, n, m, failed, resolved, fw.name)
            if isinstance(backend, Auto)
            else None
        )
        try:
            prep = _prepare_with(
                resolved,
                operator,
                f,
                backend,
                x,
                tangents,
                contexts,
                cache,
                max_result_elements,
                limits,
                batch_axis,
                traced,
                points,
                px,
                pt,
                y,
                reason,
                has_aux,
                aux,
                output,
            )
        except _TransformFailed as failure:
            exc = failure.error
            if len(choices) == 1 and traced and resolved.type != "sparse":
                named = _cannot(exc, backend, resolved, f, family, px, pt, contexts, y, fw)
                if named is not exc:
                    raise named from exc
            if len(choices) == 1 or i == len(choices) - 1:
                raise exc from exc.__cause__  # as compiling raised it, from JAX's error
            failed.append((resolved, _why(exc)))
            continue
        if failed:
            _log.info(
                "auto for %s of %s: %s",
                operator,
                _name(f),
                reason,
                extra={
                    "event": "auto_fallback",
                    "operator": operator,
                    "function": _name(f),
                    "backend": resolved.to_json(),
                },
            )
        return prep
    raise AssertionError("unreachable: the last choice returns or raises")


def _prepare_with(
    resolved: Backend,
    operator: str,
    f: Callable,
    backend: Backend,
    x: Tree,
    tangents: tuple | None,
    contexts: tuple,
    cache: PrepCache | None,
    max_result_elements: int,
    limits: ComputeLimits | None,
    batch_axis: int | None,
    traced: bool,
    points: int,
    px: Tree,
    pt: tuple | None,
    y: Tree,
    reason: str | None,
    has_aux: bool = False,
    aux: Tree = None,
    output: Callable | None = None,
) -> Prep:
    """``_prepare`` with the concrete backend ``resolved``: check, build and compile
    (``_TransformFailed`` when compiling fails); ``reason``: why it was chosen. With
    ``has_aux``, ``output`` is the function differentiated and ``aux`` its aux's spec."""
    output = f if output is None else output
    family = OPERATORS[operator].family
    fw = framework_of(f)
    if batch_axis is not None and (family == "sparsity" or resolved.type == "sparse"):
        raise InvalidArgumentError(
            f"batch_axis is not supported for sparse {family} (a sparse result per point); "
            "send the points one by one or use a dense backend",
            field="batch_axis",
        )
    if has_aux and resolved.type == "sparse":
        raise UnsupportedOperatorError(
            f"has_aux is not supported with a sparse {family}: the pattern is detected on "
            "the registered function itself, whose output here is a pair; use a dense "
            "backend, or take the aux from value with has_aux",
            field="has_aux",
        )
    # complex x or f(x): every engine in JAX's convention (or refusing)
    engine, inner = engines_for(resolved, traced=traced, complex_numbers=has_complex(fw, px, y))
    engine.use(fw)
    if inner is not None:
        inner.use(fw)
    spec = FAMILIES[family]
    inputs = Inputs(px, pt, contexts, y, fw, holomorphic.is_declared(f))
    spec.check(inputs)
    refuse_low_precision(resolved, fw.leaves(px), traced=traced)
    engine.prepare(family, output, inputs, limits)  # e.g. sparsity detection and colouring
    elements = _check_result_size(family, inputs, max_result_elements, engine, points, aux)
    signature = _signature_of(x, tangents, contexts, batch_axis, has_aux)
    twin_key = (f, operator, resolved, signature)
    twin = cache.get_resolved(twin_key) if cache is not None else None
    if twin is not None:
        return replace(twin, backend=backend, reason=reason, ready={})
    compiled = traced and engine.traces and (inner is None or inner.traces)
    runs_in = fw if compiled else fw.eager()
    build = spec.build(output, engine, inner, inputs)
    if has_aux:
        build = with_aux(build, f)
    if batch_axis is not None:
        build = over_points(build, tangents is not None, runs_in)
        y = fw.tree_map(lambda s: fw.spec((points, *s.shape), s.dtype), y)
    chunker = chunker_for(
        family,
        output,
        engine,
        inner,
        px,
        inputs.y,
        compiled,
        batch_axis is not None,
        limits,
        runs_in,
    ) or slicer_for(
        family, compiled, batch_axis is not None, points, len(tangents or ()), limits, runs_in
    )
    prep = Prep(
        operator,
        f,
        backend,
        resolved,
        signature,
        y,
        build,
        engine,
        compiled,
        limits=limits,
        result_bytes=elements * _itemsize(fw, x),
        chunker=chunker,
        framework=runs_in,
        reason=reason,
    )
    try:
        prep.executable(operator, x, tangents, contexts)
    except ComplexRefused:
        raise  # the backend's answer to complex numbers: no other mode is tried or named
    except (FunctionEvaluationError, UnsupportedOperatorError) as exc:
        raise _TransformFailed(exc) from exc  # the transformation failed, not the checks
    if cache is not None:
        cache.put_resolved(twin_key, prep)
    return prep


class _TransformFailed(Exception):
    """Compiling the operator failed (``error``): the backend's transformation of the
    function, not the checks of its inputs."""

    def __init__(self, error: DxError) -> None:
        super().__init__(error)
        self.error = error


def _itemsize(framework: Framework, tree: Tree) -> int:
    """Bytes per result element: results take the input's dtype (8 if that is unknown)."""
    sizes = [getattr(getattr(v, "dtype", None), "itemsize", 8) for v in framework.leaves(tree)]
    return max(sizes, default=8)
