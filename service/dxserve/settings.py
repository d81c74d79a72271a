"""Configuration: ``DXSERVE_*`` environment variables (pydantic-settings), CLI on top.

``HOST`` and ``PORT`` are honoured too (containers and PaaS set them); the
``DXSERVE_`` spelling wins when both are set.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DXSERVE_", extra="ignore")

    #: Bind address; ``HOST`` is read too (containers set it), ``DXSERVE_HOST`` wins.
    #: Beyond loopback, registry writes need a token (see ``allow_anonymous_registration``).
    host: str = Field(default_factory=lambda: os.environ.get("HOST", "127.0.0.1"))
    # validated like DXSERVE_PORT, so a bad PORT is a ValidationError naming the field
    #: Port; ``PORT`` is read too (containers and PaaS set it), ``DXSERVE_PORT`` wins.
    port: int = Field(default_factory=lambda: os.environ.get("PORT", "8000"), validate_default=True)
    #: Python modules whose ``@dxserve.function``s are served, comma-separated (the flag
    #: ``--functions`` may also repeat; the lists add up). The default serves the example
    #: functions; a list names everything served, so add ``dxserve.examples`` to keep them.
    functions: Annotated[list[str], NoDecode] = ["dxserve.examples"]
    #: The persistent function registry: a path (an SQLite database ``<path>/store.db``
    #: that the processes of one machine share), ``postgresql://...`` (processes on many
    #: machines) or ``dir:///path`` (the one-process directory format); see ``stores``.
    store: str = "dxserve-store"
    #: Seconds within which a deletion or replacement made by another process is seen:
    #: a request checks the store's change log first when its last check is older.
    store_sync_interval: float = Field(default=0.25, ge=0)
    #: Server processes sharing the port, the store and the compilation cache
    #: (``dxserve serve --workers N``); each has its own event loop and device workers.
    workers: int = Field(default=1, ge=1, le=256)
    #: Devices given to the worker processes in turn, one ``CUDA_VISIBLE_DEVICES`` value
    #: each, separated by ";" or "," (e.g. "0,1": worker 0 sees GPU 0, worker 1 GPU 1).
    worker_devices: Annotated[list[str], NoDecode] = []
    #: Most bytes of stored content (exports and expressions; content shared by several
    #: names counts once): 507 past it, 413 for one upload larger than all of it; 0: none.
    store_quota_bytes: int = Field(default=1 << 30, ge=0)
    #: Most stored functions kept built in memory (least recently used evicted; an
    #: evicted one is built again from the store on its next use).
    max_loaded_functions: int = Field(default=64, ge=1)
    #: Most content bytes of stored functions kept built in memory (0: only the count).
    max_loaded_bytes: int = Field(default=256 << 20, ge=0)
    #: JAX persistent compilation cache ("" disables it).
    compilation_cache: str = "dxserve-store/jax-cache"
    #: MiB of compiled operator executables kept in ``<compilation_cache>/executables``
    #: so a restart skips tracing and compiling (0 disables; see ``executable_cache``).
    executable_cache_mb: int = 1024
    #: MiB of JAX's own compilation cache entries in ``compilation_cache`` (not counting
    #: ``executables``): oldest pruned at start and every minute (0: no cap).
    compilation_cache_mb: int = Field(default=1024, ge=0)
    #: Initialise JAX (backend, tracer, compiler) at start-up, not on the first request.
    warm_up: bool = True
    #: ``torch.compile`` for the executables of functions written in torch: ``hot``
    #: serves each signature eagerly at once and compiles it on a background thread once
    #: it has run ``torch_compile_after`` seconds (when compiling pays for itself: seconds
    #: of compilation for calls many times faster); ``always`` compiles every signature
    #: before its first answer; ``off`` stays eager (bench/results/torch-cpu.md). Read
    #: when torch is first used.
    torch_compile: Literal["off", "hot", "always"] = "hot"
    #: Seconds a torch executable runs eagerly before ``hot`` compiles it.
    torch_compile_after: float = Field(default=2.0, ge=0)
    #: Bearer token required for registry writes (and compute, if below is set).
    token: str | None = None
    #: A file of accepted tokens, one per line (``#`` comments), besides ``token``.
    tokens_file: Path | None = None
    #: Require the token for operators and ``/prepare`` too, not only registry writes.
    require_token_for_compute: bool = False
    #: Also require the token to read what the server holds: ``GET /functions``,
    #: ``/functions/{name}``, ``/metrics``, ``/docs``, ``/redoc`` and ``/openapi.json``
    #: (``/health`` and ``/ready`` stay open for probes). Needs a token configured.
    private_metadata: bool = False
    #: With no token configured, registry writes (POST/DELETE /functions) are accepted
    #: only when the server listens on a loopback address; set this to accept them
    #: from anyone on any address (e.g. behind a proxy that authenticates).
    allow_anonymous_registration: bool = False
    #: Largest operator request body in the binary framing (413 above).
    max_body_bytes: int = 256 * 1024 * 1024
    #: Largest operator body in JSON: decoding JSON numbers holds ~16x the body's size
    #: (binary bodies decode without copying, so they get ``max_body_bytes``).
    max_json_body_bytes: int = 32 * 1024 * 1024
    #: Largest ``POST /functions`` body (413 above).
    max_upload_bytes: int = 32 * 1024 * 1024
    #: Most stored functions, counted in the store shared by every process (429 past it).
    max_functions: int = 1000
    #: Most numbers one operator call may return (Jacobians and Hessians grow as n²;
    #: a sparse backend's count its nonzeros).
    max_result_elements: int = 2**27
    #: Seconds sparsity detection and colouring (``Sparse`` backends, at preparation) may
    #: take, in their child process (wall clock and CPU time), before the request is
    #: refused with 422 ``sparsity-detection``.
    sparse_detection_seconds: float = Field(default=60.0, gt=0)
    #: Address space (bytes) the child process that detects and colours a pattern may
    #: add to its own (RLIMIT_AS); detection holds ~150-700 bytes per nonzero (and per
    #: element of each intermediate), so 2 GiB finds patterns of a few million nonzeros.
    sparse_detection_memory_bytes: int = Field(default=2 << 30, ge=64 << 20)
    #: Sparsity detections one caller (client address) may have waiting or running in
    #: the detection lane; 429 past it.
    sparse_detection_per_caller: int = Field(default=4, ge=1)
    #: Sparsity detections waiting in the detection lane, all callers; 503 past it.
    sparse_detection_queue: int = Field(default=64, ge=1)
    #: Most nonzeros of a sparsity pattern, given or detected (422 ``budget-exceeded``
    #: above; 0: no limit). A prep holds ~200 bytes per nonzero (index arrays on the host
    #: and the device, the compiled gather's constants), so one at 2^22 holds ~0.8 GB:
    #: a server with a few GB survives it, and a tridiagonal n = 10^6 (3e6) fits.
    max_nnz: int = Field(default=2**22, ge=0)
    #: Bytes of device memory one compiled operator may need by XLA's own estimate
    #: (arguments, outputs, temporaries, code; 422 ``budget-exceeded`` above; 0: no limit).
    max_request_memory_bytes: int = 4 * 1024**3
    #: Floating-point operations (with transcendentals) one operator may take by XLA's
    #: estimate (422 above; 0: no limit).
    max_request_flops: float = 1e11
    #: Conservative rates used to estimate run time at preparation: an operator estimated
    #: to take longer than ``request_timeout`` is refused, since a started one cannot stop.
    assumed_flops_per_second: float = Field(default=1e10, gt=0)
    #: Bytes accessed per second, in the same run-time estimate (lower it on a slow device).
    assumed_bytes_per_second: float = Field(default=1e10, gt=0)
    #: Bytes held at once by large request bodies being decoded (times the encoding's
    #: amplification) and by results until sent; 503 + Retry-After past it.
    max_inflight_bytes: int = 2 * 1024**3
    #: A result of at least this many bytes is "large": at most ``max_large_results`` of
    #: them are computed at once (503 + Retry-After for more).
    large_result_bytes: int = 64 * 1024**2
    #: Most "large" results (see ``large_result_bytes``) computed at once.
    max_large_results: int = Field(default=2, ge=1)
    #: Live ``/prepare`` handles kept (least recently used dropped: 404, prepare again).
    max_prepared: int = 1024
    #: Compiled operators kept in memory (least recently used dropped).
    cache_size: int = 512
    #: Bytes the cache of compiled operators (``cache_size`` at most) may keep alive:
    #: executables, sparsity patterns, colourings and index arrays, as estimated by
    #: ``footprint``; least recently used evicted past it, and one larger than all of it
    #: serves its own request without being kept (0: only the count).
    cache_bytes: int = Field(default=1 << 30, ge=0)
    #: The same bound for the handles of ``POST /prepare`` (``max_prepared`` at most); a
    #: prepared operator larger than all of it is refused (422 ``budget-exceeded``).
    max_prepared_bytes: int = Field(default=1 << 30, ge=0)
    #: Once large bodies and results (and preps evicted from the caches) have released
    #: this many bytes, freed heap memory is given back to the operating system (glibc's
    #: ``malloc_trim``, at most once a second, in a thread of its own; see ``memory``);
    #: 0: never.
    trim_after_bytes: int = Field(default=64 << 20, ge=0)
    #: Requests waiting per device worker before 503 + Retry-After.
    queue_size: int = 256
    #: Most tangents per request (see ``request_shapes``; 422 ``request-shape`` past it,
    #: checked before anything is traced: compile time grows faster than linearly).
    max_tangents: int = Field(default=4096, ge=1)
    #: Most pytree leaves in x, the contexts and one tangent together (a compiled
    #: program's arguments); 422 ``request-shape`` past it.
    max_leaves: int = Field(default=4096, ge=1)
    #: Deepest pytree nesting accepted in x, the contexts and the tangents.
    max_depth: int = Field(default=16, ge=1, le=32)
    #: Threads that trace and compile first calls (and ``POST /prepare``), apart from the
    #: device workers, so a long compile never holds a device (see ``compiling``).
    compile_threads: int = Field(default=2, ge=1, le=64)
    #: Compilations waiting for a compile thread before 503 + Retry-After.
    compile_queue: int = Field(default=64, ge=1)
    #: Compilations one caller (client address) may have waiting or running; 429 past
    #: it, so one client's flood of new shapes cannot fill the queue for everyone.
    compile_queue_per_caller: int = Field(default=16, ge=1)
    #: Seconds a computation may take before 504.
    request_timeout: float = 300.0
    #: Seconds a computation streamed with ``Accept: text/event-stream`` may take (its
    #: caller sees progress, and it stops at a chunk boundary when the time is up).
    stream_timeout: float = Field(default=3600.0, gt=0)
    # Detached jobs (``POST /jobs/{operator}``; see ``detached``):
    #: Jobs one token may have queued and running at once (429 ``too-many-jobs`` past it);
    #: without tokens configured, every bearer token is the one anonymous owner.
    max_jobs_per_token: int = Field(default=16, ge=1)
    #: Bytes of job inputs, checkpoints and results the store may hold or have reserved:
    #: a job reserves its expected result when it is submitted, and a submission past
    #: the limit is refused (507 ``insufficient-storage``) before it runs (0: no limit).
    job_store_bytes: int = Field(default=1 << 30, ge=0)
    #: Seconds an ended job (its record and result) is kept after it ended; then it is
    #: removed (404).
    job_result_ttl: float = Field(default=86400.0, gt=0)
    #: Seconds a job may run (its compute and memory budgets are its operator's).
    job_timeout: float = Field(default=86400.0, gt=0)
    #: Jobs one server process runs at once (more wait queued, in the store).
    job_runners: int = Field(default=1, ge=1, le=64)
    #: Seconds a process holds a running job without renewing its lease (renewed every
    #: third of it while the job runs): a job whose process died is taken over by
    #: another process once its lease has expired.
    job_lease_seconds: float = Field(default=30.0, gt=0)
    #: Seconds between a process's looks at the store for queued jobs (and for the
    #: progress of jobs that other processes run, on ``GET /jobs/{id}/events``).
    job_poll_interval: float = Field(default=0.5, gt=0)
    #: ``GET /jobs/{id}/events`` streams open at once on one job, in this process (429
    #: ``too-many-streams`` past it). All of a job's streams share one store read.
    max_streams_per_job: int = Field(default=512, ge=1)
    #: Job event streams one owner (token; all anonymous callers are one) may have open
    #: at once, in this process (429 ``too-many-streams`` past it).
    max_streams_per_owner: int = Field(default=1024, ge=1)
    #: Bytes of device memory one chunk of a chunked Jacobian or Hessian may need by
    #: XLA's estimate: larger ones run in chunks sized to fit (see ``chunking``); a
    #: single basis vector over it is refused (422). Default 512 MiB.
    chunk_memory_bytes: int = Field(default=512 * 1024**2, ge=1024**2)
    #: From this many basis vectors (or batch items) on, a chunkable operator runs in
    #: about 10 chunks even when it fits the budget, so it reports progress and can be
    #: cancelled (what that costs: bench/chunking.py); 0: chunk only past the budget.
    chunk_from: int = Field(default=1024, ge=0)
    #: Warm jobs whose last run took less than this (seconds) run on the event loop
    #: instead of a device worker thread; 0 sends everything to the workers.
    inline_below: float = 0.001
    #: Most requests merged into one vmapped call (a power of two; 1 turns batching off).
    max_batch: int = 32
    #: When merged requests may be answered from a batched call: "exact" (default) only
    #: when its rows are bit-identical to unbatched runs; "rounding" (opt-in, throughput
    #: over bitwise reproducibility) when they agree to rounding, 256 units of roundoff
    #: of each result's scale (``request_batching.agree_to_rounding``).
    batching: Literal["exact", "rounding"] = "exact"
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
    #: The HTTP protocol: "httptools" (uvicorn's, with the bounds below: see
    #: ``http/protocol.py``) or "h11" (uvicorn's h11 protocol: only uvicorn's own limits).
    http: Literal["httptools", "h11"] = "httptools"
    # Connections (see ``http/protocol.py``):
    #: Seconds a request's headers may take to arrive, from the connection opening or the
    #: request's first byte (408 and closed past it).
    header_timeout: float = Field(default=10.0, gt=0)
    #: Seconds a request's body may take once its headers are in (408 and closed past it).
    body_timeout: float = Field(default=120.0, gt=0)
    #: Most bytes of a request's head, request line and header lines (431 past it).
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    #: Most open connections (a new one past it gets 503 and is closed).
    max_connections: int = Field(default=4096, ge=1)
    #: Seconds a client may take nothing of an answer while more waits to be sent; then
    #: it is disconnected and the answer's memory freed.
    write_timeout: float = Field(default=60.0, gt=0)
    #: Seconds a SIGTERM gives the requests in flight to finish before their
    #: connections are closed and the process exits.
    shutdown_timeout: float = Field(default=10.0, gt=0)
    #: Seconds an idle keep-alive connection stays open.
    keep_alive_timeout: int = Field(default=5, ge=1)
    #: The listen backlog.
    backlog: int = Field(default=2048, ge=1)
    #: FastAPI's native OpenTelemetry (spans, metrics and logs through the global
    #: providers); off by default: ``/metrics`` serves Prometheus metrics of its own.
    opentelemetry: bool = False
    #: "debug", "info", "warning" or "error".
    log_level: str = "info"
    #: "text" (default) or "json": one JSON object per line, with a line per request
    #: (method, route, status, seconds, request id, function, operator), registration,
    #: compile and rejected request (see ``observe``).
    log_format: Literal["text", "json"] = "text"
    #: Check every uploaded export in a resource-limited child process (deserialize,
    #: build its MLIR modules, compile and run its operators once) before the server
    #: reads it in process; a crash there is a 422, not a dead server. Keep it on.
    export_gate: bool = True
    #: Address space (bytes) the export gate's child may add to its own (RLIMIT_AS).
    export_gate_memory_bytes: int = Field(default=4 << 30, ge=64 << 20)
    #: Wall-clock and CPU-time seconds one export check may take.
    export_gate_timeout: float = Field(default=60.0, gt=0)
    #: Uploads with loops whose trip count depends on data (``lax.while_loop``, a
    #: ``fori_loop`` with a traced bound): "refuse" (422 at upload) or "allow" (they run
    #: in process; one past its deadline is abandoned, see ``worker``).
    export_unbounded_loops: Literal["refuse", "allow"] = "refuse"
    #: Computations abandoned past their deadline (``worker``) that may still run, each
    #: holding a core; at it, calls of functions with unbounded loops get 503 until one
    #: ends (with ``export_unbounded_loops=allow``, the only way to make more).
    max_stuck_computations: int = Field(default=2, ge=1)

    @field_validator("torch_compile", mode="before")
    @classmethod
    def _torch_compile_switch(cls, value: object) -> object:
        """``1``/``true`` (the switch it once was) is ``always``, ``0``/``false`` ``off``."""
        text = str(value).strip().lower()
        return {"1": "always", "true": "always", "yes": "always",
                "0": "off", "false": "off", "no": "off"}.get(text, value)

    @field_validator("functions", mode="before")
    @classmethod
    def _split_modules(cls, value: object) -> object:
        if isinstance(value, str):
            return [m.strip() for m in value.split(",") if m.strip()]
        return value

    @field_validator("store", mode="before")
    @classmethod
    def _store_text(cls, value: object) -> object:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("worker_devices", mode="before")
    @classmethod
    def _split_devices(cls, value: object) -> object:
        if isinstance(value, str):
            sep = ";" if ";" in value else ","
            return [d.strip() for d in value.split(sep) if d.strip()]
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
