"""Turn what the user asked for into concrete descriptors and engines, per operator.

``Auto()`` picks what each operator family's spec says (``OperatorSpec.auto``): reverse
for gradients and pullbacks, forward for pushforwards and derivatives, forward vs
reverse for Jacobians by comparing sizes (forward when n = x.size ≤ m = y.size), and
forward-over-reverse for second order (``OperatorSpec.order``). A function JAX
cannot trace gets finite differences. A single first-order backend asked for a
second-order operator follows DifferentiationInterface's rule: JAX modes become
forward-over-reverse (keeping the backend's batch_size on the outer mode), any
other backend ``b`` becomes ``SecondOrder(b, b)`` (finite differences over finite
differences, say).
"""

from __future__ import annotations

from dxcontract.backends import (
    Auto,
    Backend,
    FiniteDifferences,
    JaxForward,
    JaxReverse,
    SecondOrder,
    Sparse,
)
from dxcontract.errors import UnsupportedOperatorError
from dxcontract.operators import OPERATORS

from .engine import Engine
from .plugins import PLUGINS

#: the families second-order backends serve (their specs say order 2)
SECOND_ORDER = tuple(name for name, op in OPERATORS.items() if op.family == name and op.order == 2)


def resolve_backend(
    backend: Backend, family: str, *, traced: bool, n: int = 0, m: int = 0
) -> Backend:
    """The concrete descriptor used for ``family`` (never ``Auto``); ``backend`` is a
    descriptor, parsed where the call came in."""
    if family == "sparsity" and backend.type != "sparse":  # the pattern: any backend's
        backend = Sparse(dense=backend)
    plugin = PLUGINS.get(backend.type)
    if plugin is not None and plugin.resolve is not None:
        return plugin.resolve(backend, family, traced=traced, n=n, m=m)
    spec = OPERATORS[family]
    second = spec.order == 2
    if isinstance(backend, Auto):
        if not traced:
            fd = FiniteDifferences()
            return SecondOrder(fd, fd) if second else fd
        if second:
            return SecondOrder(JaxForward(), JaxReverse())
        if spec.auto == "reverse" or (spec.auto == "by_size" and n > m):
            return JaxReverse()
        return JaxForward()
    if isinstance(backend, SecondOrder):
        if not second:
            raise UnsupportedOperatorError(
                f"second-order backends serve {', '.join(SECOND_ORDER)}, not "
                f"{family}; pass a first-order backend such as 'jax-reverse'",
                field="backend",
            )
        return backend
    if second:
        if isinstance(backend, JaxForward | JaxReverse):
            return SecondOrder(JaxForward(batch_size=backend.batch_size), JaxReverse())
        return SecondOrder(backend, backend)
    return backend


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
