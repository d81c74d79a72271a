"""Sparsity detection and colouring in a bounded child process: the server's detector.

asdex's detection keeps Python sets per element (a 32 KB request can ask for
gigabytes) and its greedy colouring runs in numba holding the interpreter lock (for
minutes on a dense pattern); in the server process either would stop every other
request. ``ChildDetector`` runs both in a ``sandbox.Sandbox`` child instead: its own
memory limit (``DXSERVE_SPARSE_DETECTION_MEMORY_BYTES``), a wall-clock and CPU-time
limit (``DXSERVE_SPARSE_DETECTION_SECONDS``), one at a time. The server waits for it
in a worker thread without the lock.

The child cannot be handed the function (nothing a client sent is pickled): it gets
the function's ``origins.Origin`` (from the registry) and builds it again, plus the
shapes and dtypes of x and the contexts (detection depends on nothing else), or the
descriptor's pattern as raw int32 arrays when only colouring is needed. It answers
the pattern and colouring as raw int32 arrays (``sparse_detection.encode``), which the
server checks before asdex's ``ColoredPattern`` is rebuilt from them.

Detection has a lane of its own: it is never run on a compile thread. ``analyse``
(called while a compile thread prepares the operator) answers at once from the
analyses already made, or raises ``DetectionNeeded``; the service then queues the
detection in this detector's lane (one thread: the child runs one job at a time, a
queue of ``queue_size``, at most ``per_caller`` per caller, 429 past it, 503 past the
queue) and compiles again once it is made. A compile thread never waits for a child, so
a flood of detections cannot hold first calls of other shapes.

Every way the child can fail is a 422 naming ``backend``, with the fix: over a budget
(``BudgetExceededError``: ``max_nnz``, the colouring's time, its seed matrix), out of
time, out of memory, crashed, or asdex unable to analyse the function
(``SparsityDetectionError``); 503 only when no child can be started at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from dxcontract.errors import (
    BudgetExceededError,
    DxError,
    OverloadedError,
    SparsityDetectionError,
)
from dxcontract.keys import KeyArray, dtype_name, impl_of, is_key_dtype
from dxcontract.lru import LRU
from dxserve.core.holomorphic import undeclared
from dxserve.server.compiling import Compiler
from dxserve.server.origins import Origin, rebuild
from dxserve.server.sandboxes.sandbox import Limits, Outcome, Sandbox

if TYPE_CHECKING:  # detection itself is the JAX framework's (asdex), loaded when it runs
    from dxserve.frameworks.jax.sparse_detection import Analysis, DetectionBudget, PatternJob

__all__ = ["ChildDetector", "DetectionNeeded"]


class DetectionNeeded(BaseException):  # noqa: N818 - a signal to the service, not an error
    """Raised by ``ChildDetector.analyse`` on a compile thread: this analysis must be made
    in the detection lane first (``ChildDetector.detect``), then the compile run again.
    A ``BaseException``, so no backend's fallback mistakes it for a failure."""

    def __init__(self, key: str, header: dict[str, Any], payload: bytes, job: PatternJob) -> None:
        super().__init__(key)
        self.key, self.header, self.payload, self.job = key, header, payload, job

_FIX = "pass the pattern as Sparse(dense, sparsity=...), or use a dense backend"


class ChildDetector:
    """Detects and colours in a sandboxed child, within ``budget`` and ``memory_bytes``.

    ``origin_of(f)``: the registry's ``Origin`` of a registered callable (None: it cannot
    be rebuilt elsewhere, and detection is refused); ``content_of(origin)``: a stored
    function's content bytes (None once replaced).
    """

    #: analyses made in the lane and not yet taken by the compilation that asked for
    #: them (each is taken once); a pattern holds ~64 bytes per nonzero here
    MADE, MADE_BYTES = 64, 512 << 20

    def __init__(
        self, budget: DetectionBudget, memory_bytes: int,
        origin_of: Callable[[Callable], Origin | None],
        content_of: Callable[[Origin], bytes | None],
        per_caller: int = 4, queue_size: int = 64, nice: int = 0,
    ) -> None:
        self.budget = budget
        self.memory_bytes = memory_bytes
        self.origin_of, self.content_of = origin_of, content_of
        self.per_caller = per_caller
        #: the detection lane: one thread (the sandbox runs one child at a time)
        self.lane = Compiler(
            1, queue_size, nice, per_caller, "sparsity detections", "sparse_detection_per_caller"
        )
        self._made: LRU[str, Analysis] = LRU(self.MADE, self.MADE_BYTES, _analysis_bytes)
        self._big: tuple[str, Analysis] | None = None  # one larger than MADE_BYTES alone
        paths = [os.getcwd() if p == "" else p for p in sys.path if isinstance(p, str)]
        self.sandbox = Sandbox(
            f"{__name__}:child_job", prepare=f"{__name__}:warm_up",
            warm=f"{__name__}:warm_child", paths=paths, name="sparsity detector",
        )

    def close(self) -> None:
        self.lane.close()
        self.sandbox.stop()

    @property
    def pending(self) -> int:
        """Detections waiting or running in the lane."""
        return self.lane.pending

    async def detect(
        self, need: DetectionNeeded, caller: str | None, timeout: float, limit: float
    ) -> None:
        """Make ``need``'s analysis in the lane (shared with others waiting for the same);
        ``TooManyQueuedError`` when ``caller`` has ``per_caller`` waiting already,
        ``OverloadedError`` when the lane is full, ``DeadlineExceededError`` after
        ``timeout`` seconds (``limit``: the request's whole limit, for the message)."""
        await self.lane.run(need.key, lambda: self._make(need), timeout, limit, caller)

    def _make(self, need: DetectionNeeded) -> Analysis:
        """In the lane's thread: run the child, keep its analysis for the compilation."""
        from dxserve.frameworks.jax.sparse_detection import Analysis, decode

        started = time.perf_counter()
        outcome = self.sandbox.run(need.header, need.payload, self._limits(need.job))
        reply = _check(outcome, self)
        pattern, coloring = decode(reply, outcome.payload, need.job, self.budget)
        found = Analysis(pattern, coloring, time.perf_counter() - started)
        if not self._made.put(need.key, found):
            self._big = (need.key, found)
        return found

    def analyse(self, job: PatternJob, f: Callable, x: Any, contexts: tuple) -> Analysis:
        header: dict[str, Any] = {
            "kind": job.kind, "shape": list(job.shape), "coloring": job.coloring,
            "colour": job.colour, "budget": _budget_json(self.budget),
        }
        parts: list[bytes] = []
        if job.given is not None:
            self.budget.check_nnz(int(job.given[0].size), "given")
            if not job.colour:  # nothing to compute: no child
                from dxserve.frameworks.jax.sparse_detection import Analysis

                return Analysis(_pattern(job), None, 0.0)
            header["given"] = int(job.given[0].size)
            parts += [np.ascontiguousarray(a, dtype="<i4").tobytes() for a in job.given]
        else:
            # declared holomorphic or not, it is the same function (and pattern)
            origin = self.origin_of(undeclared(f))
            if origin is None:
                raise SparsityDetectionError(
                    "this function cannot be rebuilt in the bounded process that detects "
                    f"patterns (it is not a registered, importable function); {_FIX}",
                    field="backend",
                )
            content = b""
            if origin.kind != "module":
                found = self.content_of(origin)
                if found is None:
                    raise SparsityDetectionError(
                        f"the function {origin.name!r} was replaced or deleted while its "
                        "pattern was being detected; retry",
                        field="backend",
                    )
                content = found
            header.update(function=origin.to_json(), x=_spec(x), contexts=_spec(list(contexts)),
                          content=len(content))
            parts.append(content)
        payload = b"".join(parts)
        digest = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
        digest.update(payload)
        key = digest.hexdigest()
        found = self._made.pop(key)
        big = self._big
        if found is None and big is not None and big[0] == key:
            found, self._big = big[1], None
        if found is None:  # made in the lane, never here (see the module)
            raise DetectionNeeded(key, header, payload, job)
        return found

    def _limits(self, job: PatternJob) -> Limits:
        nnz = self.budget.max_nnz
        m, n = job.shape
        # rows, cols, colours, and a star set (two edge-long and three nnz-long arrays)
        reply = (1 << 40) if nnz is None else 4 * (7 * nnz + m + n) + (1 << 16)
        seconds = self.budget.seconds if self.budget.seconds is not None else 3600.0
        return Limits(self.memory_bytes, seconds, reply)


def _analysis_bytes(found: Analysis) -> int:
    return 64 * int(found.pattern.nnz) + 4096


def _budget_json(budget: DetectionBudget) -> dict[str, Any]:
    return {"max_nnz": budget.max_nnz, "seconds": budget.seconds,
            "max_seed_bytes": budget.max_seed_bytes}


def _pattern(job: PatternJob) -> Any:
    from dxserve.frameworks.jax.sparse_detection import asdex

    assert job.given is not None
    return asdex().SparsityPattern.from_coo(job.given[0], job.given[1], job.shape)


def _check(outcome: Outcome, detector: ChildDetector) -> dict[str, Any]:
    """The child's reply when it answered; else the 4xx/5xx its ending means."""
    seconds = detector.budget.seconds
    memory = detector.memory_bytes
    if outcome.status == "ok":
        reply = outcome.reply
        refused = reply.get("refused")
        if isinstance(refused, dict):  # a typed refusal, rebuilt here
            raise _refusal(refused)
        return reply
    crashed = outcome.status == "crashed"
    if outcome.status == "timeout" or (crashed and (
        outcome.signal == signal.SIGXCPU  # its CPU-time limit
        or (outcome.signal == signal.SIGKILL and seconds is not None
            and outcome.seconds >= 0.9 * seconds)  # the hard CPU limit after SIGXCPU
    )):
        raise SparsityDetectionError(
            f"sparsity detection and colouring took longer than {seconds:g} s and were "
            f"stopped; {_FIX}, or raise DXSERVE_SPARSE_DETECTION_SECONDS",
            field="backend",
        )
    if outcome.status in ("memory", "too_large"):
        why = ("ran out of its memory limit" if outcome.status == "memory"
               else "answered more than DXSERVE_MAX_NNZ allows")
        raise SparsityDetectionError(
            f"sparsity detection {why} ({memory >> 20} MiB, "
            f"DXSERVE_SPARSE_DETECTION_MEMORY_BYTES): the pattern is too large to find; "
            f"{_FIX}, or raise DXSERVE_SPARSE_DETECTION_MEMORY_BYTES",
            field="backend",
        )
    if crashed:
        raise SparsityDetectionError(
            f"the process detecting the pattern crashed ({_signame(outcome.signal)}; native "
            f"code failing, often for want of memory: its limit is {memory >> 20} MiB, "
            f"DXSERVE_SPARSE_DETECTION_MEMORY_BYTES); {_FIX}",
            field="backend",
        )
    if outcome.status == "unavailable":
        raise OverloadedError(
            f"the sparsity detector could not run ({outcome.detail}); retry later",
            field="backend", retry_after=5,
        )
    raise SparsityDetectionError(
        f"sparsity detection failed ({outcome.status}: {outcome.detail[-300:]}); {_FIX}",
        field="backend",
    )


_REFUSALS: dict[str, type[DxError]] = {
    "budget-exceeded": BudgetExceededError,
    "sparsity-detection": SparsityDetectionError,
}


def _refusal(refused: dict[str, Any]) -> DxError:
    cls = _REFUSALS.get(str(refused.get("type")), SparsityDetectionError)
    given = refused.get("extra") if isinstance(refused.get("extra"), dict) else {}
    extra = {k: given[k] for k in ("limit", "estimate")
             if isinstance(given.get(k), str | int | float) and not isinstance(given[k], bool)}
    return cls(str(refused.get("detail", "refused"))[:1000], field="backend", **extra)


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


# --- shapes of the inputs (all detection looks at) --------------------------------------
def _spec(tree: Any) -> Any:
    """A JSON description of a pytree's structure, shapes and dtypes (no values)."""
    if tree is None:
        return {"none": True}
    if isinstance(tree, dict):
        return {"dict": {str(k): _spec(v) for k, v in tree.items()}}
    if isinstance(tree, tuple):
        return {"tuple": [_spec(v) for v in tree]}
    if isinstance(tree, list):
        return {"list": [_spec(v) for v in tree]}
    shape, dtype = getattr(tree, "shape", None), getattr(tree, "dtype", None)
    if shape is None or dtype is None:
        a = np.asarray(tree)
        shape, dtype = a.shape, a.dtype
    if is_key_dtype(dtype_name(dtype)):  # a typed PRNG key: its wire dtype
        return {"shape": [int(d) for d in shape], "dtype": dtype_name(dtype)}
    return {"shape": [int(d) for d in shape], "dtype": str(np.dtype(dtype))}


def _zeros(spec: Any) -> Any:
    """Zeros of a ``_spec`` (in the child)."""
    if "none" in spec:
        return None
    if "dict" in spec:
        return {k: _zeros(v) for k, v in spec["dict"].items()}
    if "tuple" in spec:
        return tuple(_zeros(v) for v in spec["tuple"])
    if "list" in spec:
        return [_zeros(v) for v in spec["list"]]
    shape = tuple(int(d) for d in spec["shape"])
    if is_key_dtype(spec["dtype"]):  # keys of zero words: patterns do not depend on values
        from dxserve.frameworks.jax.keys import to_jax

        impl = impl_of(spec["dtype"], None)
        return to_jax(KeyArray(impl.name, np.zeros((*shape, *impl.words), np.uint32)))
    return np.zeros(shape, dtype=np.dtype(spec["dtype"]))


# --- in the child -------------------------------------------------------------------------
def child_job(header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
    """One detection job (``sandbox`` runs it in a bounded child)."""
    from dxserve.frameworks.jax.precision import float64_scope
    from dxserve.frameworks.jax.sparse_detection import (
        DetectionBudget,
        PatternJob,
        analyse_here,
        encode,
    )

    budget = DetectionBudget(**header["budget"])
    shape = (int(header["shape"][0]), int(header["shape"][1]))
    given = None
    f = x = None
    contexts: tuple = ()
    if "given" in header:
        nnz = int(header["given"])
        given = (np.frombuffer(payload, "<i4", nnz, 0).astype(np.int64),
                 np.frombuffer(payload, "<i4", nnz, 4 * nnz).astype(np.int64))
    job = PatternJob(header["kind"], shape, header["coloring"], bool(header["colour"]), given)
    try:
        with float64_scope():  # as the server traces: float64 stays float64
            if given is None:
                try:
                    f = rebuild(Origin.from_json(header["function"]), payload)
                except MemoryError:
                    raise
                except Exception as e:  # noqa: BLE001 - refused, not crashed
                    raise SparsityDetectionError(
                        f"the function could not be built in the detection process "
                        f"({type(e).__name__}: {str(e)[:200]}); {_FIX}",
                        field="backend",
                    ) from None
                x = _zeros(header["x"])
                contexts = tuple(_zeros(header["contexts"]))
            pattern, colouring = analyse_here(job, f, x, contexts, budget)
    except DxError as e:
        return {"refused": {"type": e.slug, "detail": e.detail, "extra": e.extra}}, b""
    except MemoryError:
        raise  # the sandbox reports it
    except Exception as e:  # noqa: BLE001 - the function failed to trace, say
        return {"refused": {"type": "sparsity-detection",
                            "detail": f"detection failed: {type(e).__name__}: {str(e)[:300]}; "
                                      f"{_FIX}"}}, b""
    return encode(pattern, colouring)


def warm_up() -> None:
    """In the fork server, once: compile (or load) asdex's numba colourings on a tiny
    pattern, so children inherit them. Plain arrays, not a ``SparsityPattern``: JAX's
    backend must not start in a process that forks."""
    from types import SimpleNamespace

    from dxserve.frameworks.jax.sparse_detection import asdex

    ax = asdex()
    tiny = SimpleNamespace(
        rows=np.array([0, 0, 1, 1, 2], np.int32), cols=np.array([0, 1, 0, 1, 2], np.int32),
        shape=(3, 3), m=3, n=3, nnz=5,
    )
    ax.color_cols(tiny)
    ax.color_rows(tiny)
    ax.color_symmetric(tiny)


def warm_child() -> None:
    """In each child while it waits for its job: start JAX's backend and detect, colour
    and encode a tiny pattern once, so the job finds JAX's caches filled."""
    from dxserve.frameworks.jax.sparse_detection import warm_up_jax

    warm_up_jax()
