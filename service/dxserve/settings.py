"""Configuration: ``DXSERVE_*`` environment variables (pydantic-settings), CLI on top.

``HOST`` and ``PORT`` are honoured too (containers and PaaS set them); the
``DXSERVE_`` spelling wins when both are set.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DXSERVE_", extra="ignore")

    host: str = Field(default_factory=lambda: os.environ.get("HOST", "127.0.0.1"))
    port: int = Field(default_factory=lambda: int(os.environ.get("PORT", "8000")))
    #: Python modules whose ``@dxserve.function``s are registered at start.
    functions: Annotated[list[str], NoDecode] = ["dxserve.examples"]
    #: Directory of the persistent function registry.
    store: Path = Path("dxserve-store")
    #: JAX persistent compilation cache ("" disables it).
    compilation_cache: str = "dxserve-store/jax-cache"
    #: MiB of compiled operator executables kept in ``<compilation_cache>/executables``
    #: so a restart skips tracing and compiling (0 disables; see ``executable_cache``).
    executable_cache_mb: int = 1024
    #: Initialise JAX (backend, tracer, compiler) at start-up, not on the first request.
    warm_up: bool = True
    #: Bearer token required for registry writes (and compute, if below is set).
    token: str | None = None
    tokens_file: Path | None = None
    require_token_for_compute: bool = False
    max_body_bytes: int = 256 * 1024 * 1024
    max_upload_bytes: int = 32 * 1024 * 1024
    max_functions: int = 1000
    #: Most numbers one operator call may return (Jacobians and Hessians grow as n²;
    #: a sparse backend's count its nonzeros).
    max_result_elements: int = 2**27
    #: Seconds sparsity detection and colouring (``Sparse`` backends, at preparation) may
    #: take before the request is refused with 422 ``sparsity-detection``.
    sparse_detection_seconds: float = Field(default=60.0, gt=0)
    max_prepared: int = 1024
    cache_size: int = 512
    #: Requests waiting per device worker before 503 + Retry-After.
    queue_size: int = 256
    #: Seconds a computation may take before 504.
    request_timeout: float = 300.0
    #: Warm jobs whose last run took less than this (seconds) run on the event loop
    #: instead of a device worker thread; 0 sends everything to the workers.
    inline_below: float = 0.001
    #: Most requests merged into one vmapped call (a power of two; 1 turns batching off).
    max_batch: int = 32
    #: Seconds a queued request may wait for others of its kind before its batch runs
    #: (a request that arrives at an idle worker never waits).
    batch_wait: float = 0.0
    #: Nice steps below the event loop for the threads that compute (device workers and
    #: XLA's thread pools; Linux), so requests like /health are answered while a long
    #: computation runs; 0 leaves every thread at the process's priority.
    compute_nice: int = Field(default=10, ge=0, le=19)
    #: Python's GIL switch interval (seconds) in the server process. While a worker thread
    #: runs Python (tracing a new function, a numpy black box), each of the ~10 times the
    #: event loop takes the GIL for one request costs up to this long. Python's default is
    #: 0.005; 0.0002 keeps /health p99 near 3 ms even beside a pure-Python computation,
    #: but costs ~20% of peak throughput (32 concurrent small gradients).
    switch_interval: float = Field(default=0.001, gt=0, le=0.1)
    log_level: str = "info"

    @field_validator("functions", mode="before")
    @classmethod
    def _split_modules(cls, value: object) -> object:
        if isinstance(value, str):
            return [m.strip() for m in value.split(",") if m.strip()]
        return value

    @field_validator("max_batch")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value < 1 or value & (value - 1):
            raise ValueError("max_batch must be a power of two (1 turns batching off)")
        return value

    def tokens(self) -> frozenset[str]:
        """Every accepted bearer token (``token`` plus one per line of ``tokens_file``)."""
        found = {self.token} if self.token else set()
        if self.tokens_file is not None:
            lines = Path(self.tokens_file).read_text().splitlines()
            found.update(line.strip() for line in lines if line.strip() and not line.startswith("#"))
        return frozenset(found)
