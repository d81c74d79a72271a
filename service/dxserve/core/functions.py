"""Server-side functions: the deployer's trusted Python, marked with a decorator.

    @dxserve.function(description="extended Rosenbrock, R^n -> R",
                      example=(np.array([1.0, 2.0, 3.0]),))
    def rosenbrock(x):
        return jnp.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)

``dxserve serve --functions mymodule`` imports ``mymodule`` and registers every
function so marked (``module_functions``). ``example`` (the arguments ``(x,
*contexts)``) lets ``GET /functions/{name}`` show the arguments' shapes and dtypes, the
operators they allow and a request to try; without one, parameter annotations that
are ``jax.ShapeDtypeStruct``s (or ``float``) do the same.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class FunctionInfo:
    name: str
    description: str
    #: example arguments ``(x, *contexts)`` (arrays or pytrees of them), or None
    example: tuple | None = field(default=None, compare=False, repr=False)
    #: the array framework it is written in (``frameworks``; None: JAX)
    framework: str | None = None


def function(
    fn: Callable | None = None, *, name: str | None = None, description: str | None = None,
    example: Sequence[Any] | None = None, framework: str | None = None,
) -> Callable:
    """Mark ``fn(x, *contexts)`` for registration (usable with or without arguments).

    ``example``: arguments ``(x, *contexts)`` it can be called with, shown (shapes,
    dtypes, a request to try) by ``GET /functions/{name}``. ``framework``: the name of
    the registered ``frameworks.Framework`` it is written in (None: JAX); it is
    differentiated, prepared and run through that framework, in process or served.
    """
    if example is not None and (isinstance(example, str) or not isinstance(example, Sequence)):
        raise TypeError("example is the arguments (x, *contexts): a tuple, e.g. (x,)")

    def mark(fn: Callable) -> Callable:
        doc = (inspect.getdoc(fn) or "").strip().splitlines()
        fn.__dxserve__ = FunctionInfo(
            name or fn.__name__, description or (doc[0] if doc else ""),
            tuple(example) if example is not None else None, framework,
        )
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
