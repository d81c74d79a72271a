"""Where a registered function came from, so another process can build it again.

A sandboxed child (``sparse_sandbox``) cannot receive a callable: nothing a client
sent is ever pickled. It gets the function's ``Origin`` instead and rebuilds it the
way the registry built it:

* a server-side ``@dxserve.function`` (kind ``module``): imported by module and
  qualified name (the child is given the server's ``sys.path``);
* a stored kind (``expression``, ``export``, a plug-in's): built from its content
  bytes, read from the store by name and checked against its digest. An export is
  loaded directly (it passed the export gate when it was registered); a plug-in kind
  is looked up after importing the module that defines it.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Origin", "module_origin", "rebuild"]


@dataclass(frozen=True)
class Origin:
    """How a registered function is built: ``kind`` and, for ``module``, the module
    and qualified name; for a stored kind, its name and content digest in the store and
    the module defining the kind (``module``)."""

    kind: str
    module: str = ""
    qualname: str = ""
    name: str = ""
    digest: str = ""

    def to_json(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: Any) -> Origin:
        if not isinstance(value, dict):
            raise ValueError("an origin is an object")
        return cls(**{k: str(value.get(k, "")) for k in ("kind", "module", "qualname", "name",
                                                          "digest")})


def module_origin(fn: Callable) -> Origin | None:
    """The origin of a server-side function, if importing its module and following its
    qualified name gives it back (not a closure, a lambda or a local)."""
    if not isinstance(fn, types.FunctionType) or "<" in fn.__qualname__:
        return None
    try:
        found = _follow(importlib.import_module(fn.__module__), fn.__qualname__)
    except (ImportError, AttributeError):
        return None
    return Origin("module", fn.__module__, fn.__qualname__) if found is fn else None


def stored_origin(kind: Any, name: str, digest: str) -> Origin:
    """The origin of a stored function of ``kind`` (a ``FunctionKind``)."""
    return Origin(kind.name, type(kind).__module__, "", name, digest)


def _follow(obj: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def rebuild(origin: Origin, content: bytes) -> Callable:
    """The callable ``origin`` describes (``content``: a stored kind's bytes). Runs in
    the sandboxed child; raises whatever building raises."""
    if origin.kind == "module":
        return _follow(importlib.import_module(origin.module), origin.qualname)
    if origin.kind == "export":
        from dxserve.frameworks.jax.exported import load_float64

        return load_float64(content).fn  # as the export kind loads it
    from dxserve.server import kinds

    if kinds.get_kind(origin.kind) is None and origin.module:
        importlib.import_module(origin.module)  # a plug-in kind registers itself
    kind = kinds.get_kind(origin.kind)
    if kind is None:
        raise LookupError(f"no function kind {origin.kind!r} here")
    return kind.build(content).fn
