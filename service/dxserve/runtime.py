"""The server process's one-time choices, made once when a server starts.

Nothing else in dxserve changes process-wide state: importing the library, or
building a ``Service`` or an app, leaves thread priorities, the GIL switch interval
and JAX's configuration as they were. ``bootstrap`` is what ``dxserve serve`` (and
any other front door: a worker process, a Ray replica) calls first:

* XLA's thread pools start below the event loop's priority, so a long computation
  does not delay ``/health`` (``threads``);
* a shorter GIL switch interval, so the event loop gets the GIL back quickly while a
  worker thread runs Python;
* JAX's persistent compilation cache and dxserve's executable cache, so a restarted
  server loads compiled operators instead of compiling them;
* a warm-up that pays JAX's one-time costs before the first request.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import jax
import numpy as np

from . import executable_cache, threads
from .preparation import prepare
from .settings import Settings

log = logging.getLogger("dxserve.runtime")

_warmed = False


def bootstrap(settings: Settings) -> None:
    """Make this process a dxserve server process (call before building the app)."""
    # First, before anything starts a JAX backend: XLA's thread pools inherit this.
    threads.start_backend_at_low_priority(settings.compute_nice)
    sys.setswitchinterval(settings.switch_interval)
    enable_compilation_cache(settings.compilation_cache)
    executable_cache.configure(
        Path(settings.compilation_cache) / "executables" if settings.compilation_cache else None,
        settings.executable_cache_mb << 20,
    )
    if settings.warm_up:
        warm_up()


def enable_compilation_cache(directory: str) -> None:
    """JAX's persistent compilation cache in ``directory`` ("" leaves it off)."""
    if not directory:
        return
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


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
