"""The ``module`` kind: the deployer's trusted Python, marked ``@dxserve.function``.

Never stored and never registered over the API (it has no body fields): such
functions come from the server's ``--functions`` modules at start
(``Registry.add_module``), as callables rather than content.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from dxclient.errors import InvalidArgumentError

from . import BaseKind, Built

__all__ = ["MODULE", "ModuleKind"]


class ModuleKind(BaseKind):
    name = "module"
    persistent = False
    summary = "a server-side function"
    fields: Mapping[str, tuple[Any, Any]] = {}

    def validate(self, values: Mapping[str, Any]) -> bytes:
        raise InvalidArgumentError(
            "server-side functions come from the server's modules, not from requests",
            field="kind",
        )

    def build(self, content: bytes) -> Built:
        # Importing code named by content would run arbitrary Python: refused.
        raise InvalidArgumentError(
            "server-side functions are not built from content", field="kind"
        )

    def wrap(self, fn: Callable) -> Built:
        """A server-side callable with its parameter names as the signature."""
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            params = []
        return Built(fn, {"args": params})


MODULE = ModuleKind()
