"""PyTorch as a ``Framework``: torch.func transforms, tensors inside, numpy at the edges.

A function written in torch (``@dxserve.function(framework="torch")``, or detected) is
differentiated by the torch engines (``backends/torch_modes.py``, on ``torch.func``) or
by finite differences, prepared, chunked and budgeted like a JAX one. What differs:

* **Arrays.** The core hands an executable numpy arrays (from the wire, or converted
  from the caller's tensors by ``preparation.as_tree``); the executable moves them to
  the device as tensors of the same dtype (``to_torch``), runs the operator's program
  and returns detached tensors on the host (CPU), which numpy reads without a copy.
  float32 stays float32 and float64 float64: nothing is promoted.
* **Device.** CUDA when torch sees a GPU, else the CPU (``DEVICE``).
* **Probing** calls the function once on the inputs (torch has no abstract evaluation
  that can see tensors a function closes over); ``eval_shape`` runs on meta tensors
  where it can.
* **Compiling.** An executable answers at once, running the program eagerly:
  preparation keeps the resolved engines, the built program and its estimate, so a
  call pays only the program itself. ``torch.compile`` makes calls several times
  faster for seconds of compilation per signature (bench/results/torch-cpu.md), so
  it is used where it pays (``DXSERVE_TORCH_COMPILE``): ``hot``, the server's
  default, compiles an executable on a background thread once it has run eagerly for
  ``DXSERVE_TORCH_COMPILE_AFTER`` seconds, checks the compiled program's results
  against the eager ones on the same inputs and then runs it instead (a program that
  does not compile, or disagrees, stays eager); ``always`` compiles before the first
  answer; ``off``, the library's default, never.
* **Estimates** (budgets, chunk planning) come from one run of the program on meta
  tensors (shapes, no data) at compile time: the most bytes its operations hold at once
  (each allocation watched until it is freed), the flops of its matrix products
  (``FlopCounterMode``) plus one per element other operations write. A program that
  cannot run on meta tensors (one that closes over concrete tensors) has no estimate
  and is not bounded, as server-side numpy code is not.
* **Pytrees** are JAX's (dicts, lists, tuples; tensors are leaves), as the core's are;
  ``torch.func`` takes the same containers.
* Requests are not merged into batches (``batch_program``), and executables are not
  persisted across restarts.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode  # the documented extension point
from torch.utils.flop_counter import FlopCounterMode

from dxserve.core import threads
from dxserve.frameworks import Estimate

Tree = Any

#: Where torch functions compute: the first GPU torch sees, else the CPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_CPU = torch.device("cpu")


def _compile_mode(text: str) -> str:
    text = text.strip().lower()
    if text in ("1", "true", "yes"):
        return "always"
    return text if text in ("hot", "always") else "off"


#: When executables use ``torch.compile``: "off", "hot" or "always" (see the module).
COMPILE = _compile_mode(os.environ.get("DXSERVE_TORCH_COMPILE", "off"))
#: Seconds an executable runs eagerly before "hot" compiles it.
COMPILE_AFTER = float(os.environ.get("DXSERVE_TORCH_COMPILE_AFTER") or 2.0)
#: How low the background compile thread runs, below the threads that serve
COMPILE_NICE = 10
_log = logging.getLogger("dxserve.torch")
#: Held while any torch program runs (eagerly, on meta tensors, compiled, or being
#: compiled): torch's forward-mode AD keeps its levels in process-wide state, so two
#: threads in ``torch.func.jvp`` at once corrupt each other's, and neither compiling nor
#: running a ``torch.compile``d program is safe beside another thread doing either (the
#: device workers, the compile threads that probe and estimate, the background compile
#: thread). Reverse-only programs would not need it for the first reason, but do for
#: the second, which is why it is one lock and not one for forward mode.
RUN_LOCK = threading.RLock()
#: What the background compiles came to: served compiled, or kept eager (failed or disagreed)
_OUTCOMES = {"compiled": 0, "kept_eager": 0}


# --- dtypes and conversions -----------------------------------------------------------
_TO_TORCH: dict[np.dtype, torch.dtype] = {}
_TO_NUMPY: dict[torch.dtype, np.dtype] = {}


def torch_dtype(dtype: Any) -> torch.dtype:
    """A numpy dtype (or anything ``np.dtype`` takes, or a torch dtype) as torch's."""
    if isinstance(dtype, torch.dtype):
        return dtype
    dt = np.dtype(dtype)
    found = _TO_TORCH.get(dt)
    if found is None:
        if dt.name == "bfloat16":  # ml_dtypes' type, which torch.from_numpy does not know
            found = torch.bfloat16
        else:
            found = torch.from_numpy(np.empty(0, dt)).dtype
        _TO_TORCH[dt] = found
    return found


def numpy_dtype(dtype: Any) -> np.dtype:
    """A torch dtype (or a numpy one) as numpy's."""
    if not isinstance(dtype, torch.dtype):
        return np.dtype(dtype)
    found = _TO_NUMPY.get(dtype)
    if found is None:
        if dtype == torch.bfloat16:
            import ml_dtypes

            found = np.dtype(ml_dtypes.bfloat16)
        else:
            found = torch.empty(0, dtype=dtype, device="cpu").numpy().dtype
        _TO_NUMPY[dtype] = found
    return found


def _tensor(value: Any, device: torch.device) -> Any:
    """One leaf as a tensor on ``device`` (tensors moved, numpy arrays shared where they
    can be); other leaves (Python numbers) as they are."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if not isinstance(value, np.ndarray):
        return value
    bfloat16 = value.dtype.name == "bfloat16"
    if bfloat16:  # neither from_numpy nor DLPack knows ml_dtypes' bfloat16: share its bits
        # (not ascontiguousarray, which makes a 0-d array 1-d)
        value = (value if value.flags.c_contiguous else value.copy(order="C")).view(np.uint16)
    if value.flags.writeable:
        t = torch.from_numpy(value)
    elif value.flags.c_contiguous:
        # a read-only buffer from the wire, shared without a copy. from_numpy would warn
        # that torch has no read-only tensors, and silencing that per call is not
        # thread-safe; DLPack shares the same memory without the warning. Functions must
        # not write their inputs in place (autograd refuses to for the ones it tracks).
        try:
            t = torch.from_dlpack(value)
        except (BufferError, RuntimeError):  # numpy < 2 exports no read-only arrays
            t = torch.from_numpy(value.copy())
    else:  # read-only and strided (DLPack refuses negative strides): a writable copy
        t = torch.from_numpy(np.ascontiguousarray(value))
    if bfloat16:
        t = t.view(torch.bfloat16)
    return t if device.type == "cpu" else t.to(device)


def to_torch(tree: Tree, device: torch.device = DEVICE) -> Tree:
    """``tree``'s arrays (numpy or torch) as tensors on ``device``, dtypes kept."""
    return jax.tree_util.tree_map(lambda v: _tensor(v, device), tree)


def _host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach()
        return value if value.device.type == "cpu" else value.cpu()
    return value


def to_host(tree: Tree) -> Tree:
    """``tree``'s tensors detached and on the host (numpy reads them without a copy)."""
    return jax.tree_util.tree_map(_host, tree)


def host_numpy(tree: Tree) -> Tree:
    """``tree``'s tensors as numpy arrays on the host (bfloat16 as ``ml_dtypes``')."""

    def one(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        value = _host(value)
        if value.dtype == torch.bfloat16:
            return value.view(torch.uint16).numpy().view(numpy_dtype(torch.bfloat16))
        return value.numpy()

    return jax.tree_util.tree_map(one, tree)


def tree_map(fn: Callable[..., Any], tree: Tree, *rest: Tree) -> Tree:
    """``jax.tree_util.tree_map`` over tensors in dicts, lists and tuples (None empty), in
    Python alone: ``torch.compile`` traces it, where it cannot trace JAX's C++ pytrees."""
    if isinstance(tree, torch.Tensor):
        return fn(tree, *rest)
    if tree is None:
        return None
    if isinstance(tree, dict):
        return {k: tree_map(fn, v, *(r[k] for r in rest)) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        items = [tree_map(fn, v, *(r[i] for r in rest)) for i, v in enumerate(tree)]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    return fn(tree, *rest)


def tree_leaves(tree: Tree) -> list[Any]:
    """``jax.tree_util.tree_leaves``' order (dict keys sorted), in Python alone."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if tree is None:
        return []
    if isinstance(tree, dict):
        return [leaf for k in sorted(tree) for leaf in tree_leaves(tree[k])]
    if isinstance(tree, list | tuple):
        return [leaf for v in tree for leaf in tree_leaves(v)]
    return [tree]


def batch_map(fn: Callable[[Tree], Tree], batch: Tree, batch_size: int | None = None) -> Tree:
    """``vmap(fn)(batch)`` over the leading axis, ``batch_size`` items at a time; a batch
    of one (one tangent) is one plain call, without vmap's cost (half an HVP's, at n = 10)."""
    leaves = tree_leaves(batch)
    if leaves and leaves[0].shape[0] == 1:
        return tree_map(lambda v: v[None], fn(tree_map(lambda v: v[0], batch)))
    return torch.func.vmap(fn, chunk_size=batch_size)(batch)


# --- specs ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    """An abstract tensor: its shape and its dtype (numpy's, as the core reads it)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def spec_of(value: Any) -> TensorSpec:
    if isinstance(value, torch.Tensor):
        return TensorSpec(tuple(value.shape), numpy_dtype(value.dtype))
    a = np.asarray(value)
    return TensorSpec(a.shape, a.dtype)


# --- the array namespace the fallbacks compute with -------------------------------------
class TorchNumpy:
    """numpy's spelling of what ``Engine``'s fallbacks, finite differences and chunking
    call (``Framework.xp``), on torch: numpy or torch dtypes, tensors on ``DEVICE``."""

    @staticmethod
    def eye(n: int, dtype: Any = None) -> torch.Tensor:
        return torch.eye(int(n), dtype=None if dtype is None else torch_dtype(dtype), device=_device())

    @staticmethod
    def ones(shape: Any, dtype: Any = None) -> torch.Tensor:
        return torch.ones(_shape(shape), dtype=_dt(dtype), device=_device())

    @staticmethod
    def zeros(shape: Any, dtype: Any = None) -> torch.Tensor:
        return torch.zeros(_shape(shape), dtype=_dt(dtype), device=_device())

    @staticmethod
    def empty(shape: Any, dtype: Any = None) -> torch.Tensor:
        return torch.empty(_shape(shape), dtype=_dt(dtype), device=_device())

    @staticmethod
    def arange(n: int) -> torch.Tensor:
        return torch.arange(int(n), device=_device())

    @staticmethod
    def reshape(a: torch.Tensor, shape: Any) -> torch.Tensor:
        return torch.reshape(a, _shape(shape))

    @staticmethod
    def ravel(a: torch.Tensor) -> torch.Tensor:
        return torch.ravel(a)

    @staticmethod
    def concatenate(arrays: Sequence[torch.Tensor], axis: int = 0) -> torch.Tensor:
        return torch.cat(list(arrays), dim=axis)

    @staticmethod
    def stack(arrays: Sequence[torch.Tensor], axis: int = 0) -> torch.Tensor:
        return torch.stack(list(arrays), dim=axis)

    @staticmethod
    def abs(a: torch.Tensor) -> torch.Tensor:
        return torch.abs(a)

    @staticmethod
    def max(a: torch.Tensor) -> torch.Tensor:
        return torch.amax(a)

    @staticmethod
    def maximum(a: Any, b: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            a, b = b, a
        if not isinstance(a, torch.Tensor):
            return max(a, b)
        if not isinstance(b, torch.Tensor):
            return torch.clamp_min(a, b)
        return torch.maximum(a, b)

    @staticmethod
    def asarray(value: Any, dtype: Any = None) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value if dtype is None else value.to(torch_dtype(dtype))
        return torch.as_tensor(value, dtype=_dt(dtype), device=_device())

    @staticmethod
    def astype(a: torch.Tensor, dtype: Any) -> torch.Tensor:
        return a.to(torch_dtype(dtype))

    @staticmethod
    def finfo(dtype: Any) -> Any:
        return torch.finfo(torch_dtype(dtype))

    @staticmethod
    def real(a: torch.Tensor) -> torch.Tensor:
        return torch.real(a)

    @staticmethod
    def imag(a: torch.Tensor) -> torch.Tensor:
        return torch.imag(a) if a.is_complex() else torch.zeros_like(a)


def _device() -> torch.device:
    """``DEVICE``, or meta inside a run on meta tensors (``_estimate``)."""
    default = torch.get_default_device()
    return default if default.type == "meta" else DEVICE


def _dt(dtype: Any) -> torch.dtype | None:
    return None if dtype is None else torch_dtype(dtype)


def _shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, int | np.integer):
        return (int(shape),)
    return tuple(int(d) for d in shape)


# --- executables -------------------------------------------------------------------------
class TorchExecutable:
    """An operator's program for one signature: numpy (or tensors) in, host tensors out.

    ``out_info``: the spec of its output where it is one array (a chunk's block);
    ``estimate``: from one run on meta tensors, None where that cannot run."""

    __slots__ = ("fn", "run", "out_info", "estimate", "eager_seconds", "compile_tried",
                 "_queued", "__weakref__")

    def __init__(self, fn: Callable, args: tuple, out_info: Any = None) -> None:
        self.fn = fn
        #: set once compiling has been tried: ``run`` is then the compiled program, or
        #: still ``fn`` where it did not compile or disagreed
        self.compile_tried = threading.Event()
        self.eager_seconds = 0.0
        self._queued = False
        self.run = fn
        if COMPILE == "always":
            self.run = torch.compile(fn, dynamic=False)
            self.compile_tried.set()
        self.estimate, meta_out = _estimate(fn, args)
        if out_info is None and meta_out is not None and isinstance(meta_out, torch.Tensor):
            out_info = spec_of(meta_out)
        self.out_info = out_info

    def __call__(self, *args: Any) -> Any:
        # not under no_grad: torch.func's transforms ignore it, but some rules compute
        # their derivatives' derivatives with it and lose them (det's, for one)
        tensors = to_torch(args)
        with RUN_LOCK:
            run = self.run
            if COMPILE != "hot" or run is not self.fn:
                return to_host(run(*tensors))
            start = time.perf_counter()
            out = to_host(run(*tensors))
            self.eager_seconds += time.perf_counter() - start
        if self.eager_seconds >= COMPILE_AFTER:
            self._compile_later(tensors, out)
        return out

    def _compile_later(self, args: tuple, expected: Any) -> None:
        """Queue this executable for compiling on the background thread, with copies of
        one call's inputs and eager results to check the compiled program against."""
        with _QUEUE_LOCK:
            if self._queued:
                return
            self._queued = True
        copy = partial(tree_map, lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v)
        _background().put((weakref.ref(self), copy(args), copy(expected)))

    def _compile_now(self, args: tuple, expected: Any) -> None:
        # under the lock (compiling traces the program): torch calls wait for it, once
        try:
            with RUN_LOCK:
                self._try_compiling(args, expected)
        finally:
            self.compile_tried.set()

    def _try_compiling(self, args: tuple, expected: Any) -> None:
        try:
            compiled = torch.compile(self.fn, dynamic=False)
            got = to_host(compiled(*args))
        except Exception as exc:  # noqa: BLE001 - any failure leaves the eager program
            _log.warning("torch.compile failed; the program stays eager: %s", _first_line(exc))
            _OUTCOMES["kept_eager"] += 1
            return
        if not _agree(got, expected):
            _log.warning("the compiled program's results differ from the eager ones beyond "
                         "rounding; the program stays eager")
            _OUTCOMES["kept_eager"] += 1
            return
        self.run = compiled
        _OUTCOMES["compiled"] += 1


# --- the background compile thread --------------------------------------------------------
_QUEUE_LOCK = threading.Lock()
_QUEUE: queue.SimpleQueue | None = None


def _background() -> queue.SimpleQueue:
    """The queue of the one thread that compiles hot executables (started when first
    needed: a daemon, so a compile in progress never holds up the process's exit)."""
    global _QUEUE
    with _QUEUE_LOCK:
        if _QUEUE is None:
            _QUEUE = queue.SimpleQueue()
            threading.Thread(
                target=_compile_forever, args=(_QUEUE,), name="dxserve-torch-compile",
                daemon=True,
            ).start()
    return _QUEUE


def _compile_forever(jobs: queue.SimpleQueue) -> None:
    threads.lower_priority_of_current_thread(COMPILE_NICE)
    while True:
        ref, args, expected = jobs.get()
        executable = ref()
        if executable is not None:  # not evicted while it waited
            executable._compile_now(args, expected)
        del executable, args, expected


def _agree(got: Tree, expected: Tree) -> bool:
    """Do the compiled results match the eager ones leaf by leaf, to rounding (the
    square root of the dtype's epsilon, relative to the largest entry)?"""
    got_leaves, expected_leaves = tree_leaves(got), tree_leaves(expected)
    if len(got_leaves) != len(expected_leaves):
        return False
    for g, e in zip(got_leaves, expected_leaves, strict=True):
        if not isinstance(e, torch.Tensor):
            continue
        if not isinstance(g, torch.Tensor) or g.shape != e.shape or g.dtype != e.dtype:
            return False
        if not (e.is_floating_point() or e.is_complex()):
            if not torch.equal(g, e):
                return False
            continue
        rtol = torch.finfo(e.dtype).eps ** 0.5
        scale = float(e.abs().max()) if e.numel() else 0.0
        if not torch.allclose(g, e, rtol=rtol, atol=rtol * max(1.0, scale), equal_nan=True):
            return False
    return True


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _meta(value: Any) -> Any:
    """A meta tensor shaped like ``value``: a tensor, a numpy array or a spec (anything
    with ``shape`` and ``dtype``); other leaves as they are."""
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        return value
    return torch.empty(tuple(value.shape), dtype=torch_dtype(value.dtype), device="meta")


class _Allocations(TorchDispatchMode):
    """Every tensor the operations below torch.func's transforms allocate (views are not
    allocations), and when it is freed: the most bytes alive at once, and in all."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.total = self.elements = 0

    def _free(self, size: int) -> None:
        self.live -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, tuple | list) else (out,)
        for ret, value in zip(func._schema.returns, outs, strict=False):
            if isinstance(value, torch.Tensor) and ret.alias_info is None:
                size = value.numel() * value.element_size()
                self.live += size
                self.total += size
                self.elements += value.numel()
                self.peak = max(self.peak, self.live)
                weakref.finalize(value, self._free, size)
        return out


def _estimate(fn: Callable, args: tuple) -> tuple[Estimate | None, Any]:
    """``(estimate, meta outputs)`` of ``fn(*args)`` from a run on meta tensors (shapes
    and dtypes, no data), or ``(None, None)`` where it cannot run on them.

    Memory: the arguments, plus the most bytes the program's operations hold at once
    (each allocation counted until torch frees it, as a real run frees it). Work: the
    flops ``FlopCounterMode`` counts (matrix products, convolutions) plus one per element
    every other operation writes; traffic: the arguments read and every allocation
    written."""
    meta = jax.tree_util.tree_map(_meta, args)
    try:
        # torch.device("meta") sets the default device of this thread alone
        with RUN_LOCK, torch.device("meta"), FlopCounterMode(display=False) as counter:
            with _Allocations() as allocations:
                out = fn(*meta)
    except Exception:  # noqa: BLE001 - closes over concrete tensors, say: not bounded
        return None, None
    arg_bytes = sum(_nbytes(v) for v in jax.tree_util.tree_leaves(meta))
    memory = arg_bytes + allocations.peak
    flops = float(counter.get_total_flops() + allocations.elements)
    return Estimate(int(memory), flops, float(arg_bytes + allocations.total)), out


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return 0


# --- the framework -----------------------------------------------------------------------
class TorchFramework:
    """torch as a ``Framework`` (see the module)."""

    name = "torch"
    xp = TorchNumpy()

    # pytrees: JAX's, as the core's (tensors are leaves)
    def leaves(self, tree: Tree) -> list[Any]:
        return tree_leaves(tree)

    def flatten(self, tree: Tree) -> tuple[list[Any], Any]:
        return jax.tree_util.tree_flatten(tree)

    def unflatten(self, structure: Any, leaves: Sequence[Any]) -> Tree:
        return jax.tree_util.tree_unflatten(structure, list(leaves))

    def tree_map(self, fn: Callable[..., Any], tree: Tree, *rest: Tree) -> Tree:
        return tree_map(fn, tree, *rest)

    def is_traced(self, tree: Tree) -> bool:
        # operators run prepared programs on concrete inputs; called inside torch.func's
        # own transforms they would see wrapped tensors, which ``as_tree`` refuses
        return False

    def spec(self, shape: tuple[int, ...], dtype: Any) -> TensorSpec:
        return TensorSpec(tuple(shape), numpy_dtype(dtype))

    def to_device(self, tree: Tree) -> Tree:
        return to_torch(tree)

    def from_host(self, tree: Tree) -> Tree:
        """Results as the library returns them: tensors on the host (numpy arrays from
        chunked runs and cut tangent batches become tensors sharing their memory)."""
        return jax.tree_util.tree_map(
            lambda v: _tensor(v, _CPU) if isinstance(v, np.ndarray | np.generic) else v, tree
        )

    #: one executable serves every device worker: torch places its tensors on ``DEVICE``
    #: itself and follows no worker's pinning
    per_device = False

    def device(self) -> Any:
        return None

    def block(self, tree: Tree) -> Tree:
        return tree  # executables return host tensors: finished

    # probing
    def probe(self, f: Callable, x: Tree, contexts: tuple) -> tuple[bool, Tree]:
        """``f`` called once on the inputs: its outputs' specs. A torch function whose
        result holds anything but tensors is refused (a ``TypeError``)."""
        with RUN_LOCK, torch.no_grad():
            out = f(*to_torch((x, *contexts)))
        leaves = jax.tree_util.tree_leaves(out)
        bad = next((v for v in leaves if not isinstance(v, torch.Tensor)), None)
        if bad is not None or not leaves:
            what = type(bad).__name__ if leaves else "no tensor"
            raise TypeError(
                f"a torch function must return tensors (or a pytree of them), got {what}"
            )
        return True, jax.tree_util.tree_map(spec_of, out)

    def eval_shape(self, fn: Callable, *args: Any) -> Tree:
        """Output specs of ``fn(*args)``: on meta tensors where ``args`` are concrete
        arrays and ``fn`` runs on them, else by calling ``fn`` (inside a program, on its
        tensors)."""
        concrete = not any(
            isinstance(v, torch.Tensor) for v in jax.tree_util.tree_leaves(args)
        )
        if concrete:
            meta = jax.tree_util.tree_map(_meta, args)
            try:
                with RUN_LOCK, torch.device("meta"):
                    return jax.tree_util.tree_map(spec_of, fn(*meta))
            except Exception:  # noqa: BLE001 - closes over concrete tensors: run it
                pass
            args = to_torch(args)
        with RUN_LOCK, torch.no_grad():
            return jax.tree_util.tree_map(spec_of, fn(*args))

    # transforming
    def vmap(self, fn: Callable, in_axes: Any = 0) -> Callable:
        return torch.func.vmap(fn, in_dims=in_axes)

    def map(self, fn: Callable[[Tree], Tree], batch: Tree, batch_size: int | None) -> Tree:
        return batch_map(fn, batch, batch_size)

    def ravel(self, tree: Tree) -> tuple[Any, Callable[[Any], Tree]]:
        """``(vector, unravel)``: the leaves concatenated (in their promoted dtype), and
        the inverse, which casts each leaf back (as ``jax.flatten_util.ravel_pytree``)."""
        leaves, structure = jax.tree_util.tree_flatten(tree)
        shapes = [tuple(v.shape) for v in leaves]
        dtypes = [v.dtype for v in leaves]
        sizes = [math.prod(s) for s in shapes]
        if leaves:
            vec = torch.cat([torch.reshape(v, (-1,)) for v in leaves])
        else:
            vec = torch.zeros(0, device=_device())

        def unravel(v: Any) -> Tree:
            parts = torch.split(v, sizes) if leaves else []
            return jax.tree_util.tree_unflatten(structure, [
                torch.reshape(p, s).to(d) for p, s, d in zip(parts, shapes, dtypes, strict=True)
            ])

        return vec, unravel

    # compiling and what it costs
    def compile(self, fn: Callable, args: tuple, key: Any = None) -> TorchExecutable:
        return TorchExecutable(fn, args)

    def compile_donating(self, fn: Callable, args: tuple) -> TorchExecutable:
        # no donation in torch; the last argument (the previous block: its spec, here) is
        # ignored by fn, and is the output's spec
        previous = args[-1]
        return TorchExecutable(fn, args, previous if isinstance(previous, TensorSpec) else None)

    def executable_key(self, *args: Any) -> Any:
        return None

    def estimate(self, executable: Any) -> Estimate | None:
        return getattr(executable, "estimate", None)

    def batch_program(self, run: Callable, inputs: tuple) -> tuple[Any, str]:
        return None, "torch runs each request as it comes"

    def compile_batched(self, program: Any, stacked: list[Any]) -> Callable:
        raise NotImplementedError("torch programs are not merged across requests")

    def out_structure(self, program: Any) -> Any:
        raise NotImplementedError("torch programs are not merged across requests")

    def program_arrays(self, program: Any) -> list[Any]:
        return []

    # precision and fallbacks
    def precision_scope(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # torch keeps every tensor's dtype as it is

    def eager(self) -> TorchFramework:
        return self

    def background_compiles(self) -> dict[str, int]:
        """How many hot executables were compiled and served compiled, and how many
        stayed eager (they did not compile, or disagreed with the eager results)."""
        return dict(_OUTCOMES)


TORCH = TorchFramework()
