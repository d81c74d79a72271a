"""The function registry: one name space for every kind of function.

The kinds (``dxserve.server.kinds``) are ``module`` (the deployer's trusted Python,
``@dxserve.function``, never stored), ``expression`` (a whitelisted ``jnp``
expression), ``export`` (a JAX export uploaded by a client) and any kind added
with ``dxserve.server.kinds.add_kind``. Functions of persistent kinds are kept in a
content-addressed ``FunctionStore``, so they survive restarts.

Stored functions are built lazily: at start the registry reads only the store's
name records (description and signature are kept in their metadata), and a
function is built from its content on first use (``get``). At most
``max_loaded`` built functions, holding at most ``max_loaded_bytes`` of content,
stay in memory (least recently used evicted first; ``on_evict`` callbacks drop
what was prepared for them), and an evicted one is built again when next used.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dxcontract.errors import (
    DxError,
    FunctionConflictError,
    InvalidArgumentError,
    OverloadedError,
    UnknownFunctionError,
)
from dxcontract.lru import LRU
from dxserve.core.functions import FunctionInfo, module_functions
from dxserve.server import kinds
from dxserve.server.kinds.expression import expression_content
from dxserve.server.kinds.module import MODULE
from dxserve.server.origins import Origin, module_origin, stored_origin
from dxserve.server.stores.directory import (
    FunctionStore,
    StoredFunction,
    StoredRecord,
    too_many,
    validate_name,
)

#: The metadata key of a stored function's ``Entry.facts``.
FACTS = "describe"

__all__ = ["Entry", "Registry", "expression_content"]

log = logging.getLogger("dxserve.registry")


@dataclass(frozen=True)
class Entry:
    """A registered function and what clients may know about it."""

    name: str
    kind: str  # a kind's name: "module", "expression", "export", ...
    #: The callable; None in the registry's index of a stored function not built yet.
    fn: Callable | None = field(default=None, repr=False, compare=False)
    description: str = ""
    signature: dict[str, Any] = field(default_factory=dict)
    digest: str | None = None
    created: str | None = None
    #: Shapes and an example, for ``describe`` (``dxserve.server.describe.facts``); None: unknown.
    facts: dict[str, Any] | None = field(default=None, compare=False)

    def describe(self) -> dict[str, Any]:
        """The JSON of ``GET /functions/{name}``, as this entry's kind describes it."""
        kind = kinds.get_kind(self.kind)
        return kind.describe(self) if kind is not None else kinds.standard_description(self)


def _build(record: StoredFunction, kind: Any) -> Entry:
    if kind is None or not kind.persistent:
        raise InvalidArgumentError(
            f"kind must be one of {sorted(kinds.stored_names())}, got {record.kind!r}",
            field="kind",
        )
    admit = getattr(kind, "admit", None)  # a kind that checks content out of process first
    if admit is not None:
        admit(record.content, record.metadata)
    built = kind.build(record.content)
    # Persisted executables of stored functions are keyed by kind and content.
    from dxserve.frameworks.jax import executable_cache  # keys executables by content

    executable_cache.identify(built.fn, kind.name, record.content)
    return Entry(
        record.name,
        record.kind,
        built.fn,
        record.metadata.get("description", ""),
        built.signature,
        record.digest,
        record.created,
        built.facts,
    )


def _origin_of(kind: str, name: str, digest: str) -> Origin | None:
    found = kinds.get_kind(kind)
    return stored_origin(found, name, digest) if found is not None else None


def _index_entry(record: StoredRecord | StoredFunction) -> Entry:
    """The unbuilt entry of a stored function, from its record's metadata alone."""
    return Entry(
        record.name,
        record.kind,
        None,
        record.metadata.get("description", ""),
        record.metadata.get("signature", {}),
        record.digest,
        record.created,
        record.metadata.get(FACTS),
    )


def _json_able(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


class Registry:
    """Thread-safe name -> ``Entry`` map backed by an optional persistent store.

    ``on_remove`` callbacks get a built entry when a function is deleted or
    replaced, ``on_evict`` ones when a built stored function leaves memory (it stays
    registered); both may drop what was prepared for ``entry.fn``.
    """

    def __init__(
        self,
        store: FunctionStore,
        max_functions: int = 1000,
        *,
        max_loaded: int = 64,
        max_loaded_bytes: int = 0,
        sync_interval: float = 0.25,
        resources: Mapping[str, Any] | None = None,
        suggest: bool = True,
    ) -> None:
        self.store = store
        #: Name close matches in an unknown function's 404 (off where the names are
        #: private: the caller may not be one who may list them).
        self.suggest = suggest
        #: What this server's kinds are bound to (``FunctionKind.bind``): its export gate
        self.resources = dict(resources or {})
        self._bound: dict[str, Any] = {}
        #: Other processes write this store too: follow its change log (``refresh``).
        self.shared = bool(getattr(store, "shared", False))
        #: Seconds after which a request checks the store for other processes' writes.
        self.sync_interval = sync_interval
        self._seq = 0  # the last change of the store's log applied here
        self._checked = float("-inf")  # time.monotonic() of the last check
        self._sync_lock = threading.Lock()
        self.max_functions = max_functions
        #: Most stored functions kept built in memory (at least 1).
        self.max_loaded = max(1, max_loaded)
        #: Most content bytes of built stored functions in memory (0: no byte bound).
        self.max_loaded_bytes = max_loaded_bytes
        self._entries: dict[str, Entry] = {}  # stored functions: unbuilt (fn None)
        self._loaded: LRU[str, tuple[Entry, int]] = LRU(self.max_loaded)  # (built, size)
        self._loaded_bytes = 0
        self._lock = threading.Lock()
        self._building: dict[str, threading.Lock] = {}  # one build per name at a time
        self.on_remove: list[Callable[[Entry], None]] = []
        self.on_evict: list[Callable[[Entry], None]] = []
        #: built callable -> how to build it again elsewhere (see ``origins``)
        self._origins: weakref.WeakKeyDictionary[Callable, Origin] = weakref.WeakKeyDictionary()

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
        built = MODULE.wrap(fn, info.example)
        entry = Entry(
            info.name, MODULE.name, built.fn, info.description, built.signature, facts=built.facts
        )
        self._remember(built.fn, module_origin(built.fn))
        with self._lock:
            self._entries[info.name] = entry
        return entry

    def load_store(self) -> int:
        """Index every stored function from its name record; returns how many.

        Nothing is built or read from disk here (``get`` builds on first use), except
        for records written before signatures were kept in the metadata: those are
        built once and their record upgraded, and one that no longer loads is skipped.
        """
        indexed = 0
        if self.shared:  # changes after this point are applied by ``refresh``
            self._seq = self.store.generation()
            self._checked = time.monotonic()
        for record in self.store.records():
            if "signature" in record.metadata:
                entry = _index_entry(record)
            else:
                try:
                    entry = self._upgrade(record.name)
                except Exception as exc:  # keep serving the rest
                    log.warning("skipping stored function %s: %s", record.name, exc)
                    continue
            with self._lock:
                self._entries[record.name] = entry
            indexed += 1
        return indexed

    def _upgrade(self, name: str) -> Entry:
        full = self.store.get(name)
        if full is None:
            raise LookupError("its object is missing or corrupt")
        built = _build(full, self.kind(full.kind))
        if not _json_able(built.signature):
            return _index_entry(full)
        metadata = {**full.metadata, "signature": built.signature}
        if built.facts is not None and _json_able(built.facts):
            metadata[FACTS] = built.facts
        stamp = getattr(self.kind(full.kind), "stamp", None)
        if stamp is not None:  # the export gate's pass, so later starts need not gate it again
            metadata.update(stamp(full.content))
        record, _ = self.store.put(name, full.kind, full.content, metadata, replace=True)
        return _index_entry(record)

    # --- reads -------------------------------------------------------------
    def kind(self, name: str) -> Any:
        """The kind called ``name``, bound to this registry's ``resources`` where it binds
        (``FunctionKind.bind``); None for an unknown kind."""
        bound = self._bound.get(name)
        if bound is None:
            kind = kinds.get_kind(name)
            bind = getattr(kind, "bind", None)
            bound = bind(**self.resources) if bind is not None else kind
            if bound is not None:
                self._bound[name] = bound
        return bound

    def get(self, name: Any, field_name: str = "function") -> Entry:
        """The function called ``name``, built (a stored one is built on first use)."""
        entry = self.lookup(name, field_name)
        return entry if entry.fn is not None else self._load(entry, field_name)

    def version(self, record: StoredFunction) -> Entry:
        """An entry built from ``record``, a version of a stored function that need not be
        the registered one (a detached job's, pinned when it was submitted); neither
        registered nor kept here."""
        return _build(record, self.kind(record.kind))

    def loaded(self, name: Any) -> Entry | None:
        """``get`` without building: the built entry, or None if it needs a build."""
        self.refresh()
        entry = self._entries.get(name) if isinstance(name, str) else None
        if entry is None or entry.fn is not None:
            return entry
        item = self._loaded.get(name)
        return item[0] if item is not None and item[0].digest == entry.digest else None

    def lookup(self, name: Any, field_name: str = "function") -> Entry:
        """The function's entry without building it (``fn`` is None if not built)."""
        self.refresh()
        entry = self._entries.get(name) if isinstance(name, str) else None
        if entry is None and self.shared and isinstance(name, str):
            entry = self._read_through(name)
        if entry is None:
            if not isinstance(name, str):
                raise UnknownFunctionError(
                    f"function must be a registered name (a string), got {type(name).__name__}",
                    field=field_name,
                )
            close: list[str] = []
            if self.suggest:
                with self._lock:
                    close = difflib.get_close_matches(name, list(self._entries), n=3, cutoff=0.75)
            guess = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
            raise UnknownFunctionError(
                f"no function named {name!r}; {guess}GET /functions lists them", field=field_name
            )
        return entry

    def _load(self, index: Entry, field_name: str) -> Entry:
        """Build a stored function from its content and keep it in the loaded LRU."""
        with self._lock:
            building = self._building.setdefault(index.name, threading.Lock())
        with building:
            ready = self.loaded(index.name)
            if ready is not None:
                return ready  # built by the request this one waited for
            record = self.store.get(index.name)
            if record is None or record.digest != index.digest:
                with self._lock:
                    current = self._entries.get(index.name)
                if current is not index:  # replaced or deleted meanwhile: ask again
                    record = None
                else:
                    self._unindex(index)
                    raise UnknownFunctionError(
                        f"stored function {index.name!r} cannot be read (its object is "
                        "missing or corrupt); register it again",
                        field=field_name,
                    )
            if record is not None:
                return self._build_and_admit(index, record, field_name)
        return self.get(index.name, field_name)  # outside ``building``: it is not reentrant

    def _build_and_admit(self, index: Entry, record: StoredFunction, field_name: str) -> Entry:
        try:
            built = _build(record, self.kind(record.kind))
        except MemoryError:
            raise OverloadedError(
                f"not enough memory to load {index.name!r} now; retry later", field=field_name
            ) from None
        except Exception as exc:
            log.warning("stored function %s no longer loads: %s", index.name, exc)
            self._unindex(index)
            detail = exc.detail if isinstance(exc, DxError) else str(exc)
            raise UnknownFunctionError(
                f"stored function {index.name!r} no longer loads here: {detail}",
                field=field_name,
            ) from None
        entry = dataclasses.replace(index, fn=built.fn)
        self._remember(built.fn, _origin_of(record.kind, record.name, record.digest))
        with self._lock:
            if self._entries.get(index.name) is not index:
                return entry  # replaced meanwhile: serve this call, keep nothing
            evicted = self._admit(entry, len(record.content))
        self._notify(self.on_evict, evicted)
        return entry

    def _admit(self, entry: Entry, size: int) -> list[Entry]:
        """Keep a built entry, evicting least recently used ones; call under ``_lock``."""
        evicted = []
        old = self._loaded.pop(entry.name)
        if old is not None:
            self._loaded_bytes -= old[1]
            evicted.append(old[0])
        while self._loaded and (
            len(self._loaded) >= self.max_loaded
            or (self.max_loaded_bytes and self._loaded_bytes + size > self.max_loaded_bytes)
        ):
            oldest = self._loaded.keys()[0]
            gone = self._loaded.pop(oldest)
            if gone is not None:
                self._loaded_bytes -= gone[1]
                evicted.append(gone[0])
        self._loaded.put(entry.name, (entry, size))
        self._loaded_bytes += size
        return evicted

    def _unindex(self, index: Entry) -> None:
        # A stored function that cannot be built any more is dropped, as it was
        # skipped at start before functions were built lazily; its record stays.
        with self._lock:
            if self._entries.get(index.name) is index:
                del self._entries[index.name]

    @staticmethod
    def _notify(callbacks: list[Callable[[Entry], None]], entries: list[Entry]) -> None:
        for entry in entries:
            for callback in callbacks:
                callback(entry)

    # --- origins: rebuilding a function in another process ---------------------
    def _remember(self, fn: Callable, origin: Origin | None) -> None:
        if origin is None:
            return
        try:
            with self._lock:
                self._origins[fn] = origin
        except TypeError:  # not weak-referenceable: it has no origin then
            pass

    def origin(self, fn: Callable) -> Origin | None:
        """How the registered callable ``fn`` can be built again (None: it cannot)."""
        try:
            with self._lock:
                return self._origins.get(fn)
        except TypeError:
            return None

    def content(self, origin: Origin) -> bytes | None:
        """A stored function's content bytes, if the store still holds that version."""
        record = self.store.get(origin.name)
        return record.content if record is not None and record.digest == origin.digest else None

    def loaded_count(self) -> int:
        """How many stored functions are built in memory now."""
        return len(self._loaded)

    def list(self) -> list[Entry]:
        self.refresh()
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: e.name)

    def __len__(self) -> int:
        return len(self._entries)

    def registered(self) -> int:
        """How many functions were registered by clients (server-side ones not counted)."""
        with self._lock:  # concurrent registrations resize the dict
            return sum(1 for e in self._entries.values() if e.kind != MODULE.name)

    # --- other processes' writes (shared stores) ----------------------------
    def refresh(self, *, force: bool = False) -> None:
        """Apply what other processes wrote to a shared store since the last check.

        Checked at most every ``sync_interval`` seconds (and at once when the store
        hints at a change: a PostgreSQL notification), so a deletion or replacement
        committed anywhere is seen by every request that starts ``sync_interval``
        seconds later. The check itself is cheap: SQLite's ``data_version`` first, then
        only the names in the change log since the last applied change are re-read.
        """
        if not self.shared:
            return
        now = time.monotonic()
        due = force or now - self._checked >= self.sync_interval
        pushed = self._pushes and self.store.maybe_changed()  # a notification arrived
        if not (due or pushed):
            return
        if not self._sync_lock.acquire(blocking=force):
            return  # another thread is applying the same changes right now
        try:
            self._checked = now
            # SQLite's hint is itself a (cheap) query: asked once due, and nothing else
            # is read when it says no other connection committed.
            if not (force or pushed or self._pushes) and not self.store.maybe_changed():
                return
            seq, names = self.store.changes(self._seq)
            if names is None:  # the log no longer reaches back: compare every record
                names = sorted({r.name for r in self.store.records()} | set(self._stored_names()))
            for name in names:
                self._apply(name, self.store.record(name))
            self._seq = seq
        except Exception as exc:  # a store that is briefly unreachable: serve what we have
            log.warning("registry: cannot read the store's changes: %s", exc)
        finally:
            self._sync_lock.release()

    @property
    def _pushes(self) -> bool:
        # Stores that push hints (PostgreSQL's NOTIFY) are asked on every request.
        return bool(getattr(self.store, "pushes_changes", False))

    def _stored_names(self) -> list[str]:
        with self._lock:
            return [n for n, e in self._entries.items() if e.kind != MODULE.name]

    def _read_through(self, name: str) -> Entry | None:
        """A name unknown here: registered by another process since the last check?"""
        try:
            record = self.store.record(name)
        except Exception as exc:
            log.warning("registry: cannot read %r from the store: %s", name, exc)
            return None
        if record is None:
            return None
        self._apply(name, record)
        return self._entries.get(name)

    def _apply(self, name: str, record: StoredRecord | None) -> None:
        """Make this process's entry for ``name`` match the store's ``record``."""
        with self._lock:
            current = self._entries.get(name)
            if current is not None and current.kind == MODULE.name:
                return  # a server-side function of this process shadows the name
            if record is None:
                if current is None:
                    return
                del self._entries[name]
            elif current is not None and current.digest == record.digest:
                if current.created == record.created and current.description == \
                        record.metadata.get("description", ""):
                    return
                index = _index_entry(record)  # new metadata, same content: keep what is built
                self._entries[name] = (
                    dataclasses.replace(index, signature=current.signature, facts=current.facts)
                    if "signature" not in record.metadata else index
                )
                return
            else:
                index = _index_entry(record) if "signature" in record.metadata else None
                if index is None:  # an old record: built on first use, described then
                    index = _index_entry(record)
                self._entries[name] = index
                if current is None:
                    return
        self._removed(current)  # deleted or replaced elsewhere: drop what was built of it

    # --- writes ------------------------------------------------------------
    def register_body(self, body: dict[str, Any]) -> tuple[Entry, bool]:
        """Register from a decoded ``POST /functions`` body; ``(entry, created)``.

        Validates the body (``RegisterFunction``, exactly one kind's fields, that
        kind's ``validate``), then builds, persists and publishes as ``register``.
        Raises the typed errors of ``dxcontract.errors``.
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
        not compile is refused without touching the store. ``max_functions`` is
        decided by the store, in the same write transaction as the insert
        (``store.admit_put``), so it holds across every process sharing the store;
        a store already at the limit is told before anything is built.
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
        if self._store_full_of_names(name):
            raise too_many(self.max_functions)
        metadata = {"description": description}
        # Built before anything is written: content that does not load never reaches the store.
        built = _build(StoredFunction(name, kind, "", content, metadata, ""), self.kind(kind))
        if _json_able(built.signature):  # so GET /functions never needs to build it
            metadata["signature"] = built.signature
            if built.facts is not None and _json_able(built.facts):
                metadata[FACTS] = built.facts
        stamp = getattr(self.kind(kind), "stamp", None)
        if stamp is not None:  # e.g. the export gate's pass, bound to the content's sha256
            metadata.update(stamp(content))
        record, created = self.store.put(
            name, kind, content, metadata, replace=replace, max_functions=self.max_functions
        )
        self._remember(built.fn, _origin_of(kind, name, record.digest))
        idempotent = existing is not None and existing.digest == record.digest and not replace
        with self._lock:
            current = self._loaded.peek(name)
            if idempotent and current is not None and current[0].digest == record.digest:
                return current[0], created  # keep the entry (and its compiled executables)
            entry = dataclasses.replace(
                _index_entry(record) if "signature" in record.metadata else built,
                fn=built.fn,
                description=record.metadata.get("description", description),
                digest=record.digest,
                created=record.created,
            )
            old = self._loaded.pop(name)  # the replaced function, if it was built
            if old is not None:
                self._loaded_bytes -= old[1]
            self._entries[name] = dataclasses.replace(entry, fn=None)
            evicted = self._admit(entry, len(content))
        if old is not None:
            self._notify(self.on_remove, [old[0]])
        self._notify(self.on_evict, evicted)
        return entry, created

    def _store_full_of_names(self, name: str) -> bool:
        """A cheap look before building: would the store refuse ``name`` as one too many?
        (Advisory: the store's ``put`` decides, under its lock.)"""
        try:
            return self.store.record(name) is None and len(self.store) >= self.max_functions
        except OverloadedError:
            return False  # the store is unreachable now: the put reports it

    def delete(self, name: str) -> Entry:
        entry = self.lookup(name, "name")  # no need to build what is being deleted
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
        with self._lock:  # a stored function: what was built of it goes too
            item = self._loaded.pop(entry.name) if entry.fn is None else None
            if item is not None:
                self._loaded_bytes -= item[1]
            self._building.pop(entry.name, None)
        for callback in self.on_remove:
            callback(item[0] if item is not None else entry)
