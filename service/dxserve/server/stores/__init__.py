"""Store backends, chosen by the ``--store`` / ``DXSERVE_STORE`` setting.

=================================  ===============================================
``DXSERVE_STORE``                  backend
=================================  ===============================================
a path (the default)               ``SqliteStore``: ``<path>/store.db``, shared by
                                   the processes of one machine; a directory store
                                   found there is imported once
``sqlite:///abs/path[/store.db]``  the same, spelled as a URL
``postgresql://...``               ``PostgresStore``: processes on many machines
``dir:///abs/path``                ``store.DirectoryStore``: the older one-process
                                   directory format (exclusive lock)
=================================  ===============================================

Every backend implements ``store.FunctionStore``; the shared ones (``shared = True``)
also ``changes(since)`` and ``maybe_changed()``, which the registry uses to see
other processes' writes (see ``registry.Registry.refresh``). Detached jobs live in the
same store, beside the functions (``stores.jobs.open_jobs``).
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

from dxserve.server.stores.directory import DirectoryStore, FunctionStore

__all__ = ["describe_store", "open_store"]


def open_store(spec: str | os.PathLike[str], *, quota_bytes: int | None = None) -> FunctionStore:
    """The store that ``spec`` (a path or URL, see the module docstring) names."""
    text = os.fspath(spec)
    scheme = urlsplit(text).scheme.lower() if "://" in text else ""
    if scheme in ("postgresql", "postgres"):
        from dxserve.server.stores.postgres import PostgresStore

        return PostgresStore(text, quota_bytes=quota_bytes)
    if scheme in ("sqlite", "dir", "file"):
        path = unquote(urlsplit(text).path) or "."
        if scheme == "dir":
            return DirectoryStore(path, quota_bytes=quota_bytes)
        from dxserve.server.stores.sqlite import SqliteStore

        return SqliteStore(path, quota_bytes=quota_bytes)
    if scheme:
        raise ValueError(
            f"store {text!r}: unknown scheme {scheme!r} (a path, sqlite://, postgresql:// "
            "or dir://)"
        )
    from dxserve.server.stores.sqlite import SqliteStore

    return SqliteStore(text, quota_bytes=quota_bytes)


def describe_store(spec: str | os.PathLike[str]) -> str:
    """``spec`` with any password hidden, for logs."""
    text = os.fspath(spec)
    parts = urlsplit(text) if "://" in text else None
    if parts is None or parts.password is None:
        return text
    return text.replace(f":{parts.password}@", ":***@", 1)
