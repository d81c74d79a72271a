"""Server-side functions: the deployer's trusted Python, marked with a decorator.

    @dxserve.function(description="extended Rosenbrock, R^n -> R")
    def rosenbrock(x):
        return jnp.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)

``dxserve serve --functions mymodule`` imports ``mymodule`` and registers every
function so marked (``module_functions``).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class FunctionInfo:
    name: str
    description: str


def function(
    fn: Callable | None = None, *, name: str | None = None, description: str | None = None
) -> Callable:
    """Mark ``fn(x, *contexts)`` for registration (usable with or without arguments)."""

    def mark(fn: Callable) -> Callable:
        doc = (inspect.getdoc(fn) or "").strip().splitlines()
        fn.__dxserve__ = FunctionInfo(name or fn.__name__, description or (doc[0] if doc else ""))
        return fn

    return mark(fn) if fn is not None else mark


def module_functions(module: str | ModuleType) -> list[tuple[FunctionInfo, Callable]]:
    """Every marked function of ``module`` (imported by name if a string)."""
    if isinstance(module, str):
        module = importlib.import_module(module)
    found = []
    for value in vars(module).values():
        info = getattr(value, "__dxserve__", None)
        if isinstance(info, FunctionInfo) and callable(value):
            found.append((info, value))
    return sorted(found, key=lambda item: item[0].name)
