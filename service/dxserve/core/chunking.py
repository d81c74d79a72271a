"""Chunked execution of dense Jacobians and Hessians: one compiled call per chunk.

A dense Jacobian is n pushforwards of input basis vectors (columns, forward-mode
engines) or m pullbacks of output basis vectors (rows, reverse mode); a Hessian is
the outer engine's Jacobian of the inner engine's gradient. The one-shot executable
vmaps all of them at once, so its temporaries grow with the whole basis: a
finite-difference Hessian of rosenbrock at n = 1000 would need ~64 GB.

A ``Chunker`` runs the same maths ``size`` basis vectors at a time: one executable
``chunk(x, contexts, start, previous)`` computes J's columns ``(m, size)`` or rows
``(size, n)`` for the basis block at a traced offset. Each block is copied once into
one host result that is never zeroed; the block buffer itself is donated back to the
next chunk (``previous``), so the device allocator hands out the same memory every
chunk instead of fresh pages. Every chunk runs the one compiled program; a remainder
is covered by a last chunk that overlaps its predecessor. Each basis vector's column or
row is computed by the same operations as in the one-shot program, so both paths agree
to rounding (bit for bit where XLA vectorizes the two batch widths alike;
tests/library/test_progress_chunks.py).

When a run is chunked:

* the one-shot executable needs more than the chunk memory budget by XLA's memory
  analysis (``DXSERVE_CHUNK_MEMORY_BYTES``): the chunk size is the budget over the
  one-shot's bytes per basis vector, checked (and shrunk) on the compiled chunk;
* there are ``CHUNK_FROM`` (1024; ``DXSERVE_CHUNK_FROM``) basis vectors or more: about
  ``CHUNKS`` (10) chunks, so progress moves and the work can be cancelled;
* the backend's ``batch_size``, when given, bounds the chunk size.

Otherwise the one-shot executable runs, as before. Whether a caller streams progress
does not change the plan, so streamed and plain answers are the same bits. Between
chunks the ``Job`` gets a progress report and is checked for cancellation. Only work
whose single basis vector does not fit the budget is refused (``BudgetExceededError``,
422). A detached job's ``Job`` has ``checkpoints``: each finished block is kept there,
and a run resumed after a crash takes the blocks kept under its own plan (the same
chunk size, so the same bits) instead of computing them again.

Everything framework-specific (basis vectors, compiling with a donated buffer, the
estimates, devices) goes through the prep's ``Framework``.

Only plain array inputs and outputs of traced functions are chunked by basis vectors
(pytree blocks, black boxes, sparse engines and complex numbers run one-shot). Batches are chunked by a
``Slicer``, by the same rules: a batch of points (``batch_axis=0``, any operator) by
points, and the tangents of ``pushforward``, ``pullback`` and ``hvp`` (and their
``value_and_``/``gradient_and_`` forms) by tangents.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dxcontract.errors import BudgetExceededError
from dxcontract.operators import OPERATORS
from dxserve.core.backends.engine import Engine
from dxserve.core.limits import ComputeLimits, Estimate
from dxserve.core.progress import Job
from dxserve.frameworks import Framework, astype, get_framework

#: Default bytes of device memory one chunk may need by XLA's estimate (512 MiB).
DEFAULT_CHUNK_MEMORY_BYTES = 512 * 1024**2
#: From this many basis vectors on, a Jacobian or Hessian runs in about ``CHUNKS``
#: chunks (so its progress moves 10% at a time and it can be cancelled); fewer run
#: one-shot unless they do not fit the budget. Not more: a chunk of a few hundred
#: basis vectors keeps matrix products as efficient as one call (bench/chunking.py).
CHUNK_FROM = 1024
CHUNKS = 10


def _is_array(tree: Any) -> bool:
    return not isinstance(tree, dict | list | tuple) and hasattr(tree, "shape")


def chunker_for(
    family: str, f: Callable, engine: Engine, inner: Engine | None, x: Any, y: Any,
    compiled: bool, batched: bool, limits: ComputeLimits | None,
    framework: Framework | None = None,
) -> Chunker | None:
    """A ``Chunker`` for this prep, or None where its operator always runs one-shot."""
    if OPERATORS[family].chunks != "basis" or not compiled or batched:
        return None
    if not (_is_array(x) and _is_array(y)) or type(engine).jacobian is not Engine.jacobian:
        return None  # pytree blocks, or an engine with its own Jacobian (sparse)
    n = math.prod(x.shape)
    second = OPERATORS[family].order == 2  # the Jacobian of the gradient
    m = n if second else math.prod(y.shape)
    if n < 2 or m < 1:
        return None
    forward = engine.mode == "forward"
    budget = getattr(limits, "chunk_memory_bytes", None) or DEFAULT_CHUNK_MEMORY_BYTES
    shape = (*x.shape, *x.shape) if second else (*y.shape, *x.shape)
    return Chunker(
        family, f, engine, inner, n, m, forward, shape, budget, limits, _chunk_from(limits),
        framework=framework or engine.ops,
    )


@dataclass(eq=False)
class Chunker:
    """Chunked runs of one prep's Jacobian or Hessian (see the module)."""

    family: str
    f: Callable
    engine: Engine  # the engine whose basis is chunked (the outer one for a Hessian)
    inner: Engine | None
    n: int  # x.size
    m: int  # f(x).size (x.size for a Hessian)
    forward: bool  # columns (pushforwards) or rows (pullbacks)
    shape: tuple  # the result's shape
    budget: int  # bytes one chunk may need
    limits: ComputeLimits | None = None
    chunk_from: int = CHUNK_FROM  # basis vectors from which to chunk anyway (0: never)
    #: operator -> the one-shot's estimate, for operators too large to run one-shot
    oversized: dict[str, Estimate] = field(default_factory=dict)
    _executables: dict[tuple, Any] = field(default_factory=dict, repr=False)
    _sizes: dict[tuple, int] = field(default_factory=dict, repr=False)
    framework: Framework = field(default=None, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.framework is None:
            self.framework = get_framework()

    @property
    def total(self) -> int:
        return self.n if self.forward else self.m

    def executables(self) -> list[Any]:
        """The chunk executables compiled so far (what a cache of preps counts)."""
        return list(self._executables.values())

    @property
    def unit(self) -> str:
        return "columns" if self.forward else "rows"

    # --- deciding ----------------------------------------------------------------
    def fits(self, operator: str, executable: Any) -> bool:
        """Does the one-shot ``executable`` fit the chunk budget? If not, ``operator``
        runs in chunks from now on (its one-shot executable is never run)."""
        est = self.framework.estimate(executable)
        if est is None or est.memory_bytes <= self.budget:
            return True
        self.oversized[operator] = est
        return False

    def size_for(self, operator: str) -> int | None:
        """Basis vectors per chunk, or None to run the one-shot executable.

        The plan depends on the prep alone, never on whether the caller streams, so a
        streamed answer is bit for bit the plain one (XLA may round a vmapped batch of
        another width differently). The smallest of: the memory budget's size (for an
        operator too large for one call), the backend's ``batch_size``, and
        ``total / CHUNKS`` once there are ``CHUNK_FROM`` basis vectors or more.
        """
        return _plan(
            self.total, self.budget, self.oversized.get(operator), self.chunk_from,
            getattr(self.engine, "batch_size", None),
        )

    # --- running ----------------------------------------------------------------
    def run(
        self, prep: Any, operator: str, x: Any, tangents: Any, contexts: tuple, size: int,
        job: Job | None,
    ) -> tuple:
        """``operator``'s results (``prep.results(operator)`` order), chunk by chunk; the
        others (value, gradient, aux) once, beside the chunks."""
        exe, size = self._chunk_executable(operator, x, contexts, size)
        total = self.total
        results = prep.results(operator)
        others = tuple(r for r in results if r != self.family)
        head = prep.head(operator, others, x, tangents, contexts) if others else None
        if job is not None:
            job.check()
            job.start(total, self.unit)
        # on the device once, not once per chunk (a large context would be copied each time)
        fw = self.framework
        x, contexts = fw.to_device((x, contexts))
        # Blocks land in one host array that is never zeroed: each chunk writes its own
        # columns or rows once, as the one-shot program writes its result once.
        one = exe.out_info  # the shape and dtype of one chunk's block
        out = np.empty((self.m, self.n), one.dtype)
        block = fw.xp.empty(one.shape, one.dtype)
        kept = job.checkpoints if job is not None else None
        plan = f"{operator}.{self.unit}.{size}.{np.dtype(one.dtype).name}"
        for start in _starts(total, size):
            if job is not None:
                job.check()
            key = f"{plan}.{start}"
            host = kept.restore(key, one.shape, one.dtype) if kept is not None else None
            if host is None:
                block = exe(x, contexts, np.int32(start), block)  # the last block, donated
                # np.asarray waits for the chunk; its view is gone before the next donation
                host = np.asarray(block)
                if kept is not None:  # kept before it is reported: a report means saved
                    kept.save(key, host, start + size)
            if self.forward:
                out[:, start:start + size] = host
            else:
                out[start:start + size] = host
            if job is not None:
                job.report(start + size)
        del block
        values = dict(zip(others, head(x, tangents, contexts), strict=True)) if head else {}
        values[self.family] = out.reshape(self.shape)
        return tuple(values[r] for r in results)

    def compile(
        self, prep: Any, operator: str, x: Any, tangents: Any, contexts: tuple, size: int
    ) -> None:
        """Compile what ``run`` needs (the chunk's executable and the head's) ahead of it."""
        self._chunk_executable(operator, x, contexts, size)
        others = tuple(r for r in prep.results(operator) if r != self.family)
        if others:
            prep.head(operator, others, x, tangents, contexts)

    def _chunk_executable(self, operator: str, x: Any, contexts: tuple, size: int) -> tuple:
        """``(executable, size)`` for chunks of at most ``size``, shrunk until one chunk
        fits the budget; ``BudgetExceededError`` when not even one basis vector does."""
        fw = self.framework
        device = fw.device()
        size = _remembered(self._sizes, device, size)
        exe = self._executables.get((device, size))
        if exe is not None:
            return exe, size

        def compile_at(size: int) -> Any:
            fn = self._block_fn(size)
            block = fw.eval_shape(fn, x, contexts, np.int32(0))
            return fw.compile_donating(
                lambda x, contexts, start, previous: fn(x, contexts, start),
                (x, contexts, np.int32(0), block),
            )

        exe, est, size = _compile_fitting(
            compile_at, size, self.budget, self._sizes, device,
            f"{operator} runs in chunks of basis vectors", fw,
        )
        if self.limits is not None and est is not None:
            self._check(operator, exe, est, size)
        self._executables[(device, size)] = exe
        return exe, size

    def _check(self, operator: str, exe: Any, est: Estimate, size: int) -> None:
        """Per chunk: the request's memory and time bounds (a chunked run stops at its
        deadline); in total: the flops bound, over all chunks."""
        limits = self.limits
        assert limits is not None
        limits.check(exe, f"{operator} (one chunk of {size} {self.unit})", self.framework)
        chunks = -(-self.total // size)
        if limits.max_flops is not None and est.flops * chunks > limits.max_flops:
            raise BudgetExceededError(
                f"{operator} needs an estimated {est.flops * chunks:,.0f} floating-point "
                f"operations in {chunks} chunks, over the limit of {limits.max_flops:,.0f} "
                "(DXSERVE_MAX_REQUEST_FLOPS)",
                field="x", limit="max_request_flops", estimate=est.flops * chunks,
            )

    def _block_fn(self, size: int) -> Callable:
        """``block(x, contexts, start)``: basis vectors ``start .. start + size``
        pushed forward (J's columns, ``(m, size)``) or pulled back (J's rows,
        ``(size, n)``)."""
        f, engine, inner = self.f, self.engine, self.inner
        forward, n, m = self.forward, self.n, self.m
        second = OPERATORS[self.family].order == 2
        fw = self.framework
        xp = fw.xp

        def chunk(x, contexts, start):
            def g(u):
                return f(u, *contexts)

            # a second-order family chunks the Jacobian of the inner backend's gradient
            target = (lambda u: inner.gradient(g, u)[1]) if second else g
            width = n if forward else m
            basis = (xp.arange(size)[:, None] + start == xp.arange(width)[None, :])
            if forward:
                v = xp.ravel(x)
                _, cols = engine.pushforward(
                    lambda u: target(xp.reshape(u, x.shape)), v, astype(xp, basis, v.dtype)
                )
                return xp.reshape(cols, (size, m)).T  # columns of J, as J's own layout
            y = fw.eval_shape(target, x)
            cot = xp.reshape(astype(xp, basis, y.dtype), (size, *y.shape))
            _, rows = engine.pullback(target, x, cot)
            return xp.reshape(rows, (size, n))

        return chunk



def _plan(
    total: int, budget: int, oversized: Estimate | None, chunk_from: int,
    batch_size: int | None = None,
) -> int | None:
    """Items per chunk, or None to run one-shot: the smallest of the budget over the
    one-shot's bytes per item (when the one-shot is ``oversized``), ``batch_size``, and
    ``total / CHUNKS`` from ``chunk_from`` items on."""
    sizes = []
    if oversized is not None:
        sizes.append(max(1, int(budget // max(1.0, oversized.memory_bytes / total))))
    if batch_size:
        sizes.append(batch_size)
    if chunk_from and total >= chunk_from:
        sizes.append(-(-total // CHUNKS))
    if not sizes or min(sizes) >= total:
        return None
    return min(sizes)


def _starts(total: int, size: int) -> list[int]:
    """Where each chunk of ``size`` starts: every ``size`` and, for a remainder, the
    last ``size`` (overlapping its predecessor, recomputing the same basis vectors, so
    every chunk has the one compiled shape and needs no padding)."""
    starts = list(range(0, total - size + 1, size))
    if total % size:
        starts.append(total - size)
    return starts


# --- batches: tangents and points -------------------------------------------------


def slicer_for(
    family: str, compiled: bool, batched: bool, points: int, tangents: int,
    limits: ComputeLimits | None, framework: Framework | None = None,
) -> Slicer | None:
    """A ``Slicer`` over the points of a batch (``batch_axis=0``) or, for operators
    that take tangents, over the tangents; None where there is nothing to slice."""
    if not compiled:
        return None
    budget = getattr(limits, "chunk_memory_bytes", None) or DEFAULT_CHUNK_MEMORY_BYTES
    if batched and points > 1:
        return Slicer("points", points, budget, limits, _chunk_from(limits), framework=framework)
    if not batched and OPERATORS[family].chunks == "tangents" and tangents > 1:
        return Slicer(
            "tangents", tangents, budget, limits, _chunk_from(limits), framework=framework
        )
    return None


def _chunk_from(limits: ComputeLimits | None) -> int:
    """Items from which work runs in ``CHUNKS`` chunks (0: only past the budget)."""
    value = getattr(limits, "chunk_from", None)
    return CHUNK_FROM if value is None else value


@dataclass(eq=False)
class Slicer:
    """Chunked runs of a batch: the prep's own program on ``size`` points or tangents
    at a time (one executable for that size; a remainder covered by a last chunk that
    overlaps its predecessor), the results joined along the batch. Planned as
    ``Chunker`` plans: past the memory budget, from ``CHUNK_FROM`` items in ``CHUNKS``."""

    unit: str  # "points" or "tangents"
    total: int
    budget: int
    limits: ComputeLimits | None = None
    chunk_from: int = CHUNK_FROM
    oversized: dict[str, Estimate] = field(default_factory=dict)
    _executables: dict[tuple, Any] = field(default_factory=dict, repr=False)
    _sizes: dict[tuple, int] = field(default_factory=dict, repr=False)
    framework: Framework = field(default=None, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.framework is None:
            self.framework = get_framework()

    fits = Chunker.fits
    executables = Chunker.executables

    def size_for(self, operator: str) -> int | None:
        """Items per chunk, or None to run the one-shot executable."""
        return _plan(self.total, self.budget, self.oversized.get(operator), self.chunk_from)

    def run(
        self, prep: Any, operator: str, x: Any, tangents: Any, contexts: tuple, size: int,
        job: Job | None,
    ) -> tuple:
        """``operator``'s results, the batch computed ``size`` items at a time."""
        exe, size = self._executable(prep, operator, x, tangents, contexts, size)
        op = OPERATORS[operator]
        results = prep.results(operator)  # aux: per point in a batch, else as a value
        if job is not None:
            job.check()
            job.start(self.total, self.unit)
        parts: list[tuple] = []
        done = 0
        fw = self.framework
        contexts = fw.to_device(contexts)
        for start in _starts(self.total, size):
            if job is not None:
                job.check()
            xs, ts = self._slice(x, tangents, start, size)
            out = fw.block(exe(xs, ts, contexts))
            skip = done - start  # the overlap of a last chunk: computed twice, kept once
            parts.append(tuple(self._drop(name, v, skip, op) for name, v in
                               zip(results, out, strict=True)))
            done = start + size
            if job is not None:
                job.report(done)
        return tuple(
            self._join(name, [p[i] for p in parts], op) for i, name in enumerate(results)
        )

    def compile(
        self, prep: Any, operator: str, x: Any, tangents: Any, contexts: tuple, size: int
    ) -> None:
        """Compile the chunk's executable ``run`` needs, ahead of it."""
        self._executable(prep, operator, x, tangents, contexts, size)

    # --- slicing and joining -------------------------------------------------------
    def _slice(self, x: Any, tangents: Any, start: int, size: int) -> tuple:
        if self.unit == "tangents":
            return x, tuple(tangents[start:start + size])
        cut = lambda v: v[start:start + size]  # noqa: E731
        tmap = self.framework.tree_map
        ts = None if tangents is None else tmap(cut, tangents)
        return tmap(cut, x), ts

    def _drop(self, name: str, value: Any, skip: int, op: Any) -> Any:
        if skip <= 0:
            return value
        if self.unit == "tangents":
            return tuple(value[skip:]) if name in op.batch_results else value
        return self.framework.tree_map(lambda v: v[skip:], value)

    def _join(self, name: str, values: list, op: Any) -> Any:
        if self.unit == "tangents":
            if name not in op.batch_results:
                return values[0]  # value, gradient: the same in every chunk
            return tuple(item for value in values for item in value)
        return self.framework.tree_map(
            lambda *vs: np.concatenate([np.asarray(v) for v in vs]), *values
        )

    def _executable(
        self, prep: Any, operator: str, x: Any, tangents: Any, contexts: tuple, size: int
    ) -> tuple:
        """``(executable, size)`` for chunks of ``size`` items, shrunk until one fits the
        budget (``BudgetExceededError`` when one item does not)."""
        device = self.framework.device()
        size = _remembered(self._sizes, device, size)
        exe = self._executables.get((operator, device, size))
        if exe is not None:
            return exe, size

        def compile_at(size: int) -> Any:
            xs, ts = self._slice(x, tangents, 0, size)
            return prep._compile(operator, xs, ts, contexts, chunk=True)

        exe, _, size = _compile_fitting(
            compile_at, size, self.budget, self._sizes, device,
            f"{operator} runs in chunks of {self.unit}", self.framework,
        )
        self._executables[(operator, device, size)] = exe
        return exe, size


def _remembered(sizes: dict, device: Any, size: int) -> int:
    """``size`` after every shrink remembered for ``device`` (see ``_compile_fitting``)."""
    while (device, size) in sizes:
        size = sizes[(device, size)]
    return size


def _compile_fitting(
    compile_at: Callable[[int], Any], size: int, budget: int, sizes: dict, device: Any,
    what: str, framework: Framework,
) -> tuple[Any, Estimate | None, int]:
    """``(executable, estimate, size)``: ``compile_at(size)``, with ``size`` shrunk until
    XLA's estimate of one chunk fits ``budget`` (each shrink remembered in ``sizes``);
    ``BudgetExceededError`` when not even a chunk of one fits (``what`` says of what)."""
    while True:
        exe = compile_at(size)
        est = framework.estimate(exe)
        if est is None or est.memory_bytes <= budget:
            return exe, est, size
        if size == 1:
            raise BudgetExceededError(
                f"{what}, but even one needs an estimated {est.memory_bytes:,} bytes of "
                f"device memory, over the chunk budget of {budget:,} "
                "(DXSERVE_CHUNK_MEMORY_BYTES)",
                field="x", limit="chunk_memory_bytes", estimate=est.memory_bytes,
            )
        smaller = max(1, min(size - 1, int(size * budget / est.memory_bytes)))
        sizes[(device, size)] = smaller
        size = smaller
