"""``Service``: everything a dxserve server does, with no transport in it.

It owns the function registry, preparations and their handles, scheduling (device
workers and request batching), limits and authorization decisions. Its methods
take and return plain Python values (numpy arrays and pytrees, dicts, typed
``DxError``s); the HTTP app decodes, calls one method and encodes, and any other
front door (a Ray Serve replica, a test) drives the same object.

    service = Service(Settings(store="my-store"))
    g = await service.gradient("rosenbrock", "jax-reverse", np.array([1.0, 2.0, 3.0]))
    out = await service.call("value_and_gradient", "rosenbrock", "auto", x)  # by name
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import secrets
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from dxcontract.backends import Backend, backend_from_json
from dxcontract.errors import (
    BudgetExceededError,
    ForbiddenError,
    FunctionEvaluationError,
    OverloadedError,
    ShapeMismatchError,
    UnauthorizedError,
    UnknownPreparationError,
)
from dxcontract.lru import LRU
from dxcontract.operators import OPERATORS, OperatorSpec, result_names, returned
from dxserve.core.backends import backend_table
from dxserve.core.holomorphic import maybe as declare
from dxserve.core.limits import ComputeLimits
from dxserve.core.preparation import (
    Lookup,
    Prep,
    PrepCache,
    lookup,
    made_for,
    normalize,
    out_of_memory,
    prepare,
    with_cotangent,
)
from dxserve.core.progress import Job, JobCancelled
from dxserve.core.request_batching import Batcher
from dxserve.core.wrt import refuse_cotangent, select
from dxserve.frameworks import clear_caches, get_framework
from dxserve.server import observe
from dxserve.server.admission import Budget, Ticket
from dxserve.server.compiling import Compiler
from dxserve.server.describe import declared_shapes_problem, example_shapes_hint
from dxserve.server.memory import Trimmer
from dxserve.server.registry import Registry
from dxserve.server.request_shapes import ShapeLimits
from dxserve.server.sandboxes.export_gate import ExportGate, GateConfig
from dxserve.server.sandboxes.sparsity import ChildDetector, DetectionNeeded
from dxserve.server.stores import open_store
from dxserve.server.worker import DeviceWorker, Workers
from dxserve.settings import Settings

if TYPE_CHECKING:
    from dxserve.frameworks.jax.signature import Signature

Action = Literal["compute", "write", "read"]


_log = logging.getLogger("dxserve.service")
#: The module of the example functions (``dxserve serve``'s default ``--functions``).
EXAMPLES = "dxserve.examples"
#: Stored functions named one by one in the start-up log; the rest are counted.
_LISTED = 20
#: Patterns one compilation may ask the detection lane for (one: more rounds only when
#: an analysis was dropped before its compilation took it); past it, 503.
_DETECTIONS_PER_COMPILE = 4

class PrepHandles:
    """Handles returned by ``Service.prepare``: an LRU of at most ``maxsize`` preps and,
    with ``max_bytes``, at most that many bytes of them (``Prep.nbytes``: a handle keeps
    its prep's executables and arrays alive). ``on_evict(nbytes)``: as ``PrepCache``'s."""

    def __init__(
        self, maxsize: int, max_bytes: int | None = None,
        on_evict: Callable[[int], None] | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self._items: LRU[str, Prep] = LRU(
            maxsize, max_bytes, Prep.nbytes,
            None if on_evict is None else lambda _key, _prep, size: on_evict(size),
        )

    @property
    def nbytes(self) -> int:
        return self._items.nbytes

    def add(self, prep: Prep) -> str:
        """A new handle of ``prep``; ``BudgetExceededError`` if it alone is over ``max_bytes``."""
        handle = secrets.token_urlsafe(12)
        prep.on_grow = self._grew
        if not self._items.put(handle, prep):
            size = prep.nbytes()
            raise BudgetExceededError(
                f"this prepared operator would keep an estimated {size:,} bytes alive "
                f"(compiled executables, sparsity pattern), over the {self.max_bytes:,} bytes "
                "kept for all prepared operators (DXSERVE_MAX_PREPARED_BYTES); call the "
                "operator without a prep, or raise the limit",
                field="x", limit="max_prepared_bytes", estimate=size,
            )
        return handle

    def get(self, handle: str) -> Prep:
        prep = self._items.peek(handle)
        if prep is None:
            raise UnknownPreparationError(
                f"no prepared operator {handle!r} (expired or never made); POST /prepare again",
                field="prep",
            )
        return prep

    def forget(self, function: Callable) -> None:
        self._items.discard_where(lambda _, prep: made_for(prep.function, function))

    def _grew(self, prep: Prep) -> None:
        self._items.remeasure(lambda _, held: held is prep)


class Service:
    """The registry, preparations, workers and limits of one server process.

    Built from ``Settings``; nothing process-wide changes here (``runtime.bootstrap``
    makes those choices). ``close()`` stops the workers and releases the store.
    """

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings = settings or Settings()
        #: uploads are checked with this server's limits, in its own fork server
        self.export_gate = ExportGate(GateConfig.from_settings(settings))
        self.store = open_store(settings.store, quota_bytes=settings.store_quota_bytes)
        self.registry = Registry(
            self.store, settings.max_functions, max_loaded=settings.max_loaded_functions,
            max_loaded_bytes=settings.max_loaded_bytes, sync_interval=settings.store_sync_interval,
            resources={"export_gate": self.export_gate},
            suggest=not settings.private_metadata,
        )
        with get_framework().precision_scope():  # stored exports: float64 signatures
            #: module -> the names of the functions it registered (``--functions``)
            self.modules = self._add_modules(settings.functions)
            stored = self.registry.load_store()
        self._log_functions(stored)
        #: gives freed heap memory back after large requests and evictions; after preps
        #: were evicted it clears JAX's caches first, where the shapes of their traces and
        #: eager operations stay otherwise (see ``memory``)
        self.trimmer = Trimmer(settings.trim_after_bytes, clear=clear_caches)

        def evicted(nbytes: int) -> None:
            self.trimmer.released(nbytes, evicted=True)

        self.cache = PrepCache(settings.cache_size, settings.cache_bytes or None, evicted)
        self.handles = PrepHandles(
            settings.max_prepared, settings.max_prepared_bytes or None, evicted
        )
        self.registry.on_remove.append(lambda entry: self.cache.forget(entry.fn))
        self.registry.on_remove.append(lambda entry: self.handles.forget(entry.fn))
        # An evicted stored function stays registered; its preps and handles go with it
        # (a handle of it answers 404 and is made again), so its memory is freed.
        self.registry.on_evict.append(lambda entry: self.cache.forget(entry.fn))
        self.registry.on_evict.append(lambda entry: self.handles.forget(entry.fn))
        # JAX's own trace and lowering caches hold a function's constants by strong
        # reference, so only clearing them frees a dropped export's memory (about its
        # size per rebuild otherwise). Preps hold compiled executables, unaffected.
        self.registry.on_evict.append(lambda entry: clear_caches())
        self.registry.on_remove.append(lambda entry: clear_caches())
        self.batcher = Batcher(settings.batching)
        self.workers = Workers(
            settings.queue_size, settings.request_timeout, settings.inline_below,
            settings.max_batch, settings.batch_wait, settings.compute_nice,
        )
        #: compile threads: first calls and /prepare compile there, off the device workers
        self.compiler = Compiler(
            settings.compile_threads, settings.compile_queue, settings.compute_nice,
            settings.compile_queue_per_caller,
        )
        #: most tangents, pytree leaves and depth per request (422 past them)
        self.shapes = ShapeLimits(settings.max_tangents, settings.max_leaves, settings.max_depth)
        self._tokens = settings.tokens()
        #: sparsity detection and colouring, in a bounded child process (sparse_sandbox)
        from dxserve.frameworks.jax.sparse_detection import DetectionBudget

        self.detector = ChildDetector(
            DetectionBudget(
                settings.max_nnz or None, settings.sparse_detection_seconds,
                settings.max_request_memory_bytes or None,
            ),
            settings.sparse_detection_memory_bytes, self.registry.origin, self.registry.content,
            settings.sparse_detection_per_caller, settings.sparse_detection_queue,
            settings.compute_nice,
        )
        #: per-request bounds on XLA's estimate of each compiled operator (see budget.py)
        self.limits = ComputeLimits(
            settings.max_request_memory_bytes or None, settings.max_request_flops or None,
            settings.request_timeout, settings.assumed_flops_per_second,
            settings.assumed_bytes_per_second, chunk_memory_bytes=settings.chunk_memory_bytes,
            chunk_from=settings.chunk_from, sparsity=self.detector,
        )
        #: operator -> computations stopped early (client gone or past the deadline)
        self.cancelled: dict[str, int] = {}
        self._cancel_lock = threading.Lock()
        #: bytes in flight and large results being computed, across all requests
        self.budget = Budget(
            settings.max_inflight_bytes, settings.large_result_bytes, settings.max_large_results
        )
        self.budget.on_give = self.trimmer.released

    # --- start-up -------------------------------------------------------------------
    def _add_modules(self, modules: Sequence[str]) -> dict[str, list[str]]:
        """Register each module's ``@dxserve.function``s; warn about a module that has
        none, and about a name that a later module takes from an earlier one."""
        added: dict[str, list[str]] = {}
        owner: dict[str, str] = {}
        for module in modules:
            names = self.registry.add_module(module)
            if not names:
                _log.warning(
                    "functions: module %s registers no functions: mark them with "
                    "@dxserve.function (import dxserve)", module,
                    extra={"event": "functions", "python_module": module, "functions": 0},
                )
            for name in names:
                if name in owner and owner[name] != module:
                    _log.warning("functions: %s of %s replaces the one of %s", name, module,
                                 owner[name])
                    added[owner[name]].remove(name)
                owner[name] = module
            added[module] = names
        return added

    def _log_functions(self, stored: int) -> None:
        """What this server serves, at start: how many functions, from where, and each
        module function with its module (stored ones by name, up to ``_LISTED``)."""
        served = sum(len(names) for names in self.modules.values())
        sources = ", ".join(self.modules) or "none"
        _log.info(
            "functions: %d served: %d from --functions modules (%s), %d stored in %s",
            served + stored, served, sources, stored, self.settings.store,
            extra={"event": "functions", "served": served + stored, "modules": served,
                   "stored": stored},
        )
        for module, names in self.modules.items():
            for name in names:
                _log.info("function %s: module %s", name, module,
                          extra={"event": "function", "function": name, "kind": "module",
                                 "python_module": module})
        listed = 0
        for entry in self.registry.list():
            if entry.kind == "module":
                continue
            if listed == _LISTED:
                _log.info("... and %d more stored functions: GET /functions lists them",
                          stored - listed)
                break
            _log.info("function %s: %s, stored", entry.name, entry.kind,
                      extra={"event": "function", "function": entry.name, "kind": entry.kind})
            listed += 1
        if EXAMPLES not in self.modules and self.modules:
            _log.info("functions: the examples (%s) are not served: --functions names what "
                      "is served; add %s to serve them too", EXAMPLES, EXAMPLES)

    # --- authorization ------------------------------------------------------------
    def authorize(self, token: str | None, action: Action) -> None:
        """Raise ``UnauthorizedError`` unless ``token`` may do ``action``.

        Registry writes need a token whenever tokens are configured; computations
        only when ``require_token_for_compute`` is set, and reading the registry, the
        metrics and the API documents only with ``private_metadata``. With no token
        configured, registry writes are refused (``ForbiddenError``) on a server that
        listens beyond loopback, unless ``allow_anonymous_registration`` is set: secure
        by default; so is reading with ``private_metadata``. ``token`` is the bearer
        token the caller presented (None: none).
        """
        if action == "read" and not self.settings.private_metadata:
            return
        if not self._tokens:
            if action == "read":
                raise ForbiddenError(
                    "DXSERVE_PRIVATE_METADATA is set but no token is configured: set "
                    "DXSERVE_TOKEN (or DXSERVE_TOKENS_FILE) and send "
                    "'Authorization: Bearer <token>'",
                    field="Authorization",
                )
            if action == "write" and not self.anonymous_writes():
                raise ForbiddenError(
                    f"registration is closed: this server listens on {self.settings.host!r} "
                    "(beyond loopback) with no token configured; set DXSERVE_TOKEN (or "
                    "DXSERVE_TOKENS_FILE) and send 'Authorization: Bearer <token>', or set "
                    "DXSERVE_ALLOW_ANONYMOUS_REGISTRATION=true to let anyone register",
                    field="Authorization",
                )
            return
        if action == "compute" and not self.settings.require_token_for_compute:
            return
        if token is not None and any(
            hmac.compare_digest(token.encode(), t.encode()) for t in self._tokens
        ):
            return
        raise UnauthorizedError(
            "send 'Authorization: Bearer <token>' with a valid token" if token is not None
            else "this server needs 'Authorization: Bearer <token>' for this request",
            field="Authorization",
        )

    def accepts_token(self, token: str) -> bool:
        """Is ``token`` one of the configured tokens? False when none is configured."""
        return any(hmac.compare_digest(token.encode(), t.encode()) for t in self._tokens)

    @property
    def takes_tokens(self) -> bool:
        """Is a bearer token configured (``DXSERVE_TOKEN``, ``DXSERVE_TOKENS_FILE``)?"""
        return bool(self._tokens)

    def anonymous_writes(self) -> bool:
        """May callers without a token register and delete functions? Only with no token
        configured, on a loopback address or with ``allow_anonymous_registration``."""
        if self._tokens:
            return False
        return self.settings.allow_anonymous_registration or is_loopback(self.settings.host)

    def access_mode(self) -> str:
        """One line saying who may write the registry (the server logs it at start)."""
        host = self.settings.host
        if self._tokens:
            compute = " and computations" if self.settings.require_token_for_compute else ""
            return f"registry writes{compute} need a bearer token ({len(self._tokens)} configured)"
        if self.settings.allow_anonymous_registration:
            return (
                f"registry writes are open to anyone who can reach {host} "
                "(DXSERVE_ALLOW_ANONYMOUS_REGISTRATION=true)"
            )
        if is_loopback(host):
            return f"registry writes are open without a token (loopback only: {host})"
        return (
            f"registry writes are refused: {host} is not loopback and no token is set "
            "(set DXSERVE_TOKEN, or DXSERVE_ALLOW_ANONYMOUS_REGISTRATION=true)"
        )

    # --- operators --------------------------------------------------------------------
    async def call(
        self,
        operator: str,
        function: str,
        backend: Backend | str | dict,
        x: Any,
        tangents: Sequence | None = None,
        contexts: Sequence = (),
        prep: str | None = None,
        *,
        signature: Signature | None = None,
        hint: Hashable = None,
        batch_axis: int | None = None,
        has_aux: bool = False,
        wrt: Any = None,
        cotangent: Any = None,
        job: Job | None = None,
        timeout: float | None = None,
        ticket: Ticket | None = None,
        entry: Any = None,
        holomorphic: bool = False,
    ) -> dict[str, Any]:
        """Run ``operator`` on a registered function: ``{result name: numpy value}``.

        ``prep`` is a handle from ``prepare``. ``signature``: the inputs' signature if
        the caller knows it already. ``hint``: anything that tells similar calls apart
        (the HTTP layer passes the body size), so a call's expected cost is known
        from the last one like it (see ``worker.Workers.run``). ``batch_axis=0``: x and
        the tangents hold B points, each result stacked (B, ...); one job, one call.
        ``has_aux``: the function returns ``(output, aux)``; ``output`` is differentiated
        and ``{"aux": ...}``, its aux at x, is one more result. ``wrt``: the arguments
        differentiated (``dxserve.core.wrt``: 0 is x, k is ``contexts[k-1]``; several give
        tuples), ``batch_axis`` then applying to them. ``cotangent`` (the HVP family):
        the HVPs of ``<cotangent, f>`` for an array-valued f (``preparation.with_cotangent``).
        ``job``: told the progress of a chunked computation and checked between its
        chunks (``cancel()`` it to stop the work; ``JobCancelled`` is raised then).
        ``timeout``: seconds before 504 (default ``request_timeout``); the job is
        cancelled at its deadline, or when this coroutine is cancelled.
        ``ticket``: the request's share of the in-flight budget (``admission``); the
        result is reserved in it before the computation runs (503 when the budget is
        full) and stays held until the caller releases the ticket, once the answer is
        written. Without one, the call holds its own until it returns.
        ``entry``: the registry entry to run instead of ``function``'s current one (a
        detached job's function as it was when the job was submitted).
        ``holomorphic``: the caller declares the function holomorphic (Jacobians of
        complex x, as JAX's ``holomorphic=True``).
        """
        op = OPERATORS[operator]
        backend = backend_from_json(backend)  # once, here (a descriptor from the wire: as is)
        self.shapes.check(x, tangents, contexts)  # before anything is traced: 422 past a bound
        x, tangents, contexts = _inputs(x, tangents, contexts)  # keys from the wire
        info = observe.enter_call(function, op.name)  # the request's timing, if served over HTTP
        entry = entry or self.registry.loaded(function) or await self._load(function)
        names = entry.signature.get("args") if isinstance(entry.signature, dict) else None
        names = names if isinstance(names, list) else []
        if batch_axis is None:  # declared shapes are a contract: refused at the door
            problem = declared_shapes_problem(entry.facts, names, x, contexts, entry.signature)
            if problem is not None:
                raise ShapeMismatchError(problem[1], field=problem[0])
        ready_prep = self.handles.get(prep) if prep is not None else None
        sent_x, sent_contexts = x, contexts  # as the request named them (for messages)
        fn = entry.fn
        if wrt is not None:  # the arguments wrt names become x: their signature is new
            fn, x, contexts = select(fn, x, contexts, wrt)
            signature = None
        if cotangent is not None:
            refuse_cotangent(op.name, has_aux)
            fn, contexts = with_cotangent(fn, x, contexts, cotangent)
            signature = None
        try:
            found = lookup(
                op.name, declare(fn, holomorphic), backend, x, tangents, contexts, ready_prep,
                self.cache, signature, batch_axis, has_aux,
            )
            # A batch is one job whose cost is its whole batch's: keyed apart from single
            # points, so its expected cost never comes from (nor is taken for) theirs.
            key = (entry.name, op.name, hint, prep, batch_axis, found.has_aux, holomorphic, wrt,
                   cotangent is not None)
            own_ticket = ticket is None
            ticket = self.budget.ticket() if ticket is None else ticket
            try:
                results = await self._call(
                    op, found, key, ticket, info=info, job=job, timeout=timeout
                )
            except BaseException:  # a deadline, or the caller gone: stop at the next chunk
                if job is not None:
                    job.cancel()
                raise
            finally:
                ticket.computed()
                if own_ticket:
                    ticket.release()
        except FunctionEvaluationError as exc:
            named = None if batch_axis is not None else example_shapes_hint(
                entry.facts, names, sent_x, sent_contexts, entry.signature
            )
            if named is None:
                raise
            # the argument whose shape is new, in words, before JAX's own text
            raise FunctionEvaluationError(f"{named[1]}: {exc.detail}", field=named[0]) from exc
        if info is not None:
            info.call_end = time.perf_counter()
        return results

    async def _call(
        self, op: OperatorSpec, found: Lookup, key: Hashable, ticket: Ticket,
        info: observe.RequestInfo | None = None, job: Job | None = None,
        timeout: float | None = None,
    ) -> dict:
        """Run a looked-up call. ``ticket``: its result is reserved there once its prep
        is known, before it queues (503 when the budget is full). ``info``: the
        request's record, given the computation's own time (merged batches: not apart).

        One deadline (``timeout``, default ``request_timeout``) covers compiling, queueing
        and running. What is not compiled yet is compiled first on a compile thread
        (``compiling``), never on a device worker, which only runs executables."""
        loop = asyncio.get_running_loop()
        limit_s = self.settings.request_timeout if timeout is None else timeout
        deadline = loop.time() + limit_s
        workers, ready = self.workers, found.prep
        worker = workers.pick(None if ready is None else lambda d: ready.holds(op.name, d))
        if ready is None or not ready.warm(op.name, workers.device_of(worker)):
            ready = await self._compile(op, found, worker, limit_s)
        ticket.reserve_result(ready.result_bytes)
        left = deadline - loop.time()
        # a loop with no static bound may never end: only a worker thread can be abandoned
        inline = not getattr(found.function, "dx_unbounded_loops", 0)
        if not inline and workers.stuck >= self.settings.max_stuck_computations:
            raise OverloadedError(
                f"{workers.stuck} computations past their deadline still hold a core "
                "(DXSERVE_MAX_STUCK_COMPUTATIONS); functions whose loops have no static "
                "bound are refused until one ends",
                retry_after=60,
            )
        if (
            found.prep is not None and workers.batching
            and (job is None or not job.streams) and not ready.chunked(op.name)
        ):  # a chunked computation runs alone: its progress and cancellation are its own
            batched = ready

            names = batched.results(op.name)

            def run_group(items: Sequence[tuple]) -> list:
                # each item carries its request's record: the group's own run is the
                # compute of every request it answers, queueing and merging apart
                start = time.perf_counter()
                results = self.batcher.run_group(batched, op.name, [i for i, _ in items])
                seconds = time.perf_counter() - start
                for _, its_info in items:
                    if its_info is not None:
                        its_info.compute = seconds
                return [
                    r if isinstance(r, BaseException) else results_of(names, r) for r in results
                ]

            return await workers.run_grouped(
                (batched, op.name), (found.inputs, info), run_group, key, worker=worker,
                timeout=left, inline=inline,
            )
        chunked = ready.chunked(op.name)
        if chunked and job is None:  # its own, so short jobs run between its chunks
            job = Job()

        def compute() -> dict:
            start = time.perf_counter()
            try:
                if job is not None:
                    job.check()  # cancelled while it waited: the worker moves on
                results = results_of(ready.results(op.name), ready.run(op.name, *found.inputs, job))
            except JobCancelled:
                with self._cancel_lock:
                    self.cancelled[op.name] = self.cancelled.get(op.name, 0) + 1
                raise
            if info is not None:
                info.compute = time.perf_counter() - start
            return results

        return await workers.run(
            compute, key, left, worker=worker, progress=job if chunked else None, inline=inline
        )

    async def _compile(
        self, op: OperatorSpec, found: Lookup, worker: DeviceWorker, limit_s: float
    ) -> Prep:
        """The call's prep, with everything it runs compiled for ``worker``'s device, from
        a compile thread; identical calls in flight share one compilation. Waits at most
        ``limit_s`` seconds, the request's whole limit (504 past it, the device never
        held)."""
        limit, limits, pinned = self.settings.max_result_elements, self.limits, self.workers.pinned
        device = self.workers.device_of(worker)

        def compile_it() -> Prep:
            with get_framework().on_device(worker.device) if pinned else nullcontext():
                ready = found.prep or found.prepare(self.cache, limit, limits)
                ready.compile_for(found.operator, *found.inputs)
            return ready

        # a prep handle's own prep is compiled apart from the cache's, its twin
        owner = None if found.prep is None else id(found.prep)
        return await self._compiled((found.key, device, owner), compile_it, limit_s)

    async def _compiled(self, key: Hashable, compile_it: Callable[[], Prep], limit_s: float) -> Prep:
        """``compile_it()`` on a compile thread (``compiler.run``); a sparsity pattern it
        needs is detected in the detector's own lane first, never on the compile thread
        (see ``sparse_sandbox``). ``limit_s``: the whole wait, 504 past it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit_s
        info = observe.CURRENT.get()
        caller = info.caller if info is not None else None
        for _ in range(_DETECTIONS_PER_COMPILE):
            try:
                return await self.compiler.run(
                    key, compile_it, deadline - loop.time(), limit_s, caller
                )
            except DetectionNeeded as need:
                await self.detector.detect(need, caller, deadline - loop.time(), limit_s)
        raise OverloadedError("the sparsity pattern was detected but not kept; retry", retry_after=1)

    async def result_bytes(
        self,
        operator: str,
        function: str,
        backend: Backend | str | dict,
        x: Any,
        tangents: Sequence | None = None,
        contexts: Sequence = (),
        *,
        batch_axis: int | None = None,
        has_aux: bool = False,
    ) -> int:
        """The bytes ``call`` with these arguments would return (its prep's estimate:
        output shapes times dtypes), compiled as ``call`` compiles (a compile thread,
        the prep cache), nothing run; the errors ``call`` would raise before running."""
        op = OPERATORS[operator]
        backend = backend_from_json(backend)
        self.shapes.check(x, tangents, contexts)
        x, tangents, contexts = _inputs(x, tangents, contexts)
        entry = self.registry.loaded(function) or await self._load(function)
        found = lookup(
            op.name, entry.fn, backend, x, tangents, contexts, None, self.cache, None,
            batch_axis, has_aux,
        )
        worker = self.workers.pick()
        ready = found.prep
        if ready is None or not ready.warm(op.name, self.workers.device_of(worker)):
            ready = await self._compile(op, found, worker, self.settings.request_timeout)
        nbytes = int(ready.result_bytes)
        # a sparse result counts its stored numbers; each is sent with its row and column
        return nbytes * 3 if "sparsity" in ready.report else nbytes

    async def prepare(
        self,
        operator: str,
        function: str,
        backend: Backend | str | dict,
        x: Any,
        tangents: Sequence | None = None,
        contexts: Sequence = (),
        *,
        batch_axis: int | None = None,
        has_aux: bool = False,
        holomorphic: bool = False,
        wrt: Any = None,
        cotangent: Any = None,
    ) -> dict[str, Any]:
        """Compile ``operator`` once for this signature: ``{"prep": handle, "operator",
        "function", "backend", "resolved"}``; pass the handle as ``prep`` to ``call``.
        ``batch_axis=0`` prepares a batch of points, ``has_aux`` a function returning
        ``(output, aux)``, ``wrt`` the arguments differentiated (calls must say the same)."""
        op = OPERATORS[operator]
        info = observe.enter_call(function, f"prepare_{op.name}")
        entry = self.registry.loaded(function) or await self._load(function)
        self.shapes.check(x, tangents, contexts)
        x, tangents, contexts = _inputs(x, tangents, contexts)
        fn = entry.fn
        if wrt is not None:
            fn, x, contexts = select(fn, x, contexts, wrt)
        if cotangent is not None:
            refuse_cotangent(op.name, has_aux)
            fn, contexts = with_cotangent(fn, x, contexts, cotangent)
        limit, limits, timeout = (
            self.settings.max_result_elements, self.limits, self.settings.request_timeout
        )
        worker = self.workers.pick()

        def compile_it() -> Prep:
            with get_framework().on_device(worker.device) if self.workers.pinned else nullcontext():
                prep = prepare(
                    op.name, declare(fn, holomorphic), backend, x, tangents, contexts,
                    None, limit, limits, batch_axis, has_aux,
                )
                prep.compile_for(op.name, *normalize(x, tangents, contexts))
            return prep

        # each /prepare makes its own prep (and handle): nothing to share
        prep = await self._compiled(object(), compile_it, timeout)
        if info is not None:
            info.call_end = time.perf_counter()
        return {
            "prep": self.handles.add(prep),
            "operator": op.name,
            "function": entry.name,
            "backend": prep.backend.to_json(),
            "resolved": prep.resolved.to_json(),
            **prep.report,  # e.g. "sparsity": the pattern's shape, nnz, colours, mode
        }

    async def _load(self, function: Any) -> Any:
        """The registry's entry for ``function``, built off the event loop if it must be
        (a stored function's first use, or its first since it was evicted)."""

        def load() -> Any:
            with get_framework().precision_scope():  # as at registration: float64 signatures
                return self.registry.get(function)

        return await asyncio.to_thread(load)

    # --- functions ----------------------------------------------------------------------
    async def register(self, body: dict) -> tuple[dict[str, Any], bool]:
        """Register a function from a ``POST /functions`` body: ``(description, created)``."""

        def register_it() -> tuple[Any, bool]:
            with get_framework().precision_scope():
                return self.registry.register_body(body)

        entry, created = await asyncio.to_thread(register_it)
        described = entry.describe()
        _log.info(
            "registered %s (%s)%s", entry.name, described.get("kind"), "" if created else ", unchanged",
            extra={"event": "register", "function": entry.name, "kind": described.get("kind"),
                   "new": created},
        )
        return described, created

    async def delete(self, name: str) -> str:
        """Remove a registered (not server-side) function; returns its name."""
        entry = await asyncio.to_thread(self.registry.delete, name)
        return entry.name

    def function(self, name: Any, field: str = "name") -> dict[str, Any]:
        """One function's kind, signature and description."""
        return self.registry.lookup(name, field).describe()

    def functions(self) -> list[dict[str, Any]]:
        """Every registered function, by name."""
        return [entry.describe() for entry in self.registry.list()]

    # --- the service itself -----------------------------------------------------------
    def backends(self) -> list[dict[str, Any]]:
        """Every backend type, its parameters and the operators it serves."""
        return backend_table()

    def ready(self) -> dict[str, Any]:
        """What this server runs on, and how busy it is."""
        return {
            "status": "ready",
            **get_framework().runtime_info(),  # platform, devices, versions
            "functions": len(self.registry),
            "queued": self.workers.pending,
            "stuck": self.workers.stuck,
            "compiling": self.compiler.pending,
            "detecting": self.detector.pending,
        }

    def close(self) -> None:
        self.export_gate.shutdown()
        self.compiler.close()
        self.workers.close()
        self.detector.close()
        self.store.close()
        self.trimmer.close()


def is_loopback(host: str) -> bool:
    """Is ``host`` (a bind address) reachable from this machine only? ``localhost``,
    127.0.0.0/8 and ::1; any other name or address (``0.0.0.0``, ``::``) is not."""
    host = host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host(tree: Any) -> Any:
    """JAX results -> numpy (zero-copy on CPU); tuples stay tuples for batches.

    Called inside the device job, so the job ends when the results are ready and the
    encoder never waits on the device.
    """
    if isinstance(tree, tuple):
        if hasattr(tree, "_fields"):  # a NamedTuple node of a pytree result: its type kept
            return type(tree)(*(_host(t) for t in tree))
        return tuple(_host(t) for t in tree)
    if isinstance(tree, dict):
        return {k: _host(v) for k, v in tree.items()}
    if isinstance(tree, list):  # a list node of a pytree result
        return [_host(t) for t in tree]
    if tree is None:  # a None node of a pytree result
        return None
    from dxserve.frameworks.jax import keys
    from dxserve.frameworks.jax.sparse import BCOO, sparse_wire

    if isinstance(tree, BCOO):  # a sparse result: its wire object (dxcontract.sparse)
        return sparse_wire(tree)
    if keys.is_jax_key(tree):  # a typed PRNG key: its impl and words (dxcontract.keys)
        return keys.key_array(tree)
    return np.asarray(tree)


def _inputs(x: Any, tangents: Any, contexts: Any) -> tuple[Any, Any, Any]:
    """A request's inputs with the wire's ``KeyArray``s as JAX keys."""
    from dxserve.frameworks.jax import keys

    return keys.inputs_to_jax(x, tangents, contexts)


def results_of(names: tuple[str, ...], outputs: tuple) -> dict[str, Any]:
    """``{result name: numpy value}`` from ``Prep.run``'s outputs (``names``, the prep's
    ``results(operator)``, in order)."""
    try:
        return {name: _host(v) for name, v in zip(names, outputs, strict=True)}
    except Exception as exc:  # the copy to the host may be where the device runs out
        oom = out_of_memory(exc)
        if oom is None:
            raise
        raise oom from exc


def _operator_method(op: OperatorSpec) -> Callable:
    async def method(
        self: Service, function: str, backend: Backend | str | dict, x: Any, *args: Any,
        prep: str | None = None, batch_axis: int | None = None, has_aux: bool = False,
        holomorphic: bool = False, wrt: Any = None, cotangent: Any = None,
    ) -> Any:
        tangents, contexts = (args[0], args[1:]) if op.takes_tangents else (None, args)
        out = await self.call(
            op.name, function, backend, x, tangents, contexts, prep, batch_axis=batch_axis,
            has_aux=has_aux, holomorphic=holomorphic, wrt=wrt, cotangent=cotangent,
        )
        return returned(op, tuple(out[name] for name in result_names(op, has_aux)), has_aux)

    takes = ", tangents" if op.takes_tangents else ""
    method.__name__ = method.__qualname__ = op.name
    method.__doc__ = (
        f"``await service.{op.name}(function, backend, x{takes}, *contexts, prep=None, "
        "batch_axis=None, has_aux=False, wrt=None)``: "
        f"{', '.join(op.results)}, as the library's ``dxserve.{op.name}`` returns them."
    )
    return method


for _name, _op in OPERATORS.items():
    setattr(Service, _name, _operator_method(_op))
