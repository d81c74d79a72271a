"""The table of backend types: each descriptor with its engine and what it serves.

``register_backend`` is the one call that adds a backend. After it, the descriptor
parses from JSON (``{"type": name, ...}``) in process and over HTTP, the Python
client can name it, ``GET /backends`` lists it, and its engine differentiates.
The built-in JAX and finite-difference backends register through the same call.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from dxcontract.backends import register_backend_type
from dxcontract.operators import OPERATORS
from dxserve.core.backends.engine import Engine

#: ``factory(descriptor, *, traced, nested) -> Engine``: ``traced`` is False for a
#: function JAX cannot trace, ``nested`` True inside another finite difference.
EngineFactory = Callable[..., Engine]
#: ``resolve(descriptor, family, *, traced, n, m) -> descriptor``: the concrete backend
#: a wrapping backend uses for ``family`` (see ``selection.resolve_backend``).
Resolver = Callable[..., Any]
#: ``engines(descriptor, *, traced) -> (engine, inner engine or None)``.
EnginesFactory = Callable[..., tuple[Engine, "Engine | None"]]

FIRST_ORDER = tuple(n for n, op in OPERATORS.items() if op.order <= 1)
SECOND_ORDER = tuple(n for n, op in OPERATORS.items() if op.order == 2)


@dataclass(frozen=True)
class BackendPlugin:
    descriptor: type
    engine: EngineFactory | None  # None: a backend that chooses others (auto, second-order)
    parameters: dict[str, str] = field(default_factory=dict)
    operators: tuple[str, ...] = FIRST_ORDER + SECOND_ORDER
    notes: str = ""
    #: for a backend that wraps others (``Sparse``): how it resolves per operator family
    #: and builds its engines; None for plain backends
    resolve: Resolver | None = None
    engines: EnginesFactory | None = None
    #: the one framework whose functions the engine differentiates (None: any)
    framework: str | None = None
    #: "forward" or "reverse": the framework's native mode this backend is (``auto``
    #: picks it for the framework's functions); None for other backends
    mode: str | None = None

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": self.descriptor.type,
            "parameters": dict(self.parameters),
            "operators": list(self.operators),
        }
        if self.framework is not None:
            out["framework"] = self.framework
            # listed either way (descriptors are part of the API); a function of a
            # framework this server lacks cannot be registered, so say whether it can
            out["installed"] = importlib.util.find_spec(self.framework) is not None
        if self.notes:
            out["notes"] = self.notes
        return out


PLUGINS: dict[str, BackendPlugin] = {}


def register_backend(
    descriptor: type,
    engine: EngineFactory | None,
    *,
    parameters: dict[str, str] | None = None,
    operators: tuple[str, ...] = FIRST_ORDER + SECOND_ORDER,
    notes: str = "",
    resolve: Resolver | None = None,
    engines: EnginesFactory | None = None,
    framework: str | None = None,
    mode: str | None = None,
) -> BackendPlugin:
    """Add a backend type: ``descriptor`` (a frozen dataclass with a class attribute
    ``type`` and ``to_json()``) and ``engine(descriptor, *, traced, nested)``.

    ``framework``: the framework (``frameworks``) whose functions alone the engine
    differentiates (None: any function); ``mode``: ``"forward"`` or ``"reverse"`` when
    the backend is that framework's native mode, which ``auto`` then picks for its
    functions (the first registered of each mode), second order forward-over-reverse.

    ``parameters`` documents the descriptor's JSON parameters (name -> meaning); by
    default they are its dataclass fields. A first-order backend asked for a second
    order operator is used as ``SecondOrder(b, b)``. A backend that wraps others gives
    ``resolve`` (its concrete form per operator family) and ``engines`` (its engines).
    """
    if parameters is None:
        parameters = {f.name: f.name for f in fields(descriptor)} if is_dataclass(descriptor) else {}
    register_backend_type(descriptor, tuple(parameters))
    if mode not in (None, "forward", "reverse"):
        raise ValueError(f"mode is 'forward', 'reverse' or None, got {mode!r}")
    plugin = BackendPlugin(
        descriptor, engine, dict(parameters), tuple(operators), notes, resolve, engines,
        framework, mode,
    )
    PLUGINS[descriptor.type] = plugin
    return plugin


def native_modes(framework: str) -> dict[str, type]:
    """``{"forward": descriptor class, "reverse": ...}``: the modes registered as
    ``framework``'s own (the first of each; fewer where none is)."""
    found: dict[str, type] = {}
    for plugin in PLUGINS.values():
        if plugin.framework == framework and plugin.mode is not None:
            found.setdefault(plugin.mode, plugin.descriptor)
    return found


def fitting(framework: str) -> list[str]:
    """The backend types that differentiate ``framework``'s functions: its own first-order
    backends, those for any framework, and the choosers (``auto``, ``second-order``)."""
    return [
        name for name, plugin in PLUGINS.items()
        if plugin.framework in (None, framework) and name != "sparse"
    ]


def backend_table() -> list[dict[str, Any]]:
    """What ``GET /backends`` lists: every type, its parameters and its operators."""
    return [plugin.describe() for plugin in PLUGINS.values()]
