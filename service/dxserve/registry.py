"""The function registry: one name space for every kind of function.

The kinds (``dxserve.kinds``) are ``module`` (the deployer's trusted Python,
``@dxserve.function``, never stored), ``expression`` (a whitelisted ``jnp``
expression), ``export`` (a JAX export uploaded by a client) and any kind added
with ``dxserve.kinds.add_kind``. Functions of persistent kinds are kept in a
content-addressed ``FunctionStore`` and rebuilt at start, so they survive restarts.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dxclient.errors import (
    FunctionConflictError,
    InvalidArgumentError,
    TooManyFunctionsError,
    UnknownFunctionError,
)

from . import executable_cache, kinds
from .functions import FunctionInfo, module_functions
from .kinds.expression import expression_content
from .kinds.module import MODULE
from .store import FunctionStore, StoredFunction, validate_name

__all__ = ["Entry", "Registry", "expression_content"]

log = logging.getLogger("dxserve.registry")


@dataclass(frozen=True)
class Entry:
    """A registered function and what clients may know about it."""

    name: str
    kind: str  # a kind's name: "module", "expression", "export", ...
    fn: Callable = field(repr=False, compare=False)
    description: str = ""
    signature: dict[str, Any] = field(default_factory=dict)
    digest: str | None = None
    created: str | None = None

    def describe(self) -> dict[str, Any]:
        """The JSON of ``GET /functions/{name}``, as this entry's kind describes it."""
        kind = kinds.get_kind(self.kind)
        return kind.describe(self) if kind is not None else kinds.standard_description(self)


def _build(record: StoredFunction) -> Entry:
    kind = kinds.get_kind(record.kind)
    if kind is None or not kind.persistent:
        raise InvalidArgumentError(
            f"kind must be one of {sorted(kinds.stored_names())}, got {record.kind!r}",
            field="kind",
        )
    built = kind.build(record.content)
    # Persisted executables of stored functions are keyed by kind and content.
    executable_cache.identify(built.fn, kind.name, record.content)
    return Entry(
        record.name,
        record.kind,
        built.fn,
        record.metadata.get("description", ""),
        built.signature,
        record.digest,
        record.created,
    )


class Registry:
    """Thread-safe name -> ``Entry`` map backed by an optional persistent store."""

    def __init__(self, store: FunctionStore, max_functions: int = 1000) -> None:
        self.store = store
        self.max_functions = max_functions
        self._entries: dict[str, Entry] = {}
        self._lock = threading.Lock()
        self.on_remove: list[Callable[[Entry], None]] = []

    # --- loading -----------------------------------------------------------
    def add_module(self, module: str) -> list[str]:
        """Register every ``@dxserve.function`` of ``module``; returns their names."""
        names = []
        for info, fn in module_functions(module):
            self.add_python(info, fn)
            names.append(info.name)
        return names

    def add_python(self, info: FunctionInfo, fn: Callable) -> Entry:
        """Register one server-side callable (kind ``module``, never stored)."""
        built = MODULE.wrap(fn)
        entry = Entry(info.name, MODULE.name, built.fn, info.description, built.signature)
        with self._lock:
            self._entries[info.name] = entry
        return entry

    def load_store(self) -> int:
        """Rebuild every stored function; a record that no longer loads is skipped."""
        loaded = 0
        for record in self.store.list():
            try:
                entry = _build(record)
            except Exception as exc:  # keep serving the rest
                log.warning("skipping stored function %s: %s", record.name, exc)
                continue
            with self._lock:
                self._entries[record.name] = entry
            loaded += 1
        return loaded

    # --- reads -------------------------------------------------------------
    def get(self, name: Any, field_name: str = "function") -> Entry:
        entry = self._entries.get(name) if isinstance(name, str) else None
        if entry is None:
            if not isinstance(name, str):
                raise UnknownFunctionError(
                    f"function must be a registered name (a string), got {type(name).__name__}",
                    field=field_name,
                )
            raise UnknownFunctionError(
                f"no function named {name!r}; GET /functions lists them", field=field_name
            )
        return entry

    def list(self) -> list[Entry]:
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: e.name)

    def __len__(self) -> int:
        return len(self._entries)

    def registered(self) -> int:
        """How many functions were registered by clients (server-side ones not counted)."""
        with self._lock:  # concurrent registrations resize the dict
            return sum(1 for e in self._entries.values() if e.kind != MODULE.name)

    # --- writes ------------------------------------------------------------
    def register_body(self, body: dict[str, Any]) -> tuple[Entry, bool]:
        """Register from a decoded ``POST /functions`` body; ``(entry, created)``.

        Validates the body (``RegisterFunction``, exactly one kind's fields, that
        kind's ``validate``), then builds, persists and publishes as ``register``.
        Raises the typed errors of ``dxclient.errors``.
        """
        request = kinds.parse_register_body(body)
        return self.register(
            request.name, request.kind, request.content, request.description,
            replace=request.replace,
        )

    def register(
        self,
        name: str,
        kind: str,
        content: bytes,
        description: str = "",
        *,
        replace: bool = False,
    ) -> tuple[Entry, bool]:
        """Build, persist and publish a function; ``(entry, created)``.

        The function is built before anything is written, so content that does
        not compile is refused without touching the store.
        """
        validate_name(name)
        if kind not in kinds.stored_names():
            raise InvalidArgumentError(
                f"kind must be one of {sorted(kinds.stored_names())}, got {kind!r}", field="kind"
            )
        with self._lock:
            existing = self._entries.get(name)
        if existing is not None and existing.kind == MODULE.name:
            raise FunctionConflictError(
                f"{name!r} is a server-side function and cannot be replaced", field="name"
            )
        if existing is None and self.registered() >= self.max_functions:
            raise TooManyFunctionsError(
                f"the server holds its limit of {self.max_functions} functions; delete some",
                field="name",
            )
        metadata = {"description": description}
        # Built before anything is written: content that does not load never reaches the store.
        built = _build(StoredFunction(name, kind, "", content, metadata, ""))
        record, created = self.store.put(name, kind, content, metadata, replace=replace)
        if existing is not None and existing.digest == record.digest and not replace:
            entry = existing  # idempotent: keep the entry (and its compiled executables)
        else:
            entry = dataclasses.replace(
                built,
                description=record.metadata.get("description", description),
                digest=record.digest,
                created=record.created,
            )
        with self._lock:
            self._entries[name] = entry
        if existing is not None and existing is not entry:
            self._removed(existing)
        return entry, created

    def delete(self, name: str) -> Entry:
        entry = self.get(name, "name")
        if entry.kind == MODULE.name:
            raise FunctionConflictError(
                f"{name!r} is a server-side function; remove it from the server's modules",
                field="name",
            )
        self.store.delete(name)
        with self._lock:
            self._entries.pop(name, None)
        self._removed(entry)
        return entry

    def _removed(self, entry: Entry) -> None:
        for callback in self.on_remove:
            callback(entry)
