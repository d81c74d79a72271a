"""Float64 where the user sends float64, without touching JAX's global setting.

JAX computes in float32 unless 64-bit mode is on. dxserve turns it on only around
its own tracing, compiling and running (``jax.enable_x64`` is a thread-local
context), so float64 inputs are differentiated in float64, float32 inputs stay
float32, and importing dxserve leaves the user's JAX configuration as it was.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import jax


def float64_scope() -> AbstractContextManager:
    """A context in which JAX keeps float64 arrays float64 (this thread only)."""
    return jax.enable_x64(True)
