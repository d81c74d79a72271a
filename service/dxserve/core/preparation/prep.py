"""The prepared operator (``Prep``) and the registry of operator families (``Family``).

A ``Prep`` holds the compiled executables of one operator family for one call
signature: calls with a matching signature run them directly, calls with another
raise ``PreparationMismatchError``. Each operator module registers its ``Family``
(a check of the inputs and a builder of the operator's function) here.

Everything framework-specific (compiling, devices, precision) goes through the
prep's ``Framework`` (``frameworks``; JAX unless the function names another).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from importlib import import_module
from typing import TYPE_CHECKING, Any

from dxcontract.backends import Backend
from dxcontract.errors import DxError, FunctionEvaluationError, PreparationMismatchError
from dxcontract.operators import OPERATORS, result_names
from dxserve.core.backends.engine import Engine
from dxserve.core.footprint import EXECUTABLE_BYTES, array_bytes, executable_bytes
from dxserve.core.limits import ComputeLimits
from dxserve.core.preparation.failures import _short, out_of_memory
from dxserve.core.preparation.inputs import Tree, normalize
from dxserve.core.progress import Job, JobCancelled
from dxserve.core.wrt import Selected
from dxserve.frameworks import Framework, get_framework

if TYPE_CHECKING:
    from dxserve.core.preparation.calls import Ready
    from dxserve.frameworks.jax.signature import Signature


class _Packing:
    """``frameworks/jax/packing`` (tangent batches, on JAX's tree functions), loaded at
    the first preparation: importing the core loads no framework."""

    def __getattr__(self, name: str) -> Any:
        from dxserve.frameworks.jax import packing

        return getattr(packing, name)


packing = _Packing()


_log = logging.getLogger("dxserve.compile")
#: results that hold one value per tangent, packed by the programs (see ``packing``)
BATCH_RESULTS = frozenset().union(*(op.batch_results for op in OPERATORS.values()))


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


#: Bytes a prep's Python objects take beside its executables and arrays (its signature,
#: output spec, closures and report), counted once per prep.
PREP_BYTES = 16 * 1024


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

    def executable(
        self, operator: str, x: Tree, tangents: tuple | None, contexts: tuple
    ) -> Callable:
        """The executable for ``operator`` on the current default device (compiled on
        first use there: a compiled executable is bound to the device it was built for)."""
        key = (operator, self.framework.device())
        exe = self.executables.get(key)
        if exe is None:
            exe = self.executables[key] = self._compile(operator, x, tangents, contexts)
            self.grew()
        return exe

    def head(
        self,
        operator: str,
        results: tuple[str, ...],
        x: Tree,
        tangents: tuple | None,
        contexts: tuple,
    ) -> Callable:
        """An executable of some of ``operator``'s ``results`` only (a chunked run's value
        and gradient: XLA drops the rest of the program)."""
        key = (("head", operator, results), self.framework.device())
        exe = self.executables.get(key)
        if exe is None:
            exe = self.executables[key] = self._compile(operator, x, tangents, contexts, results)
            self.grew()
        return exe

    def _compile(
        self,
        operator: str,
        x: Tree,
        tangents: tuple | None,
        contexts: tuple,
        only: tuple[str, ...] | None = None,
        chunk: bool = False,
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
            self.function,
            self.resolved,
            results,
            x,
            args,
            contexts,
            batch_axis,
        )
        start = time.perf_counter()
        try:
            compiled = self.compiler.compile(program, (x, args, contexts), key)
            exe = (
                packing.Single(compiled, batched)
                if one
                else self._packed(compiled, results, tangents)
            )
        except DxError:
            raise
        except Exception as exc:
            raise out_of_memory(exc) or FunctionEvaluationError(
                _short(exc), field="function"
            ) from exc
        seconds = time.perf_counter() - start
        function = getattr(self.function, "__name__", type(self.function).__name__)
        _log.info(
            "compiled %s of %s (%s) in %.3f s",
            operator,
            function,
            self.resolved.to_json(),
            seconds,
            extra={
                "event": "compile",
                "operator": operator,
                "function": function,
                "backend": self.resolved.to_json(),
                "seconds": round(seconds, 6),
            },
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

    def compile_for(self, operator: str, x: Tree, tangents: tuple | None, contexts: tuple) -> None:
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
        self,
        operator: str,
        x: Tree,
        tangents: tuple | None,
        contexts: tuple,
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
