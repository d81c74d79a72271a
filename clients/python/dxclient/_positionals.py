"""An operator method's positional arguments, with the backend optional.

The client's operators take the library's order, ``op(f, backend, x, [tangents],
*contexts)``, and also ``op(f, x, [tangents], *contexts)``: the backend is then
``"auto"``, as over HTTP. The second argument is the backend when it is one, a
backend descriptor (``JaxReverse()``), a string (``"jax-reverse"``; an array is never
a string) or a JSON object with a string ``"type"`` (``{"type": "jax-forward"}``), and
``x`` otherwise, the rest moving up one place. So a pytree ``x`` that is a dict with a
string ``"type"`` key must be sent with the backend named: ``op(f, "auto", x)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .backends import BACKEND_TYPES


class _NotGiven:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<not given>"


#: The default of ``x`` and ``tangents`` in the operator methods: nothing was passed.
NOT_GIVEN: Any = _NotGiven()


def is_backend(value: Any) -> bool:
    """Does ``value`` name a backend (a descriptor, a string, a typed JSON object)?"""
    if isinstance(value, str):
        return True
    kind = getattr(type(value), "type", None)  # a descriptor, built in or a plug-in's
    if isinstance(kind, str) and BACKEND_TYPES.get(kind) is type(value):
        return True
    return isinstance(value, Mapping) and isinstance(value.get("type"), str)


def positionals(
    operator: str, takes_tangents: bool, backend: Any, x: Any, tangents: Any, contexts: tuple
) -> tuple[Any, Any, Any, tuple]:
    """``(backend, x, tangents, contexts)`` of an operator method's call, with the
    backend ``"auto"`` when the second argument is not a backend (see the module)."""
    if not is_backend(backend):  # the backend was left out: x came second
        given = (backend, x, tangents) if takes_tangents else (backend, x)
        given = tuple(a for a in given if a is not NOT_GIVEN) + contexts
        backend, x = "auto", given[0]
        if takes_tangents:
            tangents, contexts = (given[1] if len(given) > 1 else NOT_GIVEN), given[2:]
        else:
            contexts = given[1:]
    if x is NOT_GIVEN:
        raise TypeError(f"{operator}() needs x: {operator}(f, [backend,] x, ...)")
    if takes_tangents and tangents is NOT_GIVEN:
        raise TypeError(
            f"{operator}() needs tangents after x: {operator}(f, [backend,] x, tangents, ...), "
            "tangents a list of tangents ([t] for one)"
        )
    return backend, x, (tangents if takes_tangents else None), contexts
