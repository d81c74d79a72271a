"""Persistent, content-addressed function registry.

Every registered function of a persistent kind (``dxserve.server.kinds``: "expression",
"export" or an added kind; server-side "module" functions are never stored) is
kept under the SHA-256 of its content, with a name -> digest mapping and JSON
metadata.  :class:`FunctionStore` is the small interface the server talks to;
the backends are chosen by ``stores.open_store`` from ``DXSERVE_STORE``: SQLite (the
embedded default, shared by a machine's processes) and PostgreSQL live in
``dxserve.server.stores``, and :class:`DirectoryStore` here is the older one-process
directory format (``dir:///path``), still read and imported by the SQLite store.

On-disk layout of a :class:`DirectoryStore` root::

    root/.lock                  fcntl.flock'ed by the owning process
    root/objects/<hex>          content bytes, file name = sha256 hex; written once
    root/names/<name>.json      {"format": 1, "name", "kind", "digest", "metadata", "created"}

Durability: every file is written to a unique temp file in its own directory
(``.tmp-*``), flushed, fsync'ed, ``os.replace``'d into place, and then the
directory is fsync'ed.  A put writes the object first and the name record
second, so once :meth:`DirectoryStore.put` returns, the function survives a
crash or power loss.  A crash mid-put leaves at most a stray temp file or an
unreferenced object; both are ignored on load and cleaned up when the next
owner opens the directory.

One process owns a directory: the constructor takes an exclusive, non-blocking
``flock`` on ``root/.lock`` and raises :class:`StoreLockedError` if another
process (or another open store in this process) holds it.  The lock is
released by :meth:`DirectoryStore.close` or when the process dies.  Within the
process every method is guarded by a lock and may be called from any thread.

Only the name records are read when the store is opened (and each object's
size taken with ``stat``), so opening costs memory in proportion to the number
of names, never to the stored bytes: ``records``/``record`` are served from
memory, while ``get`` reads an object from disk and checks its hash then.
Unreadable name records and records whose object is missing are skipped at
open, and a record whose object fails its hash check when read is dropped from
the index, each with a logged warning, never an exception.

Limits (``admit_put``, the rule every backend applies): with ``quota_bytes`` set,
the distinct objects the names refer to (an object shared by several names counts
once) never total more than it, and with ``put(..., max_functions=N)`` a new name
is refused once N names are held.  A put that would pass either raises
``StorageFullError`` (HTTP 507) or ``TooManyFunctionsError`` (429);
``PayloadTooLargeError`` (413) when its content alone is larger than the quota.
The check and the write happen under the store's lock, so concurrent puts cannot
overshoot together (one process owns a directory store, so that lock is the only one
needed).  Replacing a function frees its old object's bytes unless another name
still refers to it; deleting is never refused by a limit.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from dxcontract.errors import (
    FIX,
    FunctionConflictError,
    InvalidArgumentError,
    PayloadTooLargeError,
    StorageFullError,
    TooManyFunctionsError,
)
from dxserve.server.kinds import stored_names

try:  # POSIX only; on other platforms the single-owner rule is not enforced.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("dxserve.store")

__all__ = [
    "NAME_PATTERN",
    "DirectoryStore",
    "FunctionStore",
    "StoreLockedError",
    "StoredFunction",
    "StoredRecord",
    "content_digest",
    "validate_name",
]

NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$")
_DIGEST_PATTERN = re.compile(r"^sha256:([0-9a-f]{64})$")
_RECORD_FORMAT = 1
_TMP_PREFIX = ".tmp-"


class StoreLockedError(RuntimeError):
    """Another process (or open store) already owns this store directory."""


@dataclass(frozen=True)
class StoredFunction:
    """One registered function as persisted.

    ``digest`` is ``"sha256:<hex>"`` of ``content`` alone. ``metadata`` is a
    JSON-able dict (description, signature, ...). ``created`` is the ISO-8601
    UTC time at which this name was bound to this content.
    """

    name: str
    kind: str
    digest: str
    content: bytes = field(repr=False)
    metadata: dict[str, Any]
    created: str


@dataclass(frozen=True)
class StoredRecord:
    """A name record without its content: what the store keeps in memory.

    ``size`` is the byte length of the content (of its object on disk).
    """

    name: str
    kind: str
    digest: str
    size: int
    metadata: dict[str, Any]
    created: str


@runtime_checkable
class FunctionStore(Protocol):
    """What the server needs from a registry backend."""

    def put(
        self, name: str, kind: str, content: bytes, metadata: dict[str, Any], *,
        replace: bool = False, max_functions: int | None = None,
    ) -> tuple[StoredFunction, bool]: ...

    def get(self, name: str) -> StoredFunction | None: ...

    def record(self, name: str) -> StoredRecord | None: ...

    def records(self) -> list[StoredRecord]: ...

    def delete(self, name: str) -> bool: ...

    def list(self) -> list[StoredFunction]: ...

    def __len__(self) -> int: ...

    def close(self) -> None: ...


def __getattr__(name: str) -> frozenset[str]:
    # KINDS was a constant; the kinds a store keeps are now those added to dxserve.server.kinds.
    if name == "KINDS":
        return stored_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def content_digest(content: bytes) -> str:
    return "sha256:" + hashlib.sha256(content).hexdigest()


def validate_name(name: object) -> str:
    """Return ``name`` or raise InvalidArgumentError(field="name")."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidArgumentError(
            f"invalid function name {name!r}: must match {NAME_PATTERN.pattern}",
            field="name",
        )
    # The pattern already forbids a leading ".", so "." / ".." / ".tmp-*" are
    # impossible; keep an explicit guard in case the pattern is ever loosened.
    if name.strip(".") == "" or name.startswith("."):
        raise InvalidArgumentError(f"invalid function name {name!r}", field="name")
    return name


def clean_metadata(metadata: dict[str, Any] | None) -> dict[str, Any]:
    """A deep, JSON-only copy of ``metadata`` the caller cannot mutate later."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise InvalidArgumentError("metadata must be an object", field="metadata")
    try:
        return json.loads(json.dumps(metadata, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(
            f"metadata is not JSON-serializable: {e}", field="metadata"
        ) from e


def checked_put(
    name: str, kind: str, content: Any, metadata: dict[str, Any] | None,
    quota_bytes: int | None,
) -> tuple[bytes, dict[str, Any], str]:
    """``(content, metadata, digest)`` of a ``put``, its arguments checked as every store
    checks them (name, kind, bytes, JSON metadata, not larger than the whole quota)."""
    validate_name(name)
    kinds = stored_names()
    if kind not in kinds:
        raise InvalidArgumentError(f"kind must be one of {sorted(kinds)}, got {kind!r}", field="kind")
    if not isinstance(content, bytes | bytearray | memoryview):
        raise InvalidArgumentError("content must be bytes", field="content")
    content = bytes(content)
    metadata = clean_metadata(metadata)
    if quota_bytes is not None and len(content) > quota_bytes:
        raise PayloadTooLargeError(
            f"{kind} of {len(content)} bytes is larger than the store's whole quota of "
            f"{quota_bytes} bytes",
            field="body",
        )
    return content, metadata, content_digest(content)


def conflict(old: StoredRecord) -> FunctionConflictError:
    """The 409 for re-binding ``old.name`` to other content without ``replace``."""
    return FunctionConflictError(
        f"function {old.name!r} is already registered with different content "
        f"({old.kind}, {old.digest}); pass {FIX} to overwrite",
        field="name", fix={"replace": True},
    )


def store_full(used: int, quota: int, needed: int) -> StorageFullError:
    """The 507 for a put that would pass the store's quota."""
    return StorageFullError(
        f"the function store is full: {used} of {quota} bytes used, and this needs "
        f"{needed} more; delete or replace functions (DXSERVE_STORE_QUOTA_BYTES sets the quota)",
        field="body",
    )


def too_many(limit: int) -> TooManyFunctionsError:
    """The 429 for a new name past the store's function limit."""
    return TooManyFunctionsError(
        f"the server holds its limit of {limit} functions; delete some "
        "(DXSERVE_MAX_FUNCTIONS sets the limit)",
        field="name",
    )


def admit_put(
    *,
    new_name: bool,
    max_functions: int | None,
    names: Callable[[], int],
    growth: int,
    quota_bytes: int | None,
    used: Callable[[], int],
) -> None:
    """Raise unless a put may happen: the one rule every store applies, inside its own
    write lock or transaction so that concurrent writers cannot pass a limit together.

    ``new_name``: the put binds a name the store does not hold; ``names()``: how many
    it holds now (asked only then). ``growth``: bytes the distinct objects grow by
    (negative when a replacement frees more than it adds); ``used()``: their bytes now
    (asked only when ``growth > 0``). A put that adds no name and no bytes is always
    allowed, even past a limit lowered since, so a full store can still be rearranged.
    Raises ``TooManyFunctionsError`` (429) or ``StorageFullError`` (507).
    """
    if new_name and max_functions is not None and names() >= max_functions:
        raise too_many(max_functions)
    if growth > 0 and quota_bytes is not None:
        now = used()
        if now + growth > quota_bytes:
            raise store_full(now, quota_bytes, growth)


def every_function(store: FunctionStore) -> list[StoredFunction]:
    """Every function of ``store`` with its content, skipping names forgotten meanwhile."""
    functions = (store.get(rec.name) for rec in store.records())
    return [f for f in functions if f is not None]


def with_content(rec: StoredRecord, content: bytes) -> StoredFunction:
    """``rec`` with its content, holding a private copy of its metadata."""
    return StoredFunction(
        rec.name, rec.kind, rec.digest, content, copy.deepcopy(rec.metadata), rec.created
    )


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _fsync_dir(path: Path) -> None:
    if os.name != "posix":  # pragma: no cover
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _disk_full(exc: OSError) -> StorageFullError | None:
    """A full disk or quota (``ENOSPC``, ``EDQUOT``) as a 507; None for other errors."""
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    return StorageFullError(
        f"the server's disk has no space left for the function store ({exc.strerror}); "
        "nothing was stored: retry once the operator has freed space"
    )


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TMP_PREFIX, suffix=".tmp")
    except OSError as exc:
        raise _disk_full(exc) or exc from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        full = _disk_full(exc) if isinstance(exc, OSError) else None
        if full is not None:
            raise full from exc
        raise
    _fsync_dir(path.parent)


def _is_tmp(p: Path) -> bool:
    return p.name.startswith(".") or p.name.endswith(".tmp")


class DirectoryStore:
    """The embedded :class:`FunctionStore`: one local directory (``--store``).

    ``put`` semantics:

    * new name -> written, returns ``(record, True)``;
    * same name, same digest and kind, ``replace=False`` -> idempotent: the
      existing record is returned unchanged with ``False``; the new metadata is
      ignored;
    * same name, same digest and kind, ``replace=True`` -> the metadata is
      replaced (``created`` is kept), returns ``(record, False)``;
    * same name, different digest or kind, ``replace=False`` ->
      ``FunctionConflictError(field="name")`` (HTTP 409);
    * same name, different digest or kind, ``replace=True`` -> swapped, with a
      fresh ``created``; the old object is removed if nothing else refers to
      it; returns ``(record, True)``.

    So ``created_new`` is True exactly when the name now points at content it
    did not point at before.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        lock: bool = True,
        quota_bytes: int | None = None,
    ) -> None:
        self.root = Path(root)
        #: Most bytes of distinct objects the names may refer to (None or <= 0: no limit).
        self.quota_bytes = quota_bytes if quota_bytes and quota_bytes > 0 else None
        self.objects_dir = self.root / "objects"
        self.names_dir = self.root / "names"
        self.objects_dir.mkdir(parents=True, exist_ok=True)
        self.names_dir.mkdir(parents=True, exist_ok=True)
        self._mutex = threading.RLock()
        self._lock_file = None
        if lock and fcntl is not None:
            f = open(self.root / ".lock", "a+b")  # held for the store's life
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                f.close()
                raise StoreLockedError(
                    f"function store {self.root} is in use by another process"
                ) from e
            self._lock_file = f
        self._index: dict[str, StoredRecord] = {}
        self._refs: dict[str, int] = {}  # digest -> how many names refer to it
        self._sizes: dict[str, int] = {}  # digest -> object bytes (for referenced digests)
        self._used = 0  # bytes of the distinct referenced objects
        self._load()

    # -- lifecycle ---------------------------------------------------------
    def close(self) -> None:
        """Release the directory lock. The store must not be used afterwards."""
        with self._mutex:
            if self._lock_file is not None:
                self._lock_file.close()  # closing releases the flock
                self._lock_file = None

    def __enter__(self) -> DirectoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # -- public API --------------------------------------------------------
    def put(
        self, name: str, kind: str, content: bytes, metadata: dict[str, Any], *,
        replace: bool = False, max_functions: int | None = None,
    ) -> tuple[StoredFunction, bool]:
        content, metadata, digest = checked_put(name, kind, content, metadata, self.quota_bytes)
        size = len(content)
        with self._mutex:
            old = self._index.get(name)
            same = old is not None and old.digest == digest and old.kind == kind
            if same and not replace:
                self._write_object(digest, content)  # heals a corrupt object, else a no-op
                return with_content(old, content), False
            if old is not None and not same and not replace:
                raise conflict(old)
            admit_put(
                new_name=old is None, max_functions=max_functions, names=self._index.__len__,
                growth=self._growth(digest, size, old), quota_bytes=self.quota_bytes,
                used=lambda: self._used,
            )
            created = old.created if same else _now()
            record = StoredRecord(name, kind, digest, size, metadata, created)
            self._write_object(digest, content)
            self._write_record(record)
            self._index[name] = record
            self._ref(digest, size)
            if old is not None:
                self._unref(old.digest)
            return with_content(record, content), not same

    def get(self, name: str) -> StoredFunction | None:
        """The record with its content, read from disk and hash-checked (None: absent).

        A record whose object is missing or fails its hash check is dropped from
        the index (its files stay on disk) and None returned.
        """
        for _ in range(3):  # a concurrent replace may unlink the object just read
            with self._mutex:
                rec = self._index.get(name)
            if rec is None:
                return None
            path = self._object_path(rec.digest)
            try:
                content = path.read_bytes()  # outside the lock: objects are never rewritten
            except OSError as e:
                with self._mutex:
                    if self._index.get(name) is not rec:
                        continue
                    log.warning("store: dropping %r: object %s unreadable: %s", name, path.name, e)
                    self._drop(rec)
                return None
            if content_digest(content) == rec.digest:
                return with_content(rec, content)
            with self._mutex:
                if self._index.get(name) is not rec:
                    continue
                log.warning("store: dropping %r: object %s fails its hash check", name, path.name)
                self._drop(rec)
            return None
        return None

    def record(self, name: str) -> StoredRecord | None:
        """The name record alone (no content, no disk access)."""
        with self._mutex:
            rec = self._index.get(name)
            return None if rec is None else self._copy(rec)

    def records(self) -> list[StoredRecord]:
        """Every name record, by name, without content (no disk access)."""
        with self._mutex:
            return [self._copy(self._index[n]) for n in sorted(self._index)]

    def delete(self, name: str) -> bool:
        with self._mutex:
            rec = self._index.get(name)
            if rec is None:
                return False
            path = self._record_path(name)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # unlink is atomic
            _fsync_dir(self.names_dir)
            del self._index[name]
            self._unref(rec.digest)
            return True

    def list(self) -> list[StoredFunction]:
        """Every function with its content (reads every object: prefer ``records``)."""
        return every_function(self)

    @property
    def used_bytes(self) -> int:
        """Bytes of the distinct objects the names refer to (what the quota bounds)."""
        with self._mutex:
            return self._used

    def __len__(self) -> int:
        with self._mutex:
            return len(self._index)

    def __contains__(self, name: object) -> bool:
        with self._mutex:
            return name in self._index

    # -- internals ---------------------------------------------------------
    @staticmethod
    def _copy(rec: StoredRecord) -> StoredRecord:
        # Records are frozen but metadata is a dict: hand out private copies.
        return dataclasses.replace(rec, metadata=copy.deepcopy(rec.metadata))

    def _growth(self, digest: str, size: int, old: StoredRecord | None) -> int:
        """Bytes the distinct objects grow by if a name now bound to ``old`` is bound to
        ``digest`` (negative when the old object goes and was larger)."""
        added = 0 if self._refs.get(digest) else size
        freed = 0
        if old is not None and old.digest != digest and self._refs.get(old.digest) == 1:
            freed = self._sizes.get(old.digest, 0)
        return added - freed

    def _ref(self, digest: str, size: int) -> None:
        count = self._refs.get(digest, 0)
        if count == 0:
            self._sizes[digest] = size
            self._used += size
        self._refs[digest] = count + 1

    def _unref(self, digest: str, *, remove: bool = True) -> None:
        """One name fewer refers to ``digest``; the last one gone removes the object."""
        count = self._refs.get(digest, 0) - 1
        if count > 0:
            self._refs[digest] = count
            return
        self._refs.pop(digest, None)
        self._used -= self._sizes.pop(digest, 0)
        if remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._object_path(digest))
            _fsync_dir(self.objects_dir)

    def _drop(self, rec: StoredRecord) -> None:
        # A record whose object is gone or corrupt: forgotten in memory, kept on disk
        # (it may be recoverable), so its name can be registered again.
        del self._index[rec.name]
        self._unref(rec.digest, remove=False)

    def _record_path(self, name: str) -> Path:
        return self.names_dir / f"{name}.json"

    def _object_path(self, digest: str) -> Path:
        m = _DIGEST_PATTERN.fullmatch(digest)
        if m is None:
            raise ValueError(f"bad digest {digest!r}")
        return self.objects_dir / m.group(1)

    def _write_object(self, digest: str, content: bytes) -> None:
        path = self._object_path(digest)
        try:
            if content_digest(path.read_bytes()) == digest:
                return  # content-addressed: already there and intact
            log.warning("store: object %s is corrupt; rewriting it", path)
        except FileNotFoundError:
            pass
        _atomic_write(path, content)

    def _write_record(self, rec: StoredRecord) -> None:
        doc = {
            "format": _RECORD_FORMAT,
            "name": rec.name,
            "kind": rec.kind,
            "digest": rec.digest,
            "metadata": rec.metadata,
            "created": rec.created,
        }
        data = json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"
        _atomic_write(self._record_path(rec.name), data)

    def _load(self) -> None:
        referenced: set[str] = set()  # digests named by any parseable record
        unparseable = 0
        for path in sorted(self.names_dir.iterdir()):
            if _is_tmp(path):
                self._remove_stray(path)
                continue
            if path.suffix != ".json" or not path.is_file():
                log.warning("store: ignoring unexpected file %s", path)
                continue
            rec, digest = self._load_record(path)
            if digest is None:
                unparseable += 1
            else:
                referenced.add(digest)
            if rec is not None:
                self._index[rec.name] = rec
                self._ref(rec.digest, rec.size)
        for path in self.objects_dir.iterdir():
            if _is_tmp(path):
                self._remove_stray(path)
            elif (
                self._lock_file is not None
                and not unparseable
                and re.fullmatch(r"[0-9a-f]{64}", path.name)
                and ("sha256:" + path.name) not in referenced
            ):
                # Left by a put that crashed between object and record (never
                # acknowledged) or a delete that crashed before removing it.
                # Skipped while any record is unreadable: it may point here.
                log.info("store: removing unreferenced object %s", path)
                with contextlib.suppress(OSError):
                    path.unlink()
        log.info(
            "store: %d function(s), %d bytes, in %s", len(self._index), self._used, self.root
        )

    def _remove_stray(self, path: Path) -> None:
        # Only the owner may delete temp files: another process might be writing one.
        if self._lock_file is not None:
            log.info("store: removing stray temp file %s", path)
            with contextlib.suppress(OSError):
                path.unlink()

    def _load_record(self, path: Path) -> tuple[StoredRecord | None, str | None]:
        """(record or None if it must be skipped, its digest or None if unparseable)."""
        digest = None
        try:
            doc = json.loads(path.read_bytes())
            name, kind, created = doc["name"], doc["kind"], doc["created"]
            metadata = doc.get("metadata", {})
            if isinstance(doc["digest"], str) and _DIGEST_PATTERN.fullmatch(doc["digest"]):
                digest = doc["digest"]
            if name != path.name[: -len(".json")]:
                raise ValueError(f"record name {name!r} does not match its file name")
            validate_name(name)
            if kind not in stored_names():  # e.g. a plug-in kind not added in this process
                raise ValueError(f"unknown kind {kind!r}")
            if not isinstance(metadata, dict) or not isinstance(created, str):
                raise ValueError("bad metadata or created")
            obj = self._object_path(doc["digest"])
        except Exception as e:  # never crash on a bad record
            log.warning("store: skipping unreadable name record %s: %s", path, e)
            return None, digest
        try:
            # Only the size now: the hash is checked whenever the content is read (get).
            size = obj.stat().st_size
        except OSError as e:
            log.warning("store: skipping %r: object %s unreadable: %s", name, obj.name, e)
            return None, digest
        return StoredRecord(name, kind, digest, size, metadata, created), digest
