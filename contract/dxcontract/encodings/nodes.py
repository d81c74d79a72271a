"""Pytree nodes with named fields on the wire: ``NamedTuple``s and registered dataclasses.

A node with named fields (a ``NamedTuple``, a ``flax.struct`` dataclass, an
``equinox.Module``: any node JAX's ``tree_util`` flattens by attribute) travels as

    {"__node__": {"type": "Layer", "fields": {"weight": <pytree>, "bias": <pytree>}}}

its type's name and its fields, in order, each a pytree of its own. A reader that knows
the type (a client remembers every type it sent, ``remember``; anyone may ``register``
one) rebuilds that type; any other reader rebuilds a ``NamedTuple`` of the same name and
fields (one class per name and fields), so ``p.weight`` and ``w, b = p`` work in a
served function as they do on the caller's side. Older readers, which do not know the
marker, refuse it as an unknown node type (a 422 naming it), never misread it.
"""

from __future__ import annotations

import collections
import dataclasses
import keyword
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..errors import InvalidArgumentError, MalformedRequestError
from ..lru import LRU

NODE_MARKER = "__node__"
#: longest type or field name, and most fields, a node may have on the wire
MAX_NAME = 200
MAX_FIELDS = 1024


class NamedNode:
    """A node with named fields, to be sent as its marker object by ``encode_tree``."""

    __slots__ = ("fields", "items", "name")

    def __init__(self, name: str, fields: list[str], items: list) -> None:
        self.name = name
        self.fields = fields
        self.items = items

    def __repr__(self) -> str:
        return f"NamedNode({self.name!r}, {self.fields!r})"


_lock = threading.Lock()
#: (name, fields) -> a function of the children that rebuilds the caller's own type
_KNOWN: dict[tuple[str, tuple[str, ...]], Callable[[list], Any]] = {}
#: (name, fields) -> the NamedTuple class a reader makes for a type it does not know
_MADE: LRU[tuple[str, tuple[str, ...]], type] = LRU(512)


def register(cls: type) -> type:
    """Rebuild nodes of ``cls``'s name and fields as ``cls`` (a ``NamedTuple`` or a
    dataclass whose fields are its children); returns ``cls`` (usable as a decorator)."""
    if hasattr(cls, "_fields"):
        fields = tuple(cls._fields)
        _KNOWN[(cls.__name__, fields)] = lambda items: cls(*items)
    elif dataclasses.is_dataclass(cls):
        fields = tuple(f.name for f in dataclasses.fields(cls))
        _KNOWN[(cls.__name__, fields)] = lambda items: cls(*items)
    else:
        raise TypeError(f"{cls.__name__} is neither a NamedTuple nor a dataclass")
    return cls


def remember(name: str, fields: tuple[str, ...], rebuild: Callable[[list], Any]) -> None:
    """Rebuild nodes of this name and fields with ``rebuild(children)`` from now on."""
    _KNOWN[(name, fields)] = rebuild


def named_fields(value: Any, keep: bool = True) -> tuple[str, list[str], list] | None:
    """``(type name, field names, children)`` of a node with named fields, or None.

    A ``NamedTuple`` is read as it is; any other node through JAX's ``tree_util`` when
    JAX is loaded (a registered dataclass: its children are the attributes it flattens
    to). With ``keep`` (a caller's inputs), its type is remembered, so an answer of the
    same type comes back as it; a server writing its answers keeps nothing."""
    cls = type(value)
    if isinstance(value, tuple) and hasattr(cls, "_fields"):
        fields = list(cls._fields)
        if keep and (cls.__name__, tuple(fields)) not in _KNOWN:
            remember(cls.__name__, tuple(fields), lambda items, cls=cls: cls(*items))
        return cls.__name__, fields, list(value)
    if isinstance(value, dict | list | tuple) or value is None:
        return None
    jax = sys.modules.get("jax")  # a node JAX knows: JAX is loaded already
    if jax is None or not (dataclasses.is_dataclass(value) or hasattr(value, "tree_flatten")):
        return None
    tu = jax.tree_util
    try:
        flat, node = tu.tree_flatten_with_path(value, is_leaf=lambda v: v is not value)
    except Exception:  # noqa: BLE001 - not a node JAX can flatten: not one of ours
        return None
    if node.num_nodes == 1 and node.num_leaves == 1:  # a leaf, not a node
        return None
    fields = []
    for path, _ in flat:
        key = path[0] if len(path) == 1 else None
        name = getattr(key, "name", None)
        if not isinstance(name, str):  # children not named by attribute: no named node
            return None
        fields.append(name)
    children = [v for _, v in flat]
    if keep:
        remember(
            cls.__name__, tuple(fields), lambda items, node=node: tu.tree_unflatten(node, items)
        )
    return cls.__name__, fields, children


def _check_name(name: Any, what: str, field: str) -> str:
    if (
        not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name)
        or len(name) > MAX_NAME
    ):
        raise InvalidArgumentError(
            f"a {NODE_MARKER} node's {what} must be a Python identifier of at most "
            f"{MAX_NAME} characters, got {str(name)[:60]!r}",
            field=field,
        )
    return name


def read_node(value: dict, field: str) -> tuple[str, list[str], list]:
    """``{"__node__": {"type": ..., "fields": {...}}}`` checked: ``(name, fields, raw
    children)``; the children are still to be read as pytrees."""
    body = value[NODE_MARKER]
    if len(value) != 1 or not isinstance(body, dict) or set(body) != {"type", "fields"}:
        raise MalformedRequestError(
            f'a named node must be exactly {{"{NODE_MARKER}": {{"type": name, "fields": '
            '{field: pytree, ...}}}',
            field=field,
        )
    name = _check_name(body["type"], "type", field)
    fields = body["fields"]
    if not isinstance(fields, dict) or len(fields) > MAX_FIELDS:
        raise MalformedRequestError(
            f"a named node's fields must be an object of at most {MAX_FIELDS} fields",
            field=field,
        )
    names = [_check_name(k, "field name", field) for k in fields]
    for k in names:
        if k.startswith("_"):
            raise InvalidArgumentError(
                f"a named node's field names may not start with '_', got {k!r}", field=field
            )
    return name, names, list(fields.values())


def build(name: str, fields: list[str], children: list) -> Any:
    """The node of this name and fields: the known type's, else a ``NamedTuple``."""
    key = (name, tuple(fields))
    known = _KNOWN.get(key)
    if known is not None:
        return known(children)
    with _lock:
        cls = _MADE.get(key)
        if cls is None:
            cls = collections.namedtuple(name, fields)  # noqa: PYI024 - made at run time
            _MADE.put(key, cls)
    return cls(*children)


__all__ = [
    "MAX_FIELDS", "MAX_NAME", "NODE_MARKER", "NamedNode", "build", "named_fields",
    "read_node", "register", "remember",
]
