"""Persistent, content-addressed function registry.

Every registered function of a persistent kind (``dxserve.kinds``: "expression",
"export" or an added kind; server-side "module" functions are never stored) is
kept under the SHA-256 of its content, with a name -> digest mapping and JSON
metadata.  :class:`FunctionStore` is the small interface the server talks to, so
a Redis or object-store backend can be dropped in later; :class:`DirectoryStore`
is the embedded default.

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

Everything is loaded into memory when the store is opened (each object's hash
is verified then); ``get``/``list`` are served from memory.  Unreadable name
records and records whose object is missing or corrupt are skipped with a
logged warning, never an exception.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from dxclient.errors import FunctionConflictError, InvalidArgumentError

from .kinds import stored_names

try:  # POSIX only; on other platforms the single-owner rule is not enforced.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

__all__ = [
    "NAME_PATTERN",
    "DirectoryStore",
    "FunctionStore",
    "StoreLockedError",
    "StoredFunction",
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


@runtime_checkable
class FunctionStore(Protocol):
    """What the server needs from a registry backend."""

    def put(
        self,
        name: str,
        kind: str,
        content: bytes,
        metadata: dict[str, Any],
        *,
        replace: bool = False,
    ) -> tuple[StoredFunction, bool]: ...

    def get(self, name: str) -> StoredFunction | None: ...

    def delete(self, name: str) -> bool: ...

    def list(self) -> list[StoredFunction]: ...

    def __len__(self) -> int: ...

    def close(self) -> None: ...


def __getattr__(name: str) -> frozenset[str]:
    # KINDS was a constant; the kinds a store keeps are now those added to dxserve.kinds.
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


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TMP_PREFIX, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
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

    def __init__(self, root: str | os.PathLike[str], *, lock: bool = True) -> None:
        self.root = Path(root)
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
        self._index: dict[str, StoredFunction] = {}
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
        self,
        name: str,
        kind: str,
        content: bytes,
        metadata: dict[str, Any],
        *,
        replace: bool = False,
    ) -> tuple[StoredFunction, bool]:
        validate_name(name)
        kinds = stored_names()
        if kind not in kinds:
            raise InvalidArgumentError(
                f"kind must be one of {sorted(kinds)}, got {kind!r}", field="kind"
            )
        if not isinstance(content, bytes | bytearray | memoryview):
            raise InvalidArgumentError("content must be bytes", field="content")
        content = bytes(content)
        metadata = self._clean_metadata(metadata)
        digest = content_digest(content)

        with self._mutex:
            old = self._index.get(name)
            same = old is not None and old.digest == digest and old.kind == kind
            if same and not replace:
                return old, False
            if old is not None and not same and not replace:
                raise FunctionConflictError(
                    f"function {name!r} is already registered with different content "
                    f"({old.kind}, {old.digest}); pass replace=true to overwrite",
                    field="name",
                )
            created = old.created if same else _now()
            record = StoredFunction(name, kind, digest, content, metadata, created)
            self._write_object(digest, content)
            self._write_record(record)
            self._index[name] = record
            if old is not None and old.digest != digest:
                self._maybe_remove_object(old.digest)
            return self._copy(record), not same

    def get(self, name: str) -> StoredFunction | None:
        with self._mutex:
            rec = self._index.get(name)
            return None if rec is None else self._copy(rec)

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
            self._maybe_remove_object(rec.digest)
            return True

    def list(self) -> list[StoredFunction]:
        with self._mutex:
            return [self._copy(self._index[n]) for n in sorted(self._index)]

    def __len__(self) -> int:
        with self._mutex:
            return len(self._index)

    def __contains__(self, name: object) -> bool:
        with self._mutex:
            return name in self._index

    # -- internals ---------------------------------------------------------
    @staticmethod
    def _clean_metadata(metadata: dict[str, Any] | None) -> dict[str, Any]:
        if metadata is None:
            return {}
        if not isinstance(metadata, dict):
            raise InvalidArgumentError("metadata must be an object", field="metadata")
        try:
            # Round-trip: a deep, JSON-only copy the caller cannot mutate later.
            return json.loads(json.dumps(metadata, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(
                f"metadata is not JSON-serializable: {e}", field="metadata"
            ) from e

    @staticmethod
    def _copy(rec: StoredFunction) -> StoredFunction:
        # Records are frozen but metadata is a dict: hand out private copies.
        return StoredFunction(
            rec.name, rec.kind, rec.digest, rec.content, copy.deepcopy(rec.metadata), rec.created
        )

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

    def _write_record(self, rec: StoredFunction) -> None:
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

    def _maybe_remove_object(self, digest: str) -> None:
        if any(r.digest == digest for r in self._index.values()):
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._object_path(digest))
        _fsync_dir(self.objects_dir)

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
        log.info("store: loaded %d function(s) from %s", len(self._index), self.root)

    def _remove_stray(self, path: Path) -> None:
        # Only the owner may delete temp files: another process might be writing one.
        if self._lock_file is not None:
            log.info("store: removing stray temp file %s", path)
            with contextlib.suppress(OSError):
                path.unlink()

    def _load_record(self, path: Path) -> tuple[StoredFunction | None, str | None]:
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
            content = obj.read_bytes()
        except OSError as e:
            log.warning("store: skipping %r: object %s unreadable: %s", name, obj.name, e)
            return None, digest
        if content_digest(content) != digest:
            log.warning("store: skipping %r: object %s fails its hash check", name, obj.name)
            return None, digest
        return StoredFunction(name, kind, digest, content, metadata, created), digest
