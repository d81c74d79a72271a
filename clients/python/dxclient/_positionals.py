"""An operator method's positional arguments, with the backend optional.

The client's operators take the library's order, ``op(f, backend, x, [tangents],
*contexts)``, and also ``op(f, x, [tangents], *contexts)``: the backend is then
``"auto"``, as over HTTP. The second argument is the backend when it is one: a
descriptor (``JaxReverse()``), a string (``"jax-reverse"``; an array is never a
string) or a JSON object with a string ``"type"`` (``{"type": "jax-forward"}``); None
stays a backend (and is refused as one, as before). Anything else is ``x``, and the
rest moves up one place. So a pytree ``x`` that is a dict with a string ``"type"``
key must be sent with the backend named: ``op(f, "auto", x)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dxcontract.backends import BACKEND_TYPES


class _NotGiven:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<not given>"


#: The default of ``x`` and ``tangents`` in the operator methods: nothing was passed.
NOT_GIVEN: Any = _NotGiven()


def is_backend(value: Any) -> bool:
    """Does ``value`` name a backend (a descriptor, a string, a typed JSON object)?"""
    cls = type(value)
    if cls is str or value is None:  # None: refused as a backend, as it always was
        return True
    if cls is dict:  # a JSON object names a backend by its "type"; a pytree x has none
        return isinstance(value.get("type"), str)
    if cls.__module__.startswith(("numpy", "jax")) or cls in (list, tuple, float, int):
        return False  # arrays and numbers: the usual x, decided without the checks below
    kind = getattr(cls, "type", None)  # a descriptor, built in or a plug-in's
    if isinstance(kind, str) and BACKEND_TYPES.get(kind) is cls:
        return True
    if isinstance(value, str):
        return True
    return isinstance(value, Mapping) and isinstance(value.get("type"), str)


def positionals(
    operator: str, takes_tangents: bool, backend: Any, x: Any, tangents: Any, contexts: tuple
) -> tuple[Any, Any, Any, tuple]:
    """``(backend, x, tangents, contexts)`` of an operator method's call, with the
    backend ``"auto"`` when the second argument is not a backend (see the module)."""
    if not is_backend(backend):  # the backend was left out: x came second
        # positionals fill in order, so only trailing ones can be NOT_GIVEN
        if takes_tangents:
            if x is NOT_GIVEN:
                backend, x, tangents = "auto", backend, NOT_GIVEN
            elif tangents is NOT_GIVEN:
                backend, x, tangents = "auto", backend, x
            else:
                backend, x, tangents, contexts = "auto", backend, x, (tangents, *contexts)
        elif x is NOT_GIVEN:
            backend, x = "auto", backend
        else:
            backend, x, contexts = "auto", backend, (x, *contexts)
    if x is NOT_GIVEN:
        raise TypeError(f"{operator}() needs x: {operator}(f, [backend,] x, ...)")
    if takes_tangents and tangents is NOT_GIVEN:
        raise TypeError(
            f"{operator}() needs tangents after x: {operator}(f, [backend,] x, tangents, ...), "
            "tangents a list of tangents ([t] for one)"
        )
    return backend, x, (tangents if takes_tangents else None), contexts
