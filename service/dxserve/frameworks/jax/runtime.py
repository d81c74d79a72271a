"""JAX's process-wide choices for a server process, made once when it starts.

Nothing else changes JAX's configuration: importing the library, or building a
``Service`` or an app, leaves it as it was. ``server/runtime.py``'s ``bootstrap`` calls
``configure`` first, and ``warm_up`` last:

* XLA's thread pools start below the event loop's priority, so a long computation
  does not delay ``/health`` (``threads``);
* JAX's persistent compilation cache and dxserve's executable cache, so a restarted
  server loads compiled operators instead of compiling them, each bounded in bytes
  (JAX's entries are pruned by ``CachePruner``, the executables by their cache);
* a warm-up that pays JAX's one-time costs before the first request.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import jax
import numpy as np

from dxserve.core import threads
from dxserve.core.preparation import prepare
from dxserve.frameworks.jax import executable_cache
from dxserve.settings import Settings

log = logging.getLogger("dxserve.runtime")

_warmed = False


def configure(settings: Settings) -> None:
    """JAX's part of making this process a server process (``server/runtime.py``
    calls it first): synchronous dispatch, XLA's threads at a lower priority, the
    persistent compilation cache and the executable cache."""
    # A server thread waits for every result it dispatches, so asynchronous dispatch on
    # the CPU only adds a hand-off to one of XLA's threads per call: a wake-up that
    # costs ~100 us when that thread has gone to sleep between requests.
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    # First, before anything starts a JAX backend: XLA's thread pools inherit this.
    threads.start_backend_at_low_priority(settings.compute_nice, start=jax.devices)
    enable_compilation_cache(settings.compilation_cache, settings.compilation_cache_mb << 20)
    executable_cache.configure(
        Path(settings.compilation_cache) / "executables" if settings.compilation_cache else None,
        settings.executable_cache_mb << 20,
    )


def enable_compilation_cache(directory: str, max_bytes: int = 0) -> None:
    """JAX's persistent compilation cache in ``directory`` ("" leaves it off), its
    entries kept under ``max_bytes`` (0: unbounded) by a ``CachePruner``."""
    if not directory:
        return
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if max_bytes > 0:
        global _pruner
        if _pruner is not None:
            _pruner.stop()
        _pruner = CachePruner(Path(directory), max_bytes)
        _pruner.start()


def prune_cache_directory(directory: Path, max_bytes: int) -> int:
    """Delete the least recently used files directly in ``directory`` until they total
    at most ``max_bytes``; returns the bytes left. Subdirectories (``executables``,
    bounded by its own cache) are not counted or touched.

    JAX's own size bound (``jax_compilation_cache_max_size``) needs the optional
    ``filelock`` package and fails on entries written while it was off, so dxserve
    bounds the directory itself. Recency is the later of a file's access and
    modification times: JAX rewrites nothing on a hit, so access time is the only
    trace of one (where the file system records it).
    """
    files = []
    try:
        with os.scandir(directory) as it:
            for item in it:
                try:
                    if not item.is_file(follow_symlinks=False):
                        continue
                    st = item.stat(follow_symlinks=False)
                except OSError:  # removed meanwhile
                    continue
                files.append((max(st.st_atime_ns, st.st_mtime_ns), st.st_size, item.path))
    except FileNotFoundError:  # a fresh cache: JAX makes the directory on its first entry
        return 0
    except OSError as exc:
        log.warning("compilation cache %s not pruned: %s", directory, exc)
        return 0
    total = sum(size for _, size, _ in files)
    for _, size, path in sorted(files):
        if total <= max_bytes:
            break
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("compilation cache: cannot remove %s: %s", path, exc)
            continue
        total -= size
    return total


class CachePruner:
    """Keeps a cache directory under a byte bound: prunes at start, then every
    ``interval`` seconds from a daemon thread (JAX writes entries without telling)."""

    def __init__(self, directory: Path, max_bytes: int, interval: float = 60.0) -> None:
        self.directory, self.max_bytes, self.interval = directory, max_bytes, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        prune_cache_directory(self.directory, self.max_bytes)
        self._thread = threading.Thread(target=self._run, name="dxserve-cache-pruner", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            prune_cache_directory(self.directory, self.max_bytes)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


_pruner: CachePruner | None = None


def _warm_up_function(x):
    return jax.numpy.sum(jax.numpy.sin(x) * x)


def warm_up() -> float:
    """Pay JAX's one-time costs at start-up rather than on the first request.

    Prepares and runs a tiny HVP (forward-over-reverse: the deepest path) of a
    module function, which initialises the backend, tracing, lowering and XLA's
    compiler, or, when the executable cache has it, the executable loader. Once per
    process; returns the seconds it took (0.0 after the first call).
    """
    global _warmed
    if _warmed:
        return 0.0
    _warmed = True
    start = time.perf_counter()
    x, t = np.linspace(0.5, 1.0, 4), (np.ones(4),)
    try:
        prep = prepare("hvp", _warm_up_function, "auto", x, t, ())
        jax.block_until_ready(prep.run("hvp", x, t, ()))
    except Exception as exc:  # a warm-up must never stop the server
        log.warning("warm-up failed: %s", exc)
    return time.perf_counter() - start
