"""Turn what the user asked for into concrete descriptors and engines, per operator.

``Auto()`` picks what each operator family's spec says (``OperatorSpec.auto``) among the
native modes of the function's framework (``jax-forward``/``jax-reverse`` for JAX,
``torch-forward``/``torch-reverse`` for torch): reverse for gradients and pullbacks,
forward for pushforwards and derivatives, forward vs reverse for Jacobians by comparing
sizes (forward when n = x.size ≤ m = y.size), and forward-over-reverse for second order
(``OperatorSpec.order``). A function its framework cannot trace, or a framework without
native modes, gets finite differences. Where the function traces but the chosen mode's
transformation of it does not (reverse mode through a ``lax.while_loop``, say),
preparation falls back along ``auto_candidates``: the framework's other mode, then finite
differences (second order: the other pairs of exact modes, then finite differences over
an exact gradient, then over finite differences). A single
first-order backend asked for a second-order operator follows DifferentiationInterface's
rule: a framework's native modes become forward-over-reverse (keeping the backend's
batch_size on the outer mode), any other backend ``b`` becomes ``SecondOrder(b, b)``
(finite differences over finite
differences, say).

A backend registered for one framework never differentiates another's functions: a
JAX mode named for a torch function (or the reverse) is refused, naming the backends
that fit.
"""

from __future__ import annotations

import json

from dxcontract.backends import Auto, Backend, FiniteDifferences, SecondOrder, Sparse
from dxcontract.errors import UnsupportedOperatorError
from dxcontract.operators import OPERATORS
from dxserve.core.backends import real_parts
from dxserve.core.backends.engine import Engine
from dxserve.core.backends.plugins import PLUGINS, fitting, native_modes
from dxserve.frameworks import DEFAULT

#: the families second-order backends serve (their specs say order 2)
SECOND_ORDER = tuple(name for name, op in OPERATORS.items() if op.family == name and op.order == 2)


def resolve_backend(
    backend: Backend, family: str, *, traced: bool, n: int = 0, m: int = 0,
    framework: str = DEFAULT,
) -> Backend:
    """The concrete descriptor used for ``family`` (never ``Auto``); ``backend`` is a
    descriptor, parsed where the call came in; ``framework``: the name of the function's
    framework (a backend of another framework is refused)."""
    if family == "sparsity" and backend.type != "sparse":  # the pattern: any backend's
        backend = Sparse(dense=backend)
    refuse_other_framework(backend, framework)
    plugin = PLUGINS.get(backend.type)
    if plugin is not None and plugin.resolve is not None:
        return plugin.resolve(backend, family, traced=traced, n=n, m=m)
    spec = OPERATORS[family]
    second = spec.order == 2
    modes = native_modes(framework)
    if isinstance(backend, Auto):
        return auto_candidates(family, traced=traced, n=n, m=m, framework=framework)[0]
    if isinstance(backend, SecondOrder):
        if not second:
            raise UnsupportedOperatorError(
                f"second-order backends serve {', '.join(SECOND_ORDER)}, not "
                f"{family}; pass a first-order backend such as "
                f"{_first_order_example(framework)!r}",
                field="backend",
            )
        return backend
    if second:
        if plugin is not None and plugin.mode is not None and len(modes) == 2:
            return SecondOrder(
                modes["forward"](batch_size=getattr(backend, "batch_size", None)),
                modes["reverse"](),
            )
        return SecondOrder(backend, backend)
    return backend


def auto_candidates(
    family: str, *, traced: bool, n: int = 0, m: int = 0, framework: str = DEFAULT
) -> tuple[Backend, ...]:
    """What ``Auto`` uses for ``family``, best first: the spec's rule among
    ``framework``'s native modes, then what to try when the function traces but that
    mode's transformation of it does not: the other mode, then finite differences
    (second order: forward-over-reverse, then the other pairs of exact modes, then
    finite differences over an exact gradient, then finite differences over finite
    differences)."""
    spec = OPERATORS[family]
    fd = FiniteDifferences()
    modes = native_modes(framework)
    if not traced or len(modes) < 2:
        return (SecondOrder(fd, fd),) if spec.order == 2 else (fd,)
    forward, reverse = modes["forward"], modes["reverse"]
    if spec.order == 2:
        # exact first: forward-over-reverse, then the other pairs of exact modes; then
        # finite differences over an exact gradient (one difference's error, not two),
        # and only then finite differences over finite differences
        return (
            SecondOrder(forward(), reverse()), SecondOrder(reverse(), reverse()),
            SecondOrder(forward(), forward()), SecondOrder(reverse(), forward()),
            SecondOrder(fd, reverse()), SecondOrder(fd, forward()), SecondOrder(fd, fd),
        )
    if spec.auto == "reverse" or (spec.auto == "by_size" and n > m):
        first, other = reverse(), forward()
    else:
        first, other = forward(), reverse()
    return (first,) if spec.order == 0 else (first, other, fd)


def candidates(
    backend: Backend, family: str, *, traced: bool, n: int = 0, m: int = 0,
    framework: str = DEFAULT,
) -> tuple[Backend, ...]:
    """The concrete descriptors preparation tries for ``family``, in order: Auto's
    ladder (``auto_candidates``), or the one that ``resolve_backend`` gives."""
    if isinstance(backend, Auto) and family != "sparsity":
        return auto_candidates(family, traced=traced, n=n, m=m, framework=framework)
    resolved = resolve_backend(backend, family, traced=traced, n=n, m=m, framework=framework)
    modes = native_modes(framework)
    if (
        OPERATORS[family].order == 2 and not isinstance(backend, SecondOrder)
        and _direction(backend) == "forward" and len(modes) == 2
    ):
        # forward mode asked for a second order: forward-over-reverse, and where reverse
        # mode does not trace the function, its gradient from basis pushforwards
        # (forward-over-forward), as DifferentiationInterface's forward backends do
        return resolved, SecondOrder(resolved.outer, modes["forward"]())
    return (resolved,)


def auto_rule(
    family: str, *, traced: bool, n: int = 0, m: int = 0, framework: str = DEFAULT
) -> str:
    """Why ``Auto`` first picks what it picks for ``family`` (a sentence)."""
    chosen = auto_candidates(family, traced=traced, n=n, m=m, framework=framework)[0]
    if not traced:
        return f"auto: {mode_name(chosen)}, as {_label(framework)} cannot trace this function"
    spec = OPERATORS[family]
    if spec.order == 1 and spec.auto == "by_size":
        size = f"x has {n} elements, f(x) {m}"
        return f"auto's rule for {family}: {mode_name(chosen)} ({size})"
    return f"auto's rule for {family}: {mode_name(chosen)}"


def mode_name(backend: Backend) -> str:
    """How a concrete backend differentiates, in words: ``"reverse mode"``,
    ``"forward-over-reverse"``, ``"finite differences"``, ..."""
    if isinstance(backend, SecondOrder):
        outer, inner = _direction(backend.outer), _direction(backend.inner)
        if outer is not None and inner is not None:
            return f"{outer}-over-{inner}"
        return f"{mode_name(backend.outer)} over {mode_name(backend.inner)}"
    direction = _direction(backend)
    if direction is not None:
        return f"{direction} mode"
    if isinstance(backend, FiniteDifferences):
        return "finite differences"
    return backend.type


def backend_name(backend: Backend) -> str:
    """A concrete backend as a user can pass it: ``"jax-forward"``, or for second order
    its JSON, ``{"type":"second-order","outer":"jax-forward","inner":"jax-forward"}``."""
    if isinstance(backend, SecondOrder):
        parts = {"type": backend.type, "outer": backend_name(backend.outer),
                 "inner": backend_name(backend.inner)}
        return json.dumps(parts, separators=(",", ":"))
    return backend.type


def _direction(backend: Backend) -> str | None:
    """``"forward"`` or ``"reverse"`` for a framework's native mode, else ``None``."""
    plugin = PLUGINS.get(backend.type)
    return None if plugin is None else plugin.mode


def _label(framework: str) -> str:
    return {"jax": "JAX", "torch": "PyTorch"}.get(framework, framework)


def refuse_other_framework(backend: Backend, framework: str) -> None:
    """``UnsupportedOperatorError`` (422, field ``backend``) when ``backend``, or a backend
    nested in it, differentiates only another framework's functions; it names the
    backends that fit (also as ``fits`` in the problem document)."""
    for part, field in _parts(backend, "backend"):
        plugin = PLUGINS.get(part.type)
        if plugin is None or plugin.framework in (None, framework):
            continue
        fits = fitting(framework)
        raise UnsupportedOperatorError(
            f"{part.type} differentiates functions written in {plugin.framework}, and this "
            f"function is written in {framework}; use one of: {', '.join(fits)}",
            field=field, fits=fits,
        )


def _parts(backend: Backend, field: str) -> list[tuple[Backend, str]]:
    """``backend`` and the backends nested in it (second order, sparse), with their fields."""
    out = [(backend, field)]
    for name in ("outer", "inner", "dense"):
        nested = getattr(backend, name, None)
        if nested is not None and hasattr(nested, "type"):
            out += _parts(nested, f"{field}.{name}")
    return out


def _first_order_example(framework: str) -> str:
    modes = native_modes(framework)
    return modes["reverse"].type if "reverse" in modes else FiniteDifferences.type


def engine_for(backend: Backend, *, traced: bool, nested: bool = False) -> Engine:
    """The engine for a concrete first-order descriptor."""
    plugin = PLUGINS.get(backend.type)
    if plugin is None or plugin.engine is None:
        raise UnsupportedOperatorError(
            f"{backend.type} is not a first-order backend", field="backend"
        )
    engine = plugin.engine(backend, traced=traced, nested=nested)
    if not traced and engine.traces and not isinstance(backend, FiniteDifferences):
        raise UnsupportedOperatorError(
            f"{backend.type} needs a function JAX can trace; this one is a black box. "
            "Use 'finite-differences'",
            field="backend",
        )
    return engine


def engines_for(
    backend: Backend, *, traced: bool, complex_numbers: bool = False
) -> tuple[Engine, Engine | None]:
    """``(engine, None)`` for first order, ``(outer, inner)`` for ``SecondOrder``.

    ``complex_numbers``: x or f(x) has a complex leaf; each engine then answers in JAX's
    convention (its ``for_complex`` form, by default ``RealParts``) or refuses."""
    outer, inner = _engines(backend, traced=traced)
    if not complex_numbers:
        return outer, inner
    outer_name, inner_name = _names(backend)
    outer = real_parts.for_complex(outer, outer_name)
    return outer, None if inner is None else real_parts.for_complex(inner, inner_name)


def _engines(backend: Backend, *, traced: bool) -> tuple[Engine, Engine | None]:
    plugin = PLUGINS.get(backend.type)
    if plugin is not None and plugin.engines is not None:
        return plugin.engines(backend, traced=traced)
    if isinstance(backend, SecondOrder):
        both_fd = isinstance(backend.outer, FiniteDifferences) and isinstance(
            backend.inner, FiniteDifferences
        )
        outer = engine_for(backend.outer, traced=traced, nested=both_fd)
        inner = engine_for(backend.inner, traced=traced, nested=both_fd)
        return outer, inner
    return engine_for(backend, traced=traced), None


def _names(backend: Backend) -> tuple[str, str]:
    """The backend types of the outer and inner engines, for their messages."""
    if isinstance(backend, Sparse):
        backend = backend.dense
    if isinstance(backend, SecondOrder):
        return backend.outer.type, backend.inner.type
    return backend.type, backend.type
