"""Which backend ``Auto`` picks and why, and what to say when a mode does not trace.

``resolve`` names the concrete backend an operator would use; ``trace_error`` says why
a backend's transformation of f fails here (traced and lowered, nothing compiled or
run), which names, in preparation's errors, the backend that would work instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from dxcontract.backends import Auto, Backend, SecondOrder, backend_from_json
from dxcontract.errors import DxError, UnsupportedOperatorError
from dxcontract.operators import OPERATORS
from dxserve.core.backends import engines_for
from dxserve.core.backends.real_parts import has_complex
from dxserve.core.backends.selection import (
    auto_candidates,
    auto_rule,
    backend_name,
    candidates,
    mode_name,
)
from dxserve.core.preparation.batches import primary, split_aux
from dxserve.core.preparation.failures import _short
from dxserve.core.preparation.inputs import Tree, as_tree, probe, tree_size
from dxserve.core.preparation.prep import BATCH_RESULTS, FAMILIES, Inputs, packing
from dxserve.frameworks import Framework, framework_of


def _why(exc: BaseException, limit: int = 300) -> str:
    """The reason of a failed transformation, at most ``limit`` characters."""
    text = (exc.detail if isinstance(exc, DxError) else _short(exc)).strip().rstrip(".")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _name(f: Callable) -> str:
    return getattr(f, "__name__", type(f).__name__)


def _auto_reason(
    family: str,
    traced: bool,
    n: int,
    m: int,
    failed: list[tuple[Backend, str]],
    chosen: Backend,
    framework: str,
) -> str:
    """What ``Auto`` chose for ``family`` and why: its rule, or the modes that do not
    trace for this function and the one it uses instead."""
    if not failed:
        return auto_rule(family, traced=traced, n=n, m=m, framework=framework)
    grouped: list[tuple[list[str], str]] = []  # modes failing for one reason, together
    for choice, why in failed:
        if grouped and grouped[-1][1] == why:
            grouped[-1][0].append(mode_name(choice))
        else:
            grouped.append(([mode_name(choice)], why))
    skipped = "; ".join(
        f"{' and '.join(modes)} {'do' if len(modes) > 1 else 'does'} not trace: {why}"
        for modes, why in grouped
    )
    using = mode_name(chosen) if isinstance(chosen, SecondOrder) else backend_name(chosen)
    return f"{skipped}; using {using}"


def trace_error(
    f: Callable,
    backend: Backend,
    family: str,
    x: Tree,
    tangents: tuple | None,
    contexts: tuple,
    y: Tree,
    framework: Framework,
) -> str | None:
    """Why ``family`` of ``f`` does not trace with the concrete ``backend`` at these
    (one point's) inputs, or None when it does: the operator is built as preparation
    compiles it and lowered (``Framework.lower`` where the framework has one, else
    ``eval_shape``), nothing compiled or run. Lowered, not only traced: some refusals
    come at lowering (JAX's forward mode through a ``custom_vjp`` without a batch axis)."""
    try:
        engine, inner = engines_for(
            backend, traced=True, complex_numbers=has_complex(framework, x, y)
        )
        engine.use(framework)
        if inner is not None:
            inner.use(framework)
        run = FAMILIES[family].build(f, engine, inner, Inputs(x, tangents, contexts, y, framework))
        if tangents is not None and len(tangents) == 1:  # as ``Prep._compile`` builds it
            results = OPERATORS[family].results
            batched = tuple(i for i, name in enumerate(results) if name in BATCH_RESULTS)
            program = packing.single(_all_results(run, results), batched, None)
            args = (x, tangents[0], contexts)
        else:
            program, args = run, (x, packing.pack(tangents), contexts)
        lower = getattr(framework, "lower", None)
        (lower or framework.eval_shape)(program, *args)
    except Exception as exc:  # noqa: BLE001 - any failure is the reason
        return _why(exc)
    return None


def _all_results(run: Callable, results: tuple[str, ...]) -> Callable:
    """``run`` returning the tuple of ``results`` (what ``packing.single`` takes)."""

    def ordered(x: Tree, tangents: Tree, contexts: tuple) -> tuple:
        out = run(x, tangents, contexts)
        return tuple(out[name] for name in results)

    return ordered


def _cannot(
    exc: DxError,
    backend: Backend,
    resolved: Backend,
    f: Callable,
    family: str,
    x: Tree,
    tangents: tuple | None,
    contexts: tuple,
    y: Tree,
    framework: Framework,
) -> DxError:
    """The error for an explicit backend whose transformation of ``f`` failed: naming
    the backend, and the backend ``Auto`` would use instead where one traces."""
    n, m = tree_size(framework, x), tree_size(framework, y)
    other = None
    for choice in auto_candidates(family, traced=True, n=n, m=m, framework=framework.name):
        if (
            choice != resolved
            and trace_error(f, choice, family, x, tangents, contexts, y, framework) is None
        ):
            other = choice
            break
    if other is None:
        return exc
    asked = backend_name(backend)
    as_ = "" if backend == resolved else f" (as {backend_name(resolved)})"
    mode = f" ({mode_name(other)})" if isinstance(other, SecondOrder) else ""
    return UnsupportedOperatorError(
        f"{asked}{as_} cannot compute {family} of {_name(f)} here, {mode_name(resolved)} "
        f"does not trace: {_why(exc, 1000)}. Use '{backend_name(other)}'{mode}, or 'auto', "
        "which picks it",
        field="backend",
    )


def resolve(
    backend: Backend | str,
    operator: str,
    f: Callable,
    x: Any,
    *contexts: Any,
    has_aux: bool = False,
    explain: bool = False,
) -> Backend | tuple[Backend, str | None]:
    """The concrete descriptor ``operator`` would use (``Auto`` and DI's rule applied).
    ``has_aux``: f returns ``(output, aux)``, and output is what is weighed and traced.

    For ``Auto`` the operator is traced abstractly (nothing compiled or run) with each
    of its choices in turn until one traces (see ``selection.auto_candidates``), as
    preparation does. ``explain=True`` returns ``(descriptor, reason)``: for ``Auto``
    its rule, or the modes that do not trace and the one used instead; None for an
    explicit backend."""
    backend = backend_from_json(backend)
    op = OPERATORS[operator]
    x = as_tree(x)
    contexts = tuple(as_tree(c) for c in contexts)
    fw = framework_of(f)
    with fw.precision_scope():
        traced, y = probe(f, x, contexts, fw)
        if has_aux:
            y, f = split_aux(f, y)[0], primary(f)
        n, m = tree_size(fw, x), tree_size(fw, y)
        choices = candidates(backend, op.family, traced=traced, n=n, m=m, framework=fw.name)
        chosen, failed = choices[0], []
        if len(choices) > 1 and _checks(op.family, x, contexts, y, fw):
            tangents = _probe_tangents(op.family, x, y, fw)
            for choice in choices:
                why = (
                    None
                    if choice is choices[-1]
                    else trace_error(f, choice, op.family, x, tangents, contexts, y, fw)
                )
                if why is None:
                    chosen = choice
                    break
                failed.append((choice, why))
    if not explain:
        return chosen
    reason = (
        _auto_reason(op.family, traced, n, m, failed, chosen, fw.name)
        if isinstance(backend, Auto)
        else None
    )
    return chosen, reason


def _checks(family: str, x: Tree, contexts: tuple, y: Tree, framework: Framework) -> bool:
    """Do these inputs pass ``family``'s checks (with one tangent)? ``resolve`` traces
    only an operator that preparation would build."""
    tangents = _probe_tangents(family, x, y, framework)
    try:
        FAMILIES[family].check(Inputs(x, tangents, contexts, y, framework))
    except DxError:
        return False
    return True


def _probe_tangents(family: str, x: Tree, y: Tree, framework: Framework) -> tuple | None:
    """One tangent of zeros shaped as ``family``'s tangents are (like x or like y)."""
    like = OPERATORS[family].tangents_like
    if like is None:
        return None
    tree = x if like == "x" else y
    return (framework.tree_map(lambda v: np.zeros(np.shape(v), v.dtype), tree),)
