"""The ``module`` kind: the deployer's trusted Python, marked ``@dxserve.function``.

Never stored and never registered over the API (it has no body fields): such
functions come from the server's ``--functions`` modules at start
(``Registry.add_module``), as callables rather than content.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dxcontract.errors import InvalidArgumentError
from dxserve.server.kinds import BaseKind, Built

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
        raise InvalidArgumentError("server-side functions are not built from content", field="kind")

    def wrap(self, fn: Callable, example: Sequence[Any] | None = None) -> Built:
        """A server-side callable with its parameter names as the signature, and what
        its ``example`` arguments (else its annotations) tell of its shapes (``describe``)."""
        from dxserve.server.describe import annotated_args, facts

        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            params = []
        if example is not None:
            found = facts(fn, example, "example", example)
        else:
            annotated = annotated_args(fn)
            found = facts(fn, annotated, "annotations") if annotated is not None else None
            if annotated is None and _annotated(fn):  # said once, at start: nothing is declared
                logging.getLogger("dxserve.registry").warning(
                    "function %s: its annotations declare no shapes (the form read is "
                    'jaxtyping\'s, Float[Array, "3"]); it is served without them',
                    getattr(fn, "__name__", fn),
                )
        return Built(fn, {"args": params}, found)


MODULE = ModuleKind()


def _annotated(fn: Callable) -> bool:
    """Does any parameter of ``fn`` carry an annotation?"""
    try:
        return any(p.annotation is not p.empty for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
