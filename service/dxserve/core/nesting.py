"""Operators inside another transformation: ``jax.grad(lambda y: gradient(f, b, y) ...)``.

Called with traced inputs (a JAX tracer under ``jax.grad``, ``jvp``, ``vmap`` or
``jit``), an operator cannot run a program compiled for concrete arrays. When the
function and the backend's engines trace, the operator's own builder runs on the
tracers instead: the outer transformation sees the JAX expression the operator stands
for, differentiates it (the derivative of a gradient is an HVP, of a pushforward a
second-order pushforward), batches it and compiles it once with everything around it.
A prep, made for concrete arrays, is not used here.

A backend that cannot trace (finite differences of a numpy black box, a numpy plug-in
engine) runs outside the transformation instead: each result is the framework's
substitute (``Framework.substitute``), computed on concrete arrays by the operator
itself through ``BackendCaller``, its derivatives the next operators of the same
backend: the gradient's derivative is that backend's HVP, a pushforward's a
second-order pushforward, a pullback's the HVP of ``<c, f>``. A context the outer
transformation moves is differentiated too, through ``wrt`` (the gradient's derivative
in it: one HVP over x and that context). Up to second order of the function; past
that (and for the second derivatives of an array-valued function in a context) the
rules raise a ``TypeError`` naming the operator and the backend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from dxcontract.backends import Backend, FiniteDifferences, SecondOrder, backend_from_json
from dxcontract.errors import DxError, FunctionEvaluationError, UnsupportedOperatorError
from dxcontract.lru import LRU
from dxcontract.operators import OPERATORS, result_names, returned
from dxserve.core import holomorphic
from dxserve.core.backends import engines_for, refuse_low_precision, resolve_backend
from dxserve.core.backends.real_parts import has_complex
from dxserve.core.preparation import (
    BATCH_RESULTS,
    CACHE,
    FAMILIES,
    NOT_READY,
    Inputs,
    Prep,
    PrepCache,
    batch_points,
    check_batch_axis,
    normalize,
    over_points,
    primary,
    probe,
    refuse_aux,
    split_aux,
    tree_size,
    with_aux,
    with_cotangent,
)
from dxserve.core.preparation import call as call_prepared
from dxserve.core.wrt import refuse_cotangent, select
from dxserve.frameworks import Framework, framework_of


def call(
    operator: str, f: Callable, backend: Backend | str, x: Any, tangents: Sequence | None,
    contexts: Sequence, prep: Prep | None = None, cache: PrepCache = CACHE,
    batch_axis: int | None = None, has_aux: bool = False, wrt: Any = None,
    cotangent: Any = None,
) -> Any:
    """``preparation.call``, or ``traced_call`` when some input is traced: what every
    operator calls. Returns one result, or a tuple of them (DI's order; with ``has_aux``,
    JAX's shapes, see ``dxcontract.operators.returned``). ``wrt``: the arguments
    differentiated (``dxserve.core.wrt``; None: x). ``cotangent`` (the HVP family): f is
    array-valued and ``<cotangent, f>`` is differentiated (``preparation.with_cotangent``)."""
    if prep is not None and wrt is None and cotangent is None:  # its executable, straight
        ready = prep.ready.get(operator)
        if ready is not None:
            out = ready(f, backend, x, tangents, contexts, batch_axis, has_aux)
            if out is not NOT_READY:
                return out
    if wrt is not None:
        f, x, contexts = select(f, x, contexts, wrt)
    if cotangent is not None:
        refuse_cotangent(operator, has_aux)
        f, contexts = with_cotangent(f, x, contexts, cotangent)
    fw = framework_of(f)
    if not fw.is_traced((x, tangents, contexts)):
        return call_prepared(
            operator, f, backend, x, tangents, contexts, prep, cache, batch_axis, has_aux
        )
    out = traced_call(
        operator, f, backend_from_json(backend), x, tangents, contexts, fw, batch_axis, has_aux
    )
    return returned(OPERATORS[operator], out, has_aux)


def traced_call(
    operator: str, f: Callable, backend: Backend, x: Any, tangents: Sequence | None,
    contexts: Sequence, framework: Framework, batch_axis: int | None = None,
    has_aux: bool = False,
) -> tuple:
    """``operator``'s results (``result_names`` order: aux last with ``has_aux``) as traced
    values of ``framework``, for inputs of which some are traced."""
    family = OPERATORS[operator].family
    x, tangents, contexts = normalize(x, tangents, contexts)
    px, pt = x, tangents
    if batch_axis is not None:
        check_batch_axis(batch_axis)
        batch_points(x, tangents, framework)
        px = framework.tree_map(lambda v: v[0], x)
        pt = None if tangents is None else tuple(framework.tree_map(lambda v: v[0], t) for t in tangents)
    # probed on zeros of the traced shapes: a function that cannot trace is called on them
    traced, y = probe(
        f, concrete_zeros(framework, px), concrete_zeros(framework, contexts), framework
    )
    output = f  # the function the family differentiates
    if has_aux:
        refuse_aux(operator)
        y, _ = split_aux(f, y)
        output = primary(f)
    resolved = resolve_backend(backend, family, traced=traced, n=tree_size(framework, px),
                               m=tree_size(framework, y), framework=framework.name)
    engine, inner = engines_for(
        resolved, traced=traced, complex_numbers=has_complex(framework, px, y)
    )
    spec = FAMILIES[family]
    inputs = Inputs(px, pt, contexts, y, framework, holomorphic.is_declared(f))
    spec.check(inputs)
    if not (traced and engine.traces and (inner is None or inner.traces)):
        if has_aux:
            raise UnsupportedOperatorError(
                f"{operator} with backend {resolved.to_json()} and has_aux inside a "
                f"{framework.name} transformation: that backend does not trace this "
                "function, and its stand-in carries no aux; call it outside the "
                "transformation, or with a backend that traces",
                field="has_aux",
            )
        return _substitute(
            operator, f, backend, resolved, x, tangents, contexts, framework, batch_axis,
            traced, y,
        )
    engine.use(framework)
    if inner is not None:
        inner.use(framework)
    engine.prepare(family, output, inputs, None)
    build = spec.build(output, engine, inner, inputs)
    if has_aux:
        build = with_aux(build, f)
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
    results = result_names(OPERATORS[operator], has_aux)
    k = len(tangents or ())
    return tuple(
        _unstack(framework, out[name], k, axis) if name in BATCH_RESULTS else out[name]
        for name in results
    )


def _substitute(
    operator: str, f: Callable, backend: Backend, resolved: Backend, x: Any,
    tangents: tuple | None, contexts: tuple, framework: Framework, batch_axis: int | None,
    traced: bool, y: Any,
) -> tuple:
    """``operator``'s results computed outside the transformation (see the module's
    docstring), for a backend or a function that cannot trace."""
    where = f"{operator} with backend {resolved.to_json()}"
    substitute = getattr(framework, "substitute", None)
    if substitute is None:
        raise UnsupportedOperatorError(
            f"{where} was called inside a {framework.name} transformation, but that "
            "backend does not trace this function; call it outside the transformation",
            field="backend",
        )
    if OPERATORS[operator].family == "sparsity" or resolved.type == "sparse":
        raise UnsupportedOperatorError(
            f"{where} was called inside a {framework.name} transformation, but that "
            "backend does not trace this function and a sparse result cannot be computed "
            "outside it; call it outside the transformation, or use a dense backend",
            field="backend",
        )
    px = x if batch_axis is None else framework.tree_map(lambda v: v[0], x)
    refuse_low_precision(resolved, framework.leaves(px), traced=traced)
    caller = BackendCaller(f, backend, framework, where, traces=False, value_traces=traced)

    def one(x1: Any, t1: tuple | None, c: tuple) -> tuple:
        return substitute(operator, caller, x1, t1, c, y)

    if batch_axis is None:
        return one(x, tangents, contexts)
    return framework.vmap(one, in_axes=(0, None if tangents is None else 0, None))(
        x, tangents, contexts
    )


class BackendCaller:
    """``f``'s value and derivatives by dxserve's operators with one backend: the caller
    of ``dxcontract.jax_rules`` (value, value_and_gradient, batch_op).

    ``traces=False``: called on concrete arrays inside callbacks; ``traces=True``: on
    traced ones, the operators' own JAX expressions (function and backend trace).
    ``value_traces``: ``f`` itself traces, so its value is ``f`` called directly.
    Besides hvp, pushforward and pullback, ``batch_op`` serves the derivatives in x of
    the last two (``derivatives``): second order of an array-valued ``f``.
    """

    derivatives: dict[str, tuple[str, str]] = {  # noqa: RUF012 - read only
        "pushforward": ("pushforward_derivative", "pushforward_derivative_transpose"),
        "pullback": ("pullback_derivative", "pullback_derivative"),
    }

    def __init__(
        self, f: Callable, backend: Backend, framework: Framework, where: str, *,
        traces: bool, value_traces: bool,
    ) -> None:
        self.f, self.framework = f, framework
        # first-order operators take a SecondOrder backend's inner one, as DI does
        self.backend = backend
        self.first = backend.inner if isinstance(backend, SecondOrder) else backend
        self.traces, self.value_traces = traces, value_traces
        self.beyond = (
            f"{where}: inside a {framework.name} transformation this backend "
            "differentiates up to second order (the function's Hessian-vector products "
            "and second-order pushforwards); a third-order derivative (the derivative of "
            "an HVP or of a second derivative) is not available"
        )
        self.fixed = (
            f"{where}: inside a {framework.name} transformation the derivatives of this "
            "backend's pushforwards, pullbacks and HVPs with respect to a context are not "
            "available; differentiate that context together with x (wrt), or use a "
            "backend that traces the function"
        )

    def value(
        self, x: Any, contexts: tuple, batch_axis: int | None = None, wrt: Any = None
    ) -> Any:
        if self.value_traces and batch_axis is None:
            return self.f(x, *contexts)
        return call(
            "value", self.f, self.first, x, None, contexts, batch_axis=batch_axis, wrt=wrt
        )

    def value_and_gradient(
        self, x: Any, contexts: tuple, batch_axis: int | None = None, wrt: Any = None
    ) -> tuple[Any, Any]:
        return call(
            "value_and_gradient", self.f, self.first, x, None, contexts, batch_axis=batch_axis,
            wrt=wrt,
        )

    def batch_op(
        self, op: str, x: Any, tangents: list, contexts: tuple, batch_axis: int | None = None,
        wrt: Any = None,
    ) -> list:
        """``op`` at x for each tangent; the derivative maps find the map's own tangent
        (or cotangent) first among ``contexts``. ``wrt``: the arguments differentiated
        (hvp, pushforward and pullback; the derivative maps are asked in x alone)."""
        if not tangents:
            return []
        tangents = tuple(tangents)
        if op in ("hvp", "pushforward", "pullback"):
            backend = self.backend if op == "hvp" else self.first
            return list(call(
                op, self.f, backend, x, tangents, contexts, batch_axis=batch_axis, wrt=wrt
            ))
        if wrt is not None and wrt != 0:
            raise TypeError(self.beyond)
        head, rest = contexts[0], tuple(contexts[1:])
        if op == "pullback_derivative":  # s -> H s, H the Hessian of <c, f> (c: head)
            return list(call(
                "hvp", self._helper("dot"), self.backend, x, tangents, (head, *rest),
                batch_axis=batch_axis,
            ))
        if op == "pushforward_derivative":  # s -> d/ds (J(x) t): the pushforward of x -> J(x) t
            backend = _coarser(self.first, self.framework.leaves(x)[0].dtype)
            return list(call(
                "pushforward", self._helper("push", backend), backend, x, tangents,
                (head, *rest), batch_axis=batch_axis,
            ))
        if op == "pushforward_derivative_transpose":  # w -> H t, H the Hessian of <w, f>
            return [self._cotangent_hvp(x, head, w, rest, batch_axis) for w in tangents]
        raise ValueError(f"no operator {op!r}")

    def _cotangent_hvp(
        self, x: Any, t: Any, w: Any, contexts: tuple, batch_axis: int | None
    ) -> Any:
        dot = self._helper("dot")
        if batch_axis is None:
            return call("hvp", dot, self.backend, x, (t,), (w, *contexts))[0]
        # w (a context of <w, f>) differs per point: one call per point
        fw = self.framework
        count = np.shape(fw.leaves(x)[0])[0]
        outs = [
            call(
                "hvp", dot, self.backend, fw.tree_map(lambda v, i=i: v[i], x), (t,),
                (fw.tree_map(lambda v, i=i: v[i], w), *contexts),
            )[0]
            for i in range(count)
        ]
        return fw.tree_map(lambda *vs: np.stack([np.asarray(v) for v in vs]), *outs)

    def _helper(self, kind: str, backend: Backend | None = None) -> Callable:
        """``<c, f(u)>`` (``dot``) or ``J(u) t`` by ``backend`` (``push``) as functions
        ``(u, c_or_t, *contexts)``, one object per (f, backend) so that their preps are
        cached."""
        key = (kind, self.f, backend)
        found = _HELPERS.get(key)
        if found is None:
            found = (_dot_of if kind == "dot" else _push_of)(self.f, backend, self.framework)
            _HELPERS.put(key, found)
        return found


def _coarser(backend: Backend, dtype: Any) -> Backend:
    """``backend`` for differences of differences: a finite-difference step left to its
    default coarsens to eps^(1/4) (central) or eps^(1/3) (forward), so the two
    truncation errors balance the rounding, as ``SecondOrder(fd, fd)`` does."""
    if not isinstance(backend, FiniteDifferences) or backend.step is not None:
        return backend
    eps = float(np.finfo(dtype).eps)
    return replace(backend, step=eps ** (1 / 4 if backend.method == "central" else 1 / 3))


#: The helper functions of ``BackendCaller`` (few: one pair per function and backend
#: differentiated to second order inside a transformation).
_HELPERS: LRU[tuple, Callable] = LRU(64)


def _dot_of(f: Callable, backend: Backend | None, framework: Framework) -> Callable:
    def dot(u: Any, c: Any, *contexts: Any) -> Any:
        y = f(u, *contexts)
        return sum(
            (a * b).sum() for a, b in zip(framework.leaves(c), framework.leaves(y), strict=True)
        )

    return dot


def _push_of(f: Callable, backend: Backend, framework: Framework) -> Callable:
    def push(u: Any, t: Any, *contexts: Any) -> Any:
        # concrete arrays only (a traced u raises here, so the probe finds a black box)
        u, t = (framework.tree_map(np.asarray, v) for v in (u, t))
        return call("pushforward", f, backend, u, (t,), contexts)[0]

    return push


def concrete_zeros(framework: Framework, tree: Any) -> Any:
    """Concrete numpy zeros shaped like ``tree``'s traced leaves; other leaves as they are."""
    return framework.tree_map(
        lambda v: np.zeros(v.shape, v.dtype) if framework.is_traced(v) else v, tree
    )


def _stack(framework: Framework, tangents: tuple, axis: int) -> Any:
    return framework.tree_map(lambda *leaves: framework.xp.stack(leaves, axis=axis), *tangents)


def _unstack(framework: Framework, batch: Any, k: int, axis: int) -> tuple:
    take = (lambda v, i: v[i]) if axis == 0 else (lambda v, i: v[:, i])
    return tuple(framework.tree_map(lambda v, i=i: take(v, i), batch) for i in range(k))


