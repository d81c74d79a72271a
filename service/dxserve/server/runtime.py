"""The server process's one-time choices, made once when a server starts.

Nothing else in dxserve changes process-wide state: importing the library, or
building a ``Service`` or an app, leaves thread priorities, the GIL switch interval
and the frameworks' configuration as they were. ``bootstrap`` is what ``dxserve
serve`` (and any other front door: a worker process, a Ray replica) calls first:
JAX's choices (``frameworks/jax/runtime.py``: XLA's threads below the event loop,
the compilation caches, a warm-up), a shorter GIL switch interval, so the event loop
gets the GIL back quickly while a worker thread runs Python, and torch's settings.
"""

from __future__ import annotations

import os
import sys

from dxserve.settings import Settings


def bootstrap(settings: Settings) -> None:
    """Make this process a dxserve server process (call before building the app)."""
    from dxserve.frameworks.jax import runtime as jax_runtime  # JAX, when a server starts

    jax_runtime.configure(settings)  # first: before anything starts a JAX backend
    sys.setswitchinterval(settings.switch_interval)
    # read by frameworks/torch/framework.py, which loads with torch
    os.environ["DXSERVE_TORCH_COMPILE"] = settings.torch_compile
    os.environ["DXSERVE_TORCH_COMPILE_AFTER"] = repr(settings.torch_compile_after)
    if settings.warm_up:
        jax_runtime.warm_up()
