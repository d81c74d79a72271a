"""``resolve(backend, operator, f, x, *contexts)``: which backend a call would use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dxclient.backends import Backend
from dxclient.operators import ALIASES, OPERATORS

from .backends import resolve_backend
from .preparation import _size, as_tree, probe


def resolve(backend: Backend | str, operator: str, f: Callable, x: Any, *contexts: Any) -> Backend:
    """The concrete descriptor ``operator`` would use (``Auto`` and DI's rule applied)."""
    family = OPERATORS[ALIASES.get(operator, operator)].family
    x = as_tree(x)
    contexts = tuple(as_tree(c) for c in contexts)
    traced, y = probe(f, x, contexts)
    return resolve_backend(backend, family, traced=traced, n=_size(x), m=_size(y))
