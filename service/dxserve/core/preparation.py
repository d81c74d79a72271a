"""Preparation: pay tracing and compilation once per call signature.

``prepare(operator, f, backend, x, tangents, contexts)`` probes the function,
resolves the backend, validates the inputs, builds the operator's pure JAX
function and compiles it. The returned ``Prep`` holds the executable; calls with
a matching signature run it directly, calls with another signature raise
``PreparationMismatchError``. Without an explicit prep, ``call`` keeps compiled
preps in an LRU keyed by (function, operator, backend, signature), bounded by count
and by the bytes the preps keep alive (``Prep.nbytes``).

``batch_axis=0`` makes x (every leaf) and the tangents carry a leading axis of
independent points, contexts shared: the family is checked and built for one point
and the operator is vmapped over the points inside the one compiled call.

``has_aux=True``: f returns a pair ``(output, aux)``. The family is checked and built
for ``output`` alone (``primary``) and aux, f's second element at x, is one more result
(``with_aux``), never differentiated; under ``batch_axis=0`` it is stacked like the
others. Compiled, XLA computes f's shared work at x once for both.

Everything framework-specific (probing, compiling, vmapping, devices, precision) goes
through the function's ``Framework`` (``frameworks``; JAX unless the function names
another).
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from importlib import import_module
from typing import TYPE_CHECKING, Any

import numpy as np

from dxcontract import dtypes
from dxcontract.backends import Auto, Backend, SecondOrder, backend_from_json
from dxcontract.encodings.common import is_array_list
from dxcontract.errors import (
    FIX,
    DtypeMismatchError,
    DxError,
    FunctionEvaluationError,
    InvalidArgumentError,
    OverloadedError,
    PreparationMismatchError,
    ResultTooLargeError,
    ShapeMismatchError,
    UnsupportedOperatorError,
)
from dxcontract.lru import LRU
from dxcontract.operators import AUX, OPERATORS, result_names, returned
from dxserve.core import holomorphic
from dxserve.core.arity import check_contexts
from dxserve.core.backends import engines_for, refuse_low_precision
from dxserve.core.backends.engine import Engine
from dxserve.core.backends.real_parts import ComplexRefused, has_complex
from dxserve.core.backends.selection import (
    auto_candidates,
    auto_rule,
    backend_name,
    candidates,
    mode_name,
)
from dxserve.core.chunking import chunker_for, slicer_for
from dxserve.core.footprint import EXECUTABLE_BYTES, array_bytes, executable_bytes
from dxserve.core.limits import ComputeLimits
from dxserve.core.progress import Job, JobCancelled
from dxserve.core.wrt import Dotted, Selected, dotted, refuse_cotangent, select
from dxserve.frameworks import Framework, framework_of, get_framework, host_array

if TYPE_CHECKING:
    from dxserve.frameworks.jax.signature import Signature

Tree = Any


class _Packing:
    """``frameworks/jax/packing`` (tangent batches, on JAX's tree functions), loaded at
    the first preparation: importing the core loads no framework."""

    def __getattr__(self, name: str) -> Any:
        from dxserve.frameworks.jax import packing

        return getattr(packing, name)


packing = _Packing()


def _signature_of(*args: Any) -> Signature:
    """``Signature.of(x, tangents, contexts, batch_axis, has_aux)``, loaded when first used."""
    from dxserve.frameworks.jax.signature import Signature

    return Signature.of(*args)
_log = logging.getLogger("dxserve.compile")
#: results that hold one value per tangent, packed by the programs (see ``packing``)
BATCH_RESULTS = frozenset().union(*(op.batch_results for op in OPERATORS.values()))


# --- inputs and signatures -------------------------------------------------
def as_tree(value: Any) -> Tree:
    """Normalize one input: Python numbers and lists of numbers become float64 arrays.

    numpy and JAX arrays keep their dtype, torch tensors become numpy arrays of theirs;
    dicts, tuples and lists of anything else (arrays, pytrees, None) are pytree nodes.
    """
    if type(value) is np.ndarray:
        return value  # (the fast path; any other array falls through unchanged)
    if type(value) is dict:
        return {k: as_tree(v) for k, v in value.items()}
    if type(value) is tuple:
        return tuple(as_tree(v) for v in value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple keeps its type
        return type(value)(*(as_tree(v) for v in value))
    if isinstance(value, dict):  # an OrderedDict, a defaultdict: JAX's nodes, kept as they are
        return _custom_node(value)
    if isinstance(value, tuple):
        return tuple(as_tree(v) for v in value)
    if isinstance(value, np.generic):
        return np.asarray(value)
    if isinstance(value, bool):
        return np.asarray(value)
    if isinstance(value, list) and not is_array_list(value):  # a list node of a pytree
        return [as_tree(v) for v in value]
    if isinstance(value, (int, float, list)):
        return np.asarray(value, dtype=np.float64)
    host = host_array(value)  # a torch tensor: its data, on the host, of its dtype
    if host is not None:
        return host
    if hasattr(value, "dtype"):  # a JAX (or other) array
        return value
    return _custom_node(value)


def _custom_node(value: Any) -> Tree:
    """A node JAX's ``tree_util`` knows (a registered dataclass: ``flax.struct``, an
    ``equinox.Module``, ...) with its children normalized; its type is kept. Anything
    else (an array, an unknown object) is returned as it is."""
    from dxserve.frameworks.jax.framework import (
        rebuild_node,  # only for objects no framework claims
    )

    return rebuild_node(value, as_tree)


# --- operator families -----------------------------------------------------
@dataclass(frozen=True)
class Inputs:
    """What a family's checks and builder may look at (concrete or abstract)."""

    x: Tree
    tangents: tuple | None
    contexts: tuple
    y: Tree  # ShapeDtypeStruct pytree of f(x, *contexts)
    #: the function's framework (its pytrees: what the checks walk)
    framework: Framework = field(default_factory=get_framework)
    #: the caller declared f holomorphic (``holomorphic.declared``)
    holomorphic: bool = False


Builder = Callable[[Callable, Engine, "Engine | None", Inputs], Callable]


@dataclass(frozen=True)
class Family:
    """One operator family: a check of its inputs and a builder of its function.

    ``build(f, engine, inner, inputs)`` returns ``run(x, tangents, contexts) -> dict``
    mapping result names (``OPERATORS[op].results``) to values. ``run`` takes the
    tangents packed (one pytree, each leaf stacked on a leading axis of k; see
    ``packing``) and returns per-tangent results packed alike; ``inputs.tangents``,
    what ``check`` sees, is the tuple of k.
    """

    name: str
    check: Callable[[Inputs], None]
    build: Builder


class _Families(dict):
    """The registered families. Each operator module registers its own when it loads;
    a lookup before any has loaded (a server that never imported ``dxserve.core.operators``,
    since ``import dxserve`` loads it lazily) loads them all first."""

    def __missing__(self, name: str) -> Family:
        import_module("dxserve.core.operators")
        if name in self:
            return self[name]
        raise KeyError(name)


FAMILIES: dict[str, Family] = _Families()


def register_family(family: Family) -> Family:
    FAMILIES[family.name] = family
    return family


# --- the prep object -------------------------------------------------------
@dataclass(eq=False)
class Prep:
    """A prepared operator: the compiled executable for one call signature.

    Made for one operator; the other operators of its family (``gradient`` and
    ``value_and_gradient``) accept it too and compile their own variant on first
    use, so each executable computes only the results its operator returns.
    """

    operator: str
    function: Callable
    backend: Backend
    resolved: Backend
    signature: Signature
    output: Tree = field(repr=False)
    build: Callable = field(repr=False)  # run(x, tangents, contexts) -> dict, not compiled
    #: the engine that compiles the operator (the outer one for second order)
    compiler: Engine = field(repr=False)
    #: True when the operator is compiled by JAX (function and engines all trace)
    traced: bool = True
    executables: dict[tuple, Callable] = field(default_factory=dict, repr=False)  # (op, device)
    batch_plans: dict[str, Any] = field(default_factory=dict, repr=False)  # see request_batching
    #: per-request bounds each executable is checked against when compiled (None: none)
    limits: ComputeLimits | None = field(default=None, repr=False)
    #: bytes the family's results take at most (what the server's large-result slots count)
    result_bytes: int = 0
    #: chunked runs of a dense Jacobian or Hessian (see ``chunking``); None: one-shot only
    chunker: Any = field(default=None, repr=False)
    #: told (with this prep) when it compiled something more: the cache holding it
    #: measures it again (``PrepCache``, ``Service``'s handles)
    on_grow: Callable[[Prep], None] | None = field(default=None, repr=False)
    #: the framework the operator runs in (the function's, or its eager companion
    #: where it is not compiled)
    framework: Framework = field(default_factory=get_framework, repr=False)
    #: why ``resolved`` was chosen, for ``Auto``: its rule, or the modes that do not
    #: trace for this function and the one used instead (None: an explicit backend)
    reason: str | None = None

    def nbytes(self) -> int:
        """The bytes this prep keeps alive, estimated (see ``footprint``): its compiled
        executables (one-shot, chunked and batched), its engine's arrays (a sparsity
        pattern, colouring and indices) and ``PREP_BYTES`` of Python objects."""
        exes = list(self.executables.values())
        if self.chunker is not None:
            exes += self.chunker.executables()
        held = PREP_BYTES + self.compiler.held_bytes()
        for plan in list(self.batch_plans.values()):
            exes += [exe for exe in list(plan.executables.values()) if exe is not None]
            if plan.program is not None:  # the traced program and its constants
                held += EXECUTABLE_BYTES + array_bytes(plan.arrays)
        return held + sum(executable_bytes(exe) for exe in exes)

    def grew(self) -> None:
        """Tell ``on_grow`` that this prep compiled something more."""
        if self.on_grow is not None:
            self.on_grow(self)
    #: (operator, device)s whose every executable is compiled (``compile_for``)
    warmed: set = field(default_factory=set, repr=False)
    #: operator -> ``Ready``: its executable called straight, once a call has run it
    ready: dict[str, Ready] = field(default_factory=dict, repr=False)

    @property
    def report(self) -> dict[str, Any]:
        """What preparation found beyond the backend: for ``Auto``, ``{"reason": why
        ``resolved`` was chosen}``; for a sparse backend ``{"sparsity": {"shape", "nnz",
        "colors", "coloring", "mode", ...}}``; else ``{}``."""
        found = self.compiler.report()
        return found if self.reason is None else {**found, "reason": self.reason}

    def holds(self, operator: str, device: Any) -> bool:
        """Is ``operator`` compiled for ``device`` (``None``: the unpinned default)?"""
        return (operator, self._bound(device)) in self.executables

    def _bound(self, device: Any) -> Any:
        """The key ``device``'s executables are kept under (one for all devices where
        the framework's executables are not bound to one: ``Framework.per_device``)."""
        return device if getattr(self.framework, "per_device", True) else None

    @property
    def family(self) -> str:
        return OPERATORS[self.operator].family

    @property
    def has_aux(self) -> bool:
        """Prepared for a function returning ``(output, aux)`` (aux returned last)."""
        return self.signature.has_aux

    def results(self, operator: str) -> tuple[str, ...]:
        """What ``run`` returns for ``operator``: its results, then ``AUX`` with has_aux."""
        return result_names(OPERATORS[operator], self.signature.has_aux)

    def check(self, family: str, f: Callable, backend: Backend, signature: Signature) -> None:
        if family != self.family:
            raise PreparationMismatchError(
                f"prep was made for {self.operator}, not a {family} operator", field="prep"
            )
        if f is not self.function:
            made, given = (
                (g.f, g.wrt) if isinstance(g, Selected) else (g, None) for g in (self.function, f)
            )
            if made[0] is given[0]:  # the same function, differentiated in other arguments
                raise PreparationMismatchError(
                    f"prep was made with wrt={made[1]!r}, not wrt={given[1]!r}", field="wrt"
                )
            raise PreparationMismatchError("prep was made for another function", field="function")
        if backend != self.backend:
            raise PreparationMismatchError(
                f"prep was made for backend {self.backend.to_json()}, not {backend.to_json()}",
                field="backend",
            )
        diff = signature.difference(self.signature)
        if diff is not None:
            raise PreparationMismatchError(diff[1], field=diff[0])

    def executable(self, operator: str, x: Tree, tangents: tuple | None, contexts: tuple) -> Callable:
        """The executable for ``operator`` on the current default device (compiled on
        first use there: a compiled executable is bound to the device it was built for)."""
        key = (operator, self.framework.device())
        exe = self.executables.get(key)
        if exe is None:
            exe = self.executables[key] = self._compile(operator, x, tangents, contexts)
            self.grew()
        return exe

    def head(self, operator: str, results: tuple[str, ...], x: Tree, tangents: tuple | None,
             contexts: tuple) -> Callable:
        """An executable of some of ``operator``'s ``results`` only (a chunked run's value
        and gradient: XLA drops the rest of the program)."""
        key = (("head", operator, results), self.framework.device())
        exe = self.executables.get(key)
        if exe is None:
            exe = self.executables[key] = self._compile(operator, x, tangents, contexts, results)
            self.grew()
        return exe

    def _compile(
        self, operator: str, x: Tree, tangents: tuple | None, contexts: tuple,
        only: tuple[str, ...] | None = None, chunk: bool = False,
    ) -> Callable:
        """Keep only ``operator``'s results (so XLA drops the rest) and compile for these
        inputs; the executable persists across restarts when that cache is configured.
        ``chunk``: for a chunk of a batch (``chunking.Slicer``), checked as one call."""
        results = self.results(operator) if only is None else only
        if not self.traced:
            return self._packed(self._run(results), results, tangents)
        batch_axis = self.signature.batch_axis
        program, args, batched, one = self._program(results, tangents, chunk or only is not None)
        key = self.framework.executable_key(
            self.function, self.resolved, results, x, args, contexts, batch_axis,
        )
        start = time.perf_counter()
        try:
            compiled = self.compiler.compile(program, (x, args, contexts), key)
            exe = (packing.Single(compiled, batched) if one
                   else self._packed(compiled, results, tangents))
        except DxError:
            raise
        except Exception as exc:
            raise out_of_memory(exc) or FunctionEvaluationError(
                _short(exc), field="function"
            ) from exc
        seconds = time.perf_counter() - start
        function = getattr(self.function, "__name__", type(self.function).__name__)
        _log.info(
            "compiled %s of %s (%s) in %.3f s", operator, function, self.resolved.to_json(),
            seconds, extra={"event": "compile", "operator": operator, "function": function,
                            "backend": self.resolved.to_json(), "seconds": round(seconds, 6)},
        )
        if only is not None:  # a chunked run's head: small, and run with the chunks
            return exe
        if not chunk and self.chunker is not None and not self.chunker.fits(operator, exe):
            # too large for one call: runs in chunks, each checked; the work is the same
            if self.limits is not None:
                replace(self.limits, max_memory_bytes=None, max_seconds=None).check(
                    exe, operator, self.framework
                )
            return exe
        if self.limits is not None:  # once per executable, before it ever runs
            self.limits.check(exe, operator, self.framework)
        return exe

    def _run(self, results: tuple[str, ...]) -> Callable:
        """The builder's function returning the tuple of ``results``."""
        build = self.build

        def run(x, tangents, contexts):
            out = build(x, tangents, contexts)
            return tuple(out[name] for name in results)

        return run

    def _program(
        self, results: tuple[str, ...], tangents: tuple | None, packed: bool = False
    ) -> tuple[Callable, Any, tuple[int, ...], bool]:
        """``(program, the tangents as it takes them, where its per-tangent results are,
        one)``: what is compiled for ``results``. One tangent (unless ``packed``) is
        passed and answered as it is, nothing stacked or cut (``one``); else the tangents
        are stacked, one argument per leaf, so compile time does not depend on k."""
        run = self._run(results)
        batch_axis = self.signature.batch_axis
        batched = tuple(i for i, name in enumerate(results) if name in BATCH_RESULTS)
        if tangents is not None and len(tangents) == 1 and not packed:
            return packing.single(run, batched, batch_axis), tangents[0], batched, True
        return run, packing.pack(tangents, batch_axis), batched, False

    def lowered(self, operator: str, x: Any, tangents: Any, contexts: Sequence) -> Any:
        """``operator``'s program for these inputs, lowered as it is compiled and not
        compiled (JAX: a ``jax.stages.Lowered``; ``as_text()`` is its StableHLO), to read
        or compare it with hand-written code; None where the operator is not compiled."""
        lower = getattr(self.framework, "lower", None)
        if not self.traced or lower is None:
            return None
        x, tangents, contexts = normalize(x, tangents, contexts)
        program, args, _, _ = self._program(self.results(operator), tangents)
        with self.framework.precision_scope():
            return lower(program, x, args, contexts)

    def _packed(self, exe: Callable, results: tuple[str, ...], tangents: tuple | None) -> Callable:
        """``exe`` (which takes packed tangents, see ``packing``) as an executable that
        takes and returns tuples of tangents; ``exe`` itself when there are none."""
        if tangents is None:
            return exe
        batched = tuple(i for i, name in enumerate(results) if name in BATCH_RESULTS)
        return packing.Packed(exe, batched, self.signature.batch_axis)

    def pack(self, tangents: tuple | None) -> Any:
        """``tangents`` as this prep's builder takes them (see ``packing``)."""
        return packing.pack(tangents, self.signature.batch_axis)

    def unpack(self, operator: str, outputs: tuple, k: int) -> tuple:
        """``operator``'s outputs from its builder with their per-tangent results cut
        into tuples of ``k`` (see ``packing``)."""
        results = self.results(operator)
        batched = [i for i, name in enumerate(results) if name in BATCH_RESULTS]
        return packing.unpack_results(outputs, batched, k, self.signature.batch_axis)

    def warm(self, operator: str, device: Any = None) -> bool:
        """Is everything ``run`` needs for ``operator`` compiled for ``device`` (see
        ``compile_for``)?"""
        return (operator, self._bound(device)) in self.warmed

    def compile_for(
        self, operator: str, x: Tree, tangents: tuple | None, contexts: tuple
    ) -> None:
        """Compile, on the current default device, everything ``run`` needs for
        ``operator``: its executable and, for a chunked run, the chunk's and the
        head's. Then ``run`` only runs programs (the server compiles on threads of its
        own, off the device workers; see ``compiling``)."""
        device = self.framework.device()
        if (operator, device) in self.warmed:
            return
        try:
            with self.framework.precision_scope():
                self.executable(operator, x, tangents, contexts)
                chunker = self.chunker
                if chunker is not None:
                    size = chunker.size_for(operator)
                    if size is not None:
                        chunker.compile(self, operator, x, tangents, contexts, size)
        except DxError:
            raise
        except Exception as exc:
            raise out_of_memory(exc) or FunctionEvaluationError(
                _short(exc), field="function"
            ) from exc
        self.warmed.add((operator, device))

    def chunked(self, operator: str) -> bool:
        """Does ``operator`` run in chunks here (see ``chunking``)? Known once its
        one-shot executable has been compiled."""
        return self.chunker is not None and self.chunker.size_for(operator) is not None

    def run(
        self, operator: str, x: Tree, tangents: tuple | None, contexts: tuple,
        job: Job | None = None,
    ) -> tuple:
        """The results of ``operator``, in ``self.results(operator)`` order.

        ``job``: told the progress of a chunked run, and checked between its chunks
        (``JobCancelled`` once cancelled)."""
        try:
            with self.framework.precision_scope():
                exe = self.executable(operator, x, tangents, contexts)
                chunker = self.chunker
                if chunker is not None:
                    size = chunker.size_for(operator)
                    if size is not None:
                        compiled = len(chunker.executables())
                        try:
                            return chunker.run(self, operator, x, tangents, contexts, size, job)
                        finally:
                            if len(chunker.executables()) != compiled:
                                self.grew()
                return exe(x, tangents, contexts)
        except (DxError, JobCancelled):
            raise
        except Exception as exc:
            # out of memory, or a black-box function failing on these values
            raise out_of_memory(exc) or FunctionEvaluationError(
                _short(exc), field="function"
            ) from exc


def out_of_memory(exc: BaseException) -> OverloadedError | None:
    """``exc`` as a 503 if it says the device (XLA's ``RESOURCE_EXHAUSTED``) or the host
    (``MemoryError``) ran out of memory, else None: the same request may fit later.

    Wherever a device buffer is touched (running, compiling, copying a result to the
    host, a batch), its out-of-memory error goes through here.
    """
    if not isinstance(exc, MemoryError) and "RESOURCE_EXHAUSTED" not in str(exc):
        return None
    return OverloadedError(
        f"the device ran out of memory ({_short(exc)}); retry later or send less",
        field="x", retry_after=5,
    )


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    if len(text) > 1 and text[0].endswith("Traceback (most recent call last):"):
        # raised in a host callback (a piece computed outside JAX, DifferentiateWith):
        # the traceback's last line says what failed
        return f"{type(exc).__name__} in a callback: {text[-1].strip()}"[:500]
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


def probe(
    f: Callable, x: Tree, contexts: tuple, framework: Framework | None = None
) -> tuple[bool, Tree]:
    """``(traced, output spec)``: can ``f``'s framework trace ``f``, and what does it
    return (``Framework.probe``; errors of ``f`` as ``FunctionEvaluationError``)."""
    framework = framework or framework_of(f)
    check_contexts(f, contexts)  # a missing context is named, not blamed on x
    try:
        return framework.probe(f, x, contexts)
    except DxError:
        raise
    except Exception as exc:
        raise FunctionEvaluationError(_short(exc), field="x") from exc


def tree_size(framework: Framework, tree: Tree) -> int:
    """Elements in ``tree``'s leaves, summed."""
    # Python ints (math.prod), not numpy's int64: a shape's product cannot overflow
    return sum(math.prod(np.shape(v)) for v in framework.leaves(tree))


def _extent(framework: Framework, tree: Tree) -> int:
    """Elements ``tree`` would hold if its zero dimensions were ones: a zero-size array
    with huge other dimensions holds nothing, but XLA still lays out its shape."""
    return sum(math.prod(d or 1 for d in np.shape(v)) for v in framework.leaves(tree))


#: Bytes a prep's Python objects take beside its executables and arrays (its signature,
#: output spec, closures and report), counted once per prep.
PREP_BYTES = 16 * 1024

#: Largest number of result elements one call may produce by default: a Jacobian or
#: Hessian grows with n², and an out-of-memory device is worse than a clear 422.
MAX_RESULT_ELEMENTS = 2**27


def _check_result_size(
    family: str, inputs: Inputs, limit: int, engine: Engine | None = None, points: int = 1,
    aux: Tree = None,
) -> int:
    """The number of results ``family`` returns here (``ResultTooLargeError`` past ``limit``).

    ``engine`` may count them itself (a sparse Jacobian holds nnz numbers, not m * n).
    ``inputs`` are one point's; ``points`` of them are computed (a batch counts whole).
    ``aux``: the spec of a has_aux function's auxiliary output, returned too."""
    n, m = tree_size(inputs.framework, inputs.x), tree_size(inputs.framework, inputs.y)
    k = len(inputs.tangents or ())
    counted = engine.result_elements(family, n, m, k) if engine is not None else None
    elements = OPERATORS[family].result_elements(n, m, k) if counted is None else counted
    # The same rule over the nominal sizes (zero dimensions as ones), so zero-size
    # inputs with huge dimensions are refused here, before XLA lays out their shapes.
    extent = elements if counted is not None else OPERATORS[family].result_elements(
        _extent(inputs.framework, inputs.x), _extent(inputs.framework, inputs.y), k
    )
    if aux is not None:
        elements += tree_size(inputs.framework, aux)
        extent += _extent(inputs.framework, aux)
    elements, extent = elements * points, extent * points
    if points > 1 and elements > limit:
        raise ResultTooLargeError(
            f"{family} of a batch of {points:,} points (batch_axis=0) would return "
            f"{elements:,} numbers ({elements // points:,} per point), over the limit of "
            f"{limit:,}; send at most {max(1, limit // max(1, elements // points)):,} points "
            "per request, or raise DXSERVE_MAX_RESULT_ELEMENTS",
            field="x",
        )
    if elements <= limit < extent:
        raise ResultTooLargeError(
            f"{family} here would return zero-size arrays whose other dimensions span "
            f"{extent:,} elements, over the limit of {limit:,}",
            field="x",
        )
    if elements > limit:
        raise ResultTooLargeError(
            f"{family} here would return {elements:,} numbers, over the limit of "
            f"{limit:,}; use pushforward/pullback/hvp on fewer tangents, "
            "or raise DXSERVE_MAX_RESULT_ELEMENTS",
            field="x",
        )
    return elements


def prepare(
    operator: str,
    f: Callable,
    backend: Backend | str,
    x: Any,
    tangents: Sequence | None,
    contexts: Sequence,
    cache: PrepCache | None = None,
    max_result_elements: int | None = None,
    limits: ComputeLimits | None = None,
    batch_axis: int | None = None,
    has_aux: bool = False,
    wrt: Any = None,
    cotangent: Any = None,
) -> Prep:
    """Probe, resolve, validate, build and compile ``operator`` for these inputs.

    With a ``cache``, backends that resolve to the same concrete one (``"auto"``
    and ``SecondOrder(JaxForward(), JaxReverse())`` for an HVP, say) share one
    compiled executable. Float64 inputs trace and compile in float64.
    ``max_result_elements`` defaults to ``MAX_RESULT_ELEMENTS``. ``limits``: per-request
    bounds on XLA's estimate of each compiled executable (None: unbounded, the library's
    default; the server passes its settings). ``batch_axis=0``: x's leaves and the
    tangents' lead with an axis of B points, results come back stacked as (B, ...).
    ``has_aux``: f returns ``(output, aux)``; ``output`` is differentiated and aux
    returned as the last result. ``wrt``: the arguments differentiated (``dxserve.core.wrt``;
    None: x); the prep is made for their ``Selected`` function, which later calls with
    the same ``wrt`` find again.
    """
    if wrt is not None:
        f, x, contexts = select(f, x, contexts, wrt)
    if cotangent is not None:  # the HVP family: <cotangent, f> (see ``wrt``)
        refuse_cotangent(operator, has_aux)
        f, contexts = with_cotangent(f, x, contexts, cotangent)
    if max_result_elements is None:
        max_result_elements = MAX_RESULT_ELEMENTS
    backend = backend_from_json(backend)  # parsed here, once: below it is a descriptor
    with framework_of(f).precision_scope():
        return _prepare(
            operator, f, backend, x, tangents, contexts, cache, max_result_elements, limits,
            batch_axis, has_aux,
        )


def _prepare(
    operator: str, f: Callable, backend: Backend, x: Any, tangents: Sequence | None,
    contexts: Sequence, cache: PrepCache | None, max_result_elements: int,
    limits: ComputeLimits | None = None, batch_axis: int | None = None,
    has_aux: bool = False,
) -> Prep:
    family = OPERATORS[operator].family
    fw = framework_of(f)
    x, tangents, contexts = normalize(x, tangents, contexts)
    points, px, pt = 1, x, tangents  # one point's x and tangents: what is checked and built
    if batch_axis is not None:
        check_batch_axis(batch_axis)
        points = batch_points(x, tangents, fw)
        px = _first_point(fw, x)
        pt = None if tangents is None else tuple(_first_point(fw, t) for t in tangents)
    traced, y = probe(f, px, contexts, fw)
    aux, output = None, f  # output: the function the family differentiates
    if has_aux:
        refuse_aux(operator)
        y, aux = split_aux(f, y)
        output = primary(f)
    n, m = tree_size(fw, px), tree_size(fw, y)
    choices = candidates(backend, family, traced=traced, n=n, m=m, framework=fw.name)
    failed: list[tuple[Backend, str]] = []  # Auto's choices whose transformation failed
    for i, resolved in enumerate(choices):
        reason = (
            _auto_reason(family, traced, n, m, failed, resolved, fw.name)
            if isinstance(backend, Auto) else None
        )
        try:
            prep = _prepare_with(
                resolved, operator, f, backend, x, tangents, contexts, cache,
                max_result_elements, limits, batch_axis, traced, points, px, pt, y, reason,
                has_aux, aux, output,
            )
        except _TransformFailed as failure:
            exc = failure.error
            if len(choices) == 1 and traced and resolved.type != "sparse":
                named = _cannot(exc, backend, resolved, f, family, px, pt, contexts, y, fw)
                if named is not exc:
                    raise named from exc
            if len(choices) == 1 or i == len(choices) - 1:
                raise exc from exc.__cause__  # as compiling raised it, from JAX's error
            failed.append((resolved, _why(exc)))
            continue
        if failed:
            _log.info(
                "auto for %s of %s: %s", operator, _name(f), reason,
                extra={"event": "auto_fallback", "operator": operator, "function": _name(f),
                       "backend": resolved.to_json()},
            )
        return prep
    raise AssertionError("unreachable: the last choice returns or raises")


def _prepare_with(
    resolved: Backend, operator: str, f: Callable, backend: Backend, x: Tree,
    tangents: tuple | None, contexts: tuple, cache: PrepCache | None, max_result_elements: int,
    limits: ComputeLimits | None, batch_axis: int | None, traced: bool, points: int,
    px: Tree, pt: tuple | None, y: Tree, reason: str | None,
    has_aux: bool = False, aux: Tree = None, output: Callable | None = None,
) -> Prep:
    """``_prepare`` with the concrete backend ``resolved``: check, build and compile
    (``_TransformFailed`` when compiling fails); ``reason``: why it was chosen. With
    ``has_aux``, ``output`` is the function differentiated and ``aux`` its aux's spec."""
    output = f if output is None else output
    family = OPERATORS[operator].family
    fw = framework_of(f)
    if batch_axis is not None and (family == "sparsity" or resolved.type == "sparse"):
        raise InvalidArgumentError(
            f"batch_axis is not supported for sparse {family} (a sparse result per point); "
            "send the points one by one or use a dense backend",
            field="batch_axis",
        )
    if has_aux and resolved.type == "sparse":
        raise UnsupportedOperatorError(
            f"has_aux is not supported with a sparse {family}: the pattern is detected on "
            "the registered function itself, whose output here is a pair; use a dense "
            "backend, or take the aux from value with has_aux",
            field="has_aux",
        )
    # complex x or f(x): every engine in JAX's convention (or refusing)
    engine, inner = engines_for(resolved, traced=traced, complex_numbers=has_complex(fw, px, y))
    engine.use(fw)
    if inner is not None:
        inner.use(fw)
    spec = FAMILIES[family]
    inputs = Inputs(px, pt, contexts, y, fw, holomorphic.is_declared(f))
    spec.check(inputs)
    refuse_low_precision(resolved, fw.leaves(px), traced=traced)
    engine.prepare(family, output, inputs, limits)  # e.g. sparsity detection and colouring
    elements = _check_result_size(family, inputs, max_result_elements, engine, points, aux)
    signature = _signature_of(x, tangents, contexts, batch_axis, has_aux)
    twin_key = (f, operator, resolved, signature)
    twin = cache.get_resolved(twin_key) if cache is not None else None
    if twin is not None:
        return replace(twin, backend=backend, reason=reason, ready={})
    compiled = traced and engine.traces and (inner is None or inner.traces)
    runs_in = fw if compiled else fw.eager()
    build = spec.build(output, engine, inner, inputs)
    if has_aux:
        build = with_aux(build, f)
    if batch_axis is not None:
        build = over_points(build, tangents is not None, runs_in)
        y = fw.tree_map(lambda s: fw.spec((points, *s.shape), s.dtype), y)
    chunker = chunker_for(
        family, output, engine, inner, px, inputs.y, compiled, batch_axis is not None, limits,
        runs_in,
    ) or slicer_for(
        family, compiled, batch_axis is not None, points, len(tangents or ()), limits, runs_in
    )
    prep = Prep(
        operator, f, backend, resolved, signature, y, build,
        engine, compiled, limits=limits, result_bytes=elements * _itemsize(fw, x),
        chunker=chunker, framework=runs_in, reason=reason,
    )
    try:
        prep.executable(operator, x, tangents, contexts)
    except ComplexRefused:
        raise  # the backend's answer to complex numbers: no other mode is tried or named
    except (FunctionEvaluationError, UnsupportedOperatorError) as exc:
        raise _TransformFailed(exc) from exc  # the transformation failed, not the checks
    if cache is not None:
        cache.put_resolved(twin_key, prep)
    return prep


# --- when a mode does not trace ---------------------------------------------
class _TransformFailed(Exception):
    """Compiling the operator failed (``error``): the backend's transformation of the
    function, not the checks of its inputs."""

    def __init__(self, error: DxError) -> None:
        super().__init__(error)
        self.error = error


def _why(exc: BaseException, limit: int = 300) -> str:
    """The reason of a failed transformation, at most ``limit`` characters."""
    text = (exc.detail if isinstance(exc, DxError) else _short(exc)).strip().rstrip(".")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _name(f: Callable) -> str:
    return getattr(f, "__name__", type(f).__name__)


def _auto_reason(
    family: str, traced: bool, n: int, m: int, failed: list[tuple[Backend, str]],
    chosen: Backend, framework: str,
) -> str:
    """What ``Auto`` chose for ``family`` and why: its rule, or the modes that do not
    trace for this function and the one it uses instead."""
    if not failed:
        return auto_rule(family, traced=traced, n=n, m=m, framework=framework)
    grouped: list[tuple[list[str], str]] = []  # modes failing for one reason, together
    for choice, why in failed:
        if grouped and grouped[-1][1] == why:
            grouped[-1][0].append(mode_name(choice))
        else:
            grouped.append(([mode_name(choice)], why))
    skipped = "; ".join(
        f"{' and '.join(modes)} {'do' if len(modes) > 1 else 'does'} not trace: {why}"
        for modes, why in grouped
    )
    using = mode_name(chosen) if isinstance(chosen, SecondOrder) else backend_name(chosen)
    return f"{skipped}; using {using}"


def trace_error(
    f: Callable, backend: Backend, family: str, x: Tree, tangents: tuple | None,
    contexts: tuple, y: Tree, framework: Framework,
) -> str | None:
    """Why ``family`` of ``f`` does not trace with the concrete ``backend`` at these
    (one point's) inputs, or None when it does: the operator is built as preparation
    compiles it and lowered (``Framework.lower`` where the framework has one, else
    ``eval_shape``), nothing compiled or run. Lowered, not only traced: some refusals
    come at lowering (JAX's forward mode through a ``custom_vjp`` without a batch axis)."""
    try:
        engine, inner = engines_for(
            backend, traced=True, complex_numbers=has_complex(framework, x, y)
        )
        engine.use(framework)
        if inner is not None:
            inner.use(framework)
        run = FAMILIES[family].build(f, engine, inner, Inputs(x, tangents, contexts, y, framework))
        if tangents is not None and len(tangents) == 1:  # as ``Prep._compile`` builds it
            results = OPERATORS[family].results
            batched = tuple(i for i, name in enumerate(results) if name in BATCH_RESULTS)
            program = packing.single(_all_results(run, results), batched, None)
            args = (x, tangents[0], contexts)
        else:
            program, args = run, (x, packing.pack(tangents), contexts)
        lower = getattr(framework, "lower", None)
        (lower or framework.eval_shape)(program, *args)
    except Exception as exc:  # noqa: BLE001 - any failure is the reason
        return _why(exc)
    return None


def _all_results(run: Callable, results: tuple[str, ...]) -> Callable:
    """``run`` returning the tuple of ``results`` (what ``packing.single`` takes)."""

    def ordered(x: Tree, tangents: Tree, contexts: tuple) -> tuple:
        out = run(x, tangents, contexts)
        return tuple(out[name] for name in results)

    return ordered


def _cannot(
    exc: DxError, backend: Backend, resolved: Backend, f: Callable, family: str, x: Tree,
    tangents: tuple | None, contexts: tuple, y: Tree, framework: Framework,
) -> DxError:
    """The error for an explicit backend whose transformation of ``f`` failed: naming
    the backend, and the backend ``Auto`` would use instead where one traces."""
    n, m = tree_size(framework, x), tree_size(framework, y)
    other = None
    for choice in auto_candidates(family, traced=True, n=n, m=m, framework=framework.name):
        if choice != resolved and trace_error(
            f, choice, family, x, tangents, contexts, y, framework
        ) is None:
            other = choice
            break
    if other is None:
        return exc
    asked = backend_name(backend)
    as_ = "" if backend == resolved else f" (as {backend_name(resolved)})"
    mode = f" ({mode_name(other)})" if isinstance(other, SecondOrder) else ""
    return UnsupportedOperatorError(
        f"{asked}{as_} cannot compute {family} of {_name(f)} here, {mode_name(resolved)} "
        f"does not trace: {_why(exc, 1000)}. Use '{backend_name(other)}'{mode}, or 'auto', "
        "which picks it",
        field="backend",
    )


# --- many points in one call ------------------------------------------------
def check_batch_axis(batch_axis: Any) -> None:
    """Refuse a ``batch_axis`` other than None or 0 (``InvalidArgumentError`` naming it)."""
    if batch_axis is None or (type(batch_axis) is int and batch_axis == 0):
        return
    raise InvalidArgumentError(
        f"batch_axis must be 0 (x and the tangents lead with an axis of points) or null "
        f"(one point), got {batch_axis!r}",
        field="batch_axis",
    )


def batch_points(x: Tree, tangents: tuple | None, framework: Framework | None = None) -> int:
    """B, the leading dimension every leaf of x and of each tangent must share."""
    framework = framework or get_framework()
    points = None
    for leaf in framework.leaves(x):
        shape = np.shape(leaf)
        if not shape:
            raise ShapeMismatchError(
                "batch_axis=0 needs every leaf of x to lead with an axis of points; "
                "got a scalar",
                field="x",
            )
        if points is None:
            points = shape[0]
        elif shape[0] != points:
            raise ShapeMismatchError(
                f"batch_axis=0: the leaves of x disagree on the number of points "
                f"({points} and {shape[0]})",
                field="x",
            )
    if points is None:
        raise ShapeMismatchError("batch_axis=0 needs x to hold an array", field="x")
    if points == 0:
        raise ShapeMismatchError("batch_axis=0 with no points in x; send at least one", field="x")
    for i, t in enumerate(tangents or ()):
        for leaf in framework.leaves(t):
            shape = np.shape(leaf)
            if not shape or shape[0] != points:
                got = f"{shape[0]} points" if shape else "no axis of points"
                raise ShapeMismatchError(
                    f"batch_axis=0: tangents[{i}] has {got} where x has {points}; with a "
                    "batch every tangent leads with the same axis of points as x",
                    field=f"tangents[{i}]",
                )
    return points


def _first_point(framework: Framework, tree: Tree) -> Tree:
    """The first point of a batched pytree (a view for numpy leaves)."""
    return framework.tree_map(lambda v: v[0, ...], tree)


def over_points(run: Callable, batched_tangents: bool, framework: Framework) -> Callable:
    """``run(x, tangents, contexts) -> dict`` over a leading axis of points on x (and the
    tangents), results stacked on that axis, contexts shared: ``framework.vmap`` (for
    JAX one XLA program; for an eager framework a loop, point by point)."""
    return framework.vmap(run, in_axes=(0, 0 if batched_tangents else None, None))


# --- auxiliary outputs (has_aux) -----------------------------------------------
def refuse_aux(operator: str) -> None:
    """``UnsupportedOperatorError`` (field ``has_aux``) for an operator without aux."""
    if not OPERATORS[operator].aux:
        raise UnsupportedOperatorError(
            f"{operator} takes no has_aux: it returns a pattern, no values to return aux "
            "beside; call it without has_aux, on a function returning its output alone",
            field="has_aux",
        )


def split_aux(f: Callable, y: Tree) -> tuple[Tree, Tree]:
    """``(output, aux)``: the probed output of a has_aux function, which must be a pair
    (a tuple or list of two, as JAX's ``has_aux`` takes); ``ShapeMismatchError``
    (field ``function``) naming the function and the fix otherwise."""
    if isinstance(y, tuple | list) and len(y) == 2:
        return y[0], y[1]
    if isinstance(y, tuple | list):
        got = f"a {type(y).__name__} of {len(y)}"
    elif hasattr(y, "shape"):
        got = f"an array of shape {tuple(y.shape)}"
    else:
        got = f"a {type(y).__name__}"
    name = function_name(f)
    raise ShapeMismatchError(
        f"has_aux needs {name} to return a pair (output, aux), but it returns {got}; "
        f"return a tuple (output, aux) from {name}, or call it without has_aux ({FIX})",
        field="function", fix={"has_aux": False},
    )


def function_name(f: Callable) -> str:
    """How messages name ``f``: its registered or Python name, an expression's text."""
    info = getattr(f, "__dxserve__", None)
    name = getattr(info, "name", None) or getattr(f, "__name__", None)
    if isinstance(name, str) and name != "<lambda>":
        return f"the function {name!r}"
    source = getattr(f, "source", None)
    if isinstance(source, str):
        return f"the expression {source[:80]!r}"
    return "the function"


def primary(f: Callable) -> Callable:
    """``f``'s output without its aux: what a has_aux operator differentiates."""

    def output(x: Tree, *contexts: Any) -> Tree:
        return f(x, *contexts)[0]

    return output


def with_aux(run: Callable, f: Callable) -> Callable:
    """``run`` (a family's builder output) with ``AUX``, f's aux at x, added to its
    results: computed at the primal point alone, never differentiated."""

    def run_with_aux(x: Tree, tangents: Any, contexts: tuple) -> dict:
        return {**run(x, tangents, contexts), AUX: f(x, *contexts)[1]}

    return run_with_aux


def _itemsize(framework: Framework, tree: Tree) -> int:
    """Bytes per result element: results take the input's dtype (8 if that is unknown)."""
    sizes = [getattr(getattr(v, "dtype", None), "itemsize", 8) for v in framework.leaves(tree)]
    return max(sizes, default=8)


def normalize(x: Any, tangents: Sequence | None, contexts: Sequence) -> tuple:
    """``(x, tangents, contexts)`` as operators take them (see ``as_tree``)."""
    x = as_tree(x)
    if tangents is not None:
        if not isinstance(tangents, (tuple, list)):
            raise ShapeMismatchError(
                "tangents must be a tuple (a batch) of tangents, e.g. (t,)", field="tangents"
            )
        tangents = tuple(as_tree(t) for t in tangents)
    return x, tangents, tuple(as_tree(c) for c in contexts)


# --- the HVP of <cotangent, f> (second order of array-valued functions) -------
def with_cotangent(
    f: Callable, x: Any, contexts: Sequence[Any], cotangent: Any
) -> tuple[Callable, tuple]:
    """``(<cotangent, f>, contexts)`` for an HVP family operator given ``cotangent``
    (shaped like f's output): its gradient is f's pullback of it, its HVP the
    derivative of that pullback. ``ShapeMismatchError`` (field ``cotangent``) when the
    cotangent is not shaped like f's output."""
    contexts = tuple(contexts)
    cotangent = as_tree(cotangent)
    fw = framework_of(f)
    for leaf in fw.leaves(cotangent):  # numbers only: a key (or text) is no cotangent
        dtype = str(getattr(leaf, "dtype", "object")).removeprefix("torch.")
        try:
            numeric = not dtype.startswith("key<") and dtypes.is_inexact(dtype)
        except TypeError:
            numeric = False
        if not numeric:
            raise DtypeMismatchError(
                f"cotangent must hold floating-point arrays shaped like the function's "
                f"output, got dtype {dtype}",
                field="cotangent",
            )
    _, y = probe(f, as_tree(x), tuple(as_tree(c) for c in contexts), fw)
    got, want = fw.flatten(cotangent), fw.flatten(y)
    if got[1] != want[1] or any(
        tuple(np.shape(a)) != tuple(b.shape) for a, b in zip(got[0], want[0], strict=True)
    ):
        shapes = [tuple(b.shape) for b in want[0]]
        raise ShapeMismatchError(
            f"cotangent must be shaped like the function's output ({want[1]}, shapes "
            f"{shapes}), got {got[1]} with shapes {[tuple(np.shape(a)) for a in got[0]]}",
            field="cotangent",
        )
    return dotted(f), (cotangent, *contexts)


# --- implicit cache and the call path -------------------------------------
class PrepCache:
    """Preps keyed by (function, operator, backend, signature): an LRU of at most
    ``maxsize`` preps and, with ``max_bytes``, at most that many bytes of them
    (``Prep.nbytes``, measured again whenever a prep compiles more). A prep larger than
    ``max_bytes`` alone serves the request that made it and is not kept.

    Beside the requested backend's key, a prep is indexed weakly under its concrete
    backend, so backends that resolve alike share one compiled executable for as long
    as a prep of theirs is cached (or held by a caller); each such twin is counted in
    full (its shared executables twice: the bound holds). ``on_evict(nbytes)`` is told
    of each prep evicted to make room.
    """

    def __init__(
        self, maxsize: int = 512, max_bytes: int | None = None,
        on_evict: Callable[[int], None] | None = None,
    ) -> None:
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self._items: LRU[tuple, Prep] = LRU(
            maxsize, max_bytes, Prep.nbytes,
            None if on_evict is None else lambda _key, _prep, size: on_evict(size),
        )
        self._resolved: weakref.WeakValueDictionary[tuple, Prep] = weakref.WeakValueDictionary()

    @property
    def nbytes(self) -> int:
        """The bytes the cached preps keep alive, as last measured."""
        return self._items.nbytes

    @property
    def hits(self) -> int:
        return self._items.hits

    @property
    def misses(self) -> int:
        return self._items.misses

    def get(self, key: tuple) -> Prep | None:
        return self._items.get(key)

    def peek(self, key: tuple) -> Prep | None:
        """``get`` without counting a hit or a miss."""
        return self._items.peek(key)

    def put(self, key: tuple, prep: Prep) -> bool:
        """Keep ``prep`` under ``key``; False if it alone is over ``max_bytes`` (not kept)."""
        prep.on_grow = self._grew
        kept = self._items.put(key, prep)
        if kept:  # indexed for its twins, unless a live prep of that backend is already
            twin_key = (prep.function, prep.operator, prep.resolved, prep.signature)
            self._resolved.setdefault(twin_key, prep)
        return kept

    def get_resolved(self, key: tuple) -> Prep | None:
        return self._resolved.get(key)

    def put_resolved(self, key: tuple, prep: Prep) -> None:
        self._resolved[key] = prep

    def clear(self) -> None:
        self._items.clear()
        self._resolved.clear()

    def forget(self, function: Callable) -> None:
        """Drop the preps of ``function``, and of its ``wrt`` and cotangent wrappers."""
        self._items.discard_where(lambda key, _: made_for(key[0], function))
        for key in [k for k in list(self._resolved.keys()) if made_for(k[0], function)]:
            self._resolved.pop(key, None)

    def _grew(self, prep: Prep) -> None:
        # twins share their executables: each is measured again
        self._items.remeasure(lambda _, cached: cached.executables is prep.executables)

    def __len__(self) -> int:
        return len(self._items)


CACHE = PrepCache()


def made_for(f: Callable, function: Callable) -> bool:
    """Is ``f`` ``function``, or a ``Selected``/``Dotted`` wrapper of it?"""
    while f is not function and isinstance(f, Selected | Dotted):
        f = f.f
    return f is function


@dataclass(slots=True)  # made per request: a frozen dataclass's __init__ costs ~2 us more
class Lookup:
    """A call with its inputs normalized and its prep found (``None``: not prepared yet)."""

    operator: str
    function: Callable
    backend: Backend
    x: Tree
    tangents: tuple | None
    contexts: tuple
    prep: Prep | None
    key: tuple
    batch_axis: int | None = None
    has_aux: bool = False

    @property
    def inputs(self) -> tuple:
        return self.x, self.tangents, self.contexts

    def prepare(
        self, cache: PrepCache, max_result_elements: int | None = None,
        limits: ComputeLimits | None = None,
    ) -> Prep:
        """Trace and compile for this call (the slow path) and keep the prep in ``cache``.

        Requests for a new signature that arrive together are all looked up before the
        first one compiles; the later ones find its prep here instead of compiling again.
        """
        prep = cache.peek(self.key)
        if prep is None:
            prep = prepare(
                self.operator, self.function, self.backend, self.x, self.tangents,
                self.contexts, cache, max_result_elements, limits, self.batch_axis,
                self.has_aux,
            )
            cache.put(self.key, prep)
        return prep


def lookup(
    operator: str,
    f: Callable,
    backend: Backend,
    x: Any,
    tangents: Sequence | None,
    contexts: Sequence,
    prep: Prep | None = None,
    cache: PrepCache = CACHE,
    signature: Signature | None = None,
    batch_axis: int | None = None,
    has_aux: bool = False,
) -> Lookup:
    """Normalize the inputs and find the prep that runs them: ``prep`` if given
    (checked against the call), else the cached one, else none yet.

    ``signature``: the inputs' signature if the caller already knows it (the server
    does for a repeated request), saving its computation. ``batch_axis``: 0 for a
    batch of points (checked here; the points themselves at preparation). ``has_aux``:
    f returns ``(output, aux)`` (see ``prepare``)."""
    op = OPERATORS[operator]
    x, tangents, contexts = normalize(x, tangents, contexts)
    if batch_axis is not None:
        check_batch_axis(batch_axis)
    if signature is None:
        signature = _signature_of(x, tangents, contexts, batch_axis, has_aux)
    key = (f, op.name, backend, signature)
    if prep is not None:
        prep.check(op.family, f, backend, signature)
    else:
        prep = cache.get(key)
    return Lookup(
        op.name, f, backend, x, tangents, contexts, prep, key, batch_axis, signature.has_aux
    )


def call(
    operator: str,
    f: Callable,
    backend: Backend | str,
    x: Any,
    tangents: Sequence | None,
    contexts: Sequence,
    prep: Prep | None = None,
    cache: PrepCache = CACHE,
    batch_axis: int | None = None,
    has_aux: bool = False,
) -> Any:
    """Run ``operator``; return its result, or a tuple of results (DI's order).

    ``batch_axis=0``: x (and the tangents) hold B points; each result is stacked (B, ...).
    ``has_aux``: f returns ``(output, aux)``; JAX's shapes (``dxcontract.operators.returned``):
    ``((value, aux), *others)``, or ``(results, aux)`` for an operator without a value."""
    backend = backend_from_json(backend)  # parsed here, once: below it is a descriptor
    with framework_of(f).precision_scope():
        found = lookup(
            operator, f, backend, x, tangents, contexts, prep, cache, batch_axis=batch_axis,
            has_aux=has_aux,
        )
        prep = found.prep or found.prepare(cache)
        out = prep.run(found.operator, *found.inputs)
        if found.prep is not None and found.operator not in prep.ready:
            Ready.make(prep, found.operator, found.inputs)
        return _finish(prep, found.operator, found.tangents, out)


def _finish(prep: Prep, operator: str, tangents: tuple | None, out: tuple) -> Any:
    """``operator``'s outputs (``prep.run``'s) as the library returns them."""
    from_host = getattr(prep.framework, "from_host", None)
    if from_host is not None:  # a framework whose programs answer on the host (torch)
        out = from_host(out)
    elif tangents is not None and prep.traced and len(tangents) > 1:
        out = _on_device(prep.framework, prep.results(operator), out)
    return returned(OPERATORS[operator], out, prep.has_aux)


#: what ``Prep.call_ready`` returns when the call needs the full path
NOT_READY = object()


class Ready:
    """A prepared operator called as a ``jax.jit`` function is: the inputs' structure,
    shapes and dtypes compared with the prep's in one pass, then its executable run
    (the framework's own dispatch takes the numpy arrays as they are).

    Made by the first call with the prep that ran the executable itself (not in
    chunks, on the framework's or numpy's arrays). A later call whose inputs are not
    exactly the prep's arrays (Python numbers or lists to normalize, another shape, a
    traced value, another device, another function or backend) gets ``NOT_READY`` and
    takes the full path, which normalizes, or raises what differs.
    """

    __slots__ = ("prep", "operator", "function", "backend", "signature", "device",
                 "device_of", "structure", "x_spec", "t_specs", "c_specs", "simple",
                 "kinds", "flatten", "precise", "exe", "finish")

    def __init__(self, prep: Prep, operator: str, inputs: tuple) -> None:
        fw = prep.framework
        self.prep, self.operator, self.function, self.backend = (
            prep, operator, prep.function, prep.backend
        )
        self.signature = prep.signature
        self.device_of = fw.device
        self.device = fw.device()
        x, tangents, contexts = inputs
        self.structure = fw.flatten(inputs)[1]
        # x, each tangent and each context one array: checked without flattening
        self.simple = all(_is_array(v) for v in (x, *(tangents or ()), *contexts))
        if self.simple:
            self.x_spec = (x.shape, x.dtype)
            self.t_specs = None if tangents is None else [(t.shape, t.dtype) for t in tangents]
            self.c_specs = [(c.shape, c.dtype) for c in contexts]
        else:
            self.x_spec = self.t_specs = None
            self.c_specs = [(v.shape, v.dtype) for v in fw.leaves(inputs)]
        self.kinds = frozenset({np.ndarray, *_SCALARS, *getattr(fw, "array_types", ())})
        self.flatten = fw.flatten
        #: says whether calls already run in the precision the prep was compiled in
        self.precise = getattr(fw, "in_precision_scope", None) or (lambda: False)
        exe = prep.executables[(operator, prep._bound(self.device))]
        self.exe, self.finish = _straight(prep, operator, exe, tangents)

    @staticmethod
    def make(prep: Prep, operator: str, inputs: tuple) -> None:
        """Keep a ``Ready`` for ``operator`` on ``prep`` where its executable runs whole."""
        fw = prep.framework
        kinds = (np.ndarray, *getattr(fw, "array_types", ()))
        if (
            prep.traced and getattr(fw, "from_host", None) is None
            and (operator, prep._bound(fw.device())) in prep.executables
            and not prep.chunked(operator)
            and all(type(v) in kinds for v in fw.leaves(inputs))
        ):
            prep.ready[operator] = Ready(prep, operator, inputs)

    def __call__(
        self, f: Callable, backend: Any, x: Any, tangents: Any, contexts: Any,
        batch_axis: int | None, has_aux: bool,
    ) -> Any:
        """``call``'s answer, or ``NOT_READY`` where this call needs the full path."""
        signature = self.signature
        if (
            f is not self.function or batch_axis != signature.batch_axis
            or has_aux != signature.has_aux or type(contexts) is not tuple
        ):
            return NOT_READY
        if backend is not self.backend and backend != self.backend and (
            backend_from_json(backend) != self.backend
        ):
            return NOT_READY
        kinds = self.kinds
        if self.simple:
            shape, dtype = self.x_spec
            if type(x) not in kinds or x.shape != shape or x.dtype != dtype:
                return NOT_READY
            specs = self.t_specs
            if specs is None:
                if tangents is not None:
                    return NOT_READY
            elif type(tangents) is not tuple or len(tangents) != len(specs):
                return NOT_READY
            else:
                for t, (shape, dtype) in zip(tangents, specs, strict=True):
                    if type(t) not in kinds or t.shape != shape or t.dtype != dtype:
                        return NOT_READY
            leaves: Any = contexts
            if len(contexts) != len(self.c_specs):
                return NOT_READY
        else:
            leaves, structure = self.flatten((x, tangents, contexts))
            if structure != self.structure:
                return NOT_READY
        for v, (shape, dtype) in zip(leaves, self.c_specs, strict=True):
            if type(v) not in kinds or v.shape != shape or v.dtype != dtype:
                return NOT_READY
        if self.device_of() is not self.device:
            return NOT_READY
        if self.precise():
            return self.finish(self.run(x, tangents, contexts))
        with self.prep.framework.precision_scope():  # results moved to the device too
            return self.finish(self.run(x, tangents, contexts))

    def run(self, x: Any, tangents: Any, contexts: tuple) -> Any:
        """The executable's outputs, its errors reported as ``Prep.run`` reports them."""
        try:
            return self.exe(x, tangents, contexts)
        except DxError:
            raise
        except Exception as exc:
            raise out_of_memory(exc) or FunctionEvaluationError(
                _short(exc), field="function"
            ) from exc


def _straight(
    prep: Prep, operator: str, exe: Callable, tangents: tuple | None
) -> tuple[Callable, Callable]:
    """``(run(x, tangents, contexts), finish(out))`` for ``Ready``: one tangent goes to
    the compiled program as it is and its results come back as 1-tuples (as
    ``packing.Single`` gives them), without the wrapper's own calls in between."""
    op, has_aux = OPERATORS[operator], prep.has_aux
    if isinstance(exe, packing.Single):
        compiled, batched = exe.executable, exe.batched
        n = len(prep.results(operator))

        def run(x: Tree, tangents: tuple, contexts: tuple) -> Any:
            return compiled(x, tangents[0], contexts)

        if n == 1 and not has_aux and batched == {0}:  # hvp, pushforward, pullback
            return run, lambda out: (out[0],)

        def finish(out: tuple) -> Any:
            return returned(op, [(o,) if i in batched else o for i, o in enumerate(out)],
                            has_aux)

        return run, finish
    if tangents is None:
        if len(op.results) == 1 and not has_aux:
            return exe, lambda out: out[0]
        return exe, lambda out: returned(op, out, has_aux)
    return exe, lambda out: _finish(prep, operator, tangents, out)


#: numpy's scalars (``np.float64(0.7)``): programs take them as 0-d arrays of their dtype
_SCALARS = (np.float64, np.float32, np.float16, np.complex128, np.complex64, np.int64,
            np.int32, np.bool_)


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(
        value, dict | list | tuple
    )


def _on_device(framework: Framework, results: tuple[str, ...], outputs: tuple) -> tuple:
    """Per-tangent results (numpy views, see ``packing``) as the framework's arrays, as
    the library returns every other result: one transfer for the whole batch."""
    return tuple(
        framework.to_device(out) if name in BATCH_RESULTS else out
        for name, out in zip(results, outputs, strict=True)
    )


def resolve(
    backend: Backend | str, operator: str, f: Callable, x: Any, *contexts: Any,
    has_aux: bool = False, explain: bool = False,
) -> Backend | tuple[Backend, str | None]:
    """The concrete descriptor ``operator`` would use (``Auto`` and DI's rule applied).
    ``has_aux``: f returns ``(output, aux)``, and output is what is weighed and traced.

    For ``Auto`` the operator is traced abstractly (nothing compiled or run) with each
    of its choices in turn until one traces (see ``selection.auto_candidates``), as
    preparation does. ``explain=True`` returns ``(descriptor, reason)``: for ``Auto``
    its rule, or the modes that do not trace and the one used instead; None for an
    explicit backend."""
    backend = backend_from_json(backend)
    op = OPERATORS[operator]
    x = as_tree(x)
    contexts = tuple(as_tree(c) for c in contexts)
    fw = framework_of(f)
    with fw.precision_scope():
        traced, y = probe(f, x, contexts, fw)
        if has_aux:
            y, f = split_aux(f, y)[0], primary(f)
        n, m = tree_size(fw, x), tree_size(fw, y)
        choices = candidates(backend, op.family, traced=traced, n=n, m=m, framework=fw.name)
        chosen, failed = choices[0], []
        if len(choices) > 1 and _checks(op.family, x, contexts, y, fw):
            tangents = _probe_tangents(op.family, x, y, fw)
            for choice in choices:
                why = None if choice is choices[-1] else trace_error(
                    f, choice, op.family, x, tangents, contexts, y, fw
                )
                if why is None:
                    chosen = choice
                    break
                failed.append((choice, why))
    if not explain:
        return chosen
    reason = (
        _auto_reason(op.family, traced, n, m, failed, chosen, fw.name)
        if isinstance(backend, Auto) else None
    )
    return chosen, reason


def _checks(family: str, x: Tree, contexts: tuple, y: Tree, framework: Framework) -> bool:
    """Do these inputs pass ``family``'s checks (with one tangent)? ``resolve`` traces
    only an operator that preparation would build."""
    tangents = _probe_tangents(family, x, y, framework)
    try:
        FAMILIES[family].check(Inputs(x, tangents, contexts, y, framework))
    except DxError:
        return False
    return True


def _probe_tangents(family: str, x: Tree, y: Tree, framework: Framework) -> tuple | None:
    """One tangent of zeros shaped as ``family``'s tangents are (like x or like y)."""
    like = OPERATORS[family].tangents_like
    if like is None:
        return None
    tree = x if like == "x" else y
    return (framework.tree_map(lambda v: np.zeros(np.shape(v), v.dtype), tree),)
