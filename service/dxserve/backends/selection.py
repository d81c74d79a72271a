"""Turn what the user asked for into concrete descriptors and engines, per operator.

``Auto()`` picks what each operator family's spec says (``OperatorSpec.auto``) among the
native modes of the function's framework (``jax-forward``/``jax-reverse`` for JAX,
``torch-forward``/``torch-reverse`` for torch): reverse for gradients and pullbacks,
forward for pushforwards and derivatives, forward vs reverse for Jacobians by comparing
sizes (forward when n = x.size ≤ m = y.size), and forward-over-reverse for second order
(``OperatorSpec.order``). A function its framework cannot trace, or a framework without
native modes, gets finite differences. A single first-order backend asked for a
second-order operator follows DifferentiationInterface's rule: a framework's native
modes become forward-over-reverse (keeping the backend's batch_size on the outer mode),
any other backend ``b`` becomes ``SecondOrder(b, b)`` (finite differences over finite
differences, say).

A backend registered for one framework never differentiates another's functions: a
JAX mode named for a torch function (or the reverse) is refused, naming the backends
that fit.
"""

from __future__ import annotations

from dxcontract.backends import Auto, Backend, FiniteDifferences, SecondOrder, Sparse
from dxcontract.errors import UnsupportedOperatorError
from dxcontract.operators import OPERATORS

from ..frameworks import DEFAULT
from .engine import Engine
from .plugins import PLUGINS, fitting, native_modes

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
        if not traced or len(modes) < 2:
            fd = FiniteDifferences()
            return SecondOrder(fd, fd) if second else fd
        forward, reverse = modes["forward"], modes["reverse"]
        if second:
            return SecondOrder(forward(), reverse())
        if spec.auto == "reverse" or (spec.auto == "by_size" and n > m):
            return reverse()
        return forward()
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


def engines_for(backend: Backend, *, traced: bool) -> tuple[Engine, Engine | None]:
    """``(engine, None)`` for first order, ``(outer, inner)`` for ``SecondOrder``."""
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
