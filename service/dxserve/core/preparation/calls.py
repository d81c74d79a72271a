"""Calls: find a call's prep (``lookup``), run it (``call``), and call a warm one straight.

``call`` normalizes the inputs, finds the prep for their signature (an explicit one,
checked, or the cache's, else prepared now) and returns the operator's results as the
library does. Once a prep has run its executable whole, a ``Ready`` calls it as
``jax.jit`` calls a function: the inputs checked in one pass, nothing normalized.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dxcontract.backends import Backend, backend_from_json
from dxcontract.errors import DxError, FunctionEvaluationError
from dxcontract.operators import OPERATORS, returned
from dxserve.core.limits import ComputeLimits
from dxserve.core.preparation.batches import check_batch_axis
from dxserve.core.preparation.cache import CACHE, PrepCache
from dxserve.core.preparation.failures import _short, out_of_memory
from dxserve.core.preparation.inputs import Tree, _signature_of, normalize
from dxserve.core.preparation.pipeline import prepare
from dxserve.core.preparation.prep import BATCH_RESULTS, Prep, packing
from dxserve.frameworks import Framework, framework_of

if TYPE_CHECKING:
    from dxserve.frameworks.jax.signature import Signature


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
        self,
        cache: PrepCache,
        max_result_elements: int | None = None,
        limits: ComputeLimits | None = None,
    ) -> Prep:
        """Trace and compile for this call (the slow path) and keep the prep in ``cache``.

        Requests for a new signature that arrive together are all looked up before the
        first one compiles; the later ones find its prep here instead of compiling again.
        """
        prep = cache.peek(self.key)
        if prep is None:
            prep = prepare(
                self.operator,
                self.function,
                self.backend,
                self.x,
                self.tangents,
                self.contexts,
                cache,
                max_result_elements,
                limits,
                self.batch_axis,
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
            operator,
            f,
            backend,
            x,
            tangents,
            contexts,
            prep,
            cache,
            batch_axis=batch_axis,
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

    __slots__ = (
        "prep",
        "operator",
        "function",
        "backend",
        "signature",
        "device",
        "device_of",
        "structure",
        "x_spec",
        "t_specs",
        "c_specs",
        "simple",
        "kinds",
        "flatten",
        "precise",
        "exe",
        "finish",
    )

    def __init__(self, prep: Prep, operator: str, inputs: tuple) -> None:
        fw = prep.framework
        self.prep, self.operator, self.function, self.backend = (
            prep,
            operator,
            prep.function,
            prep.backend,
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
            prep.traced
            and getattr(fw, "from_host", None) is None
            and (operator, prep._bound(fw.device())) in prep.executables
            and not prep.chunked(operator)
            and all(type(v) in kinds for v in fw.leaves(inputs))
        ):
            prep.ready[operator] = Ready(prep, operator, inputs)

    def __call__(
        self,
        f: Callable,
        backend: Any,
        x: Any,
        tangents: Any,
        contexts: Any,
        batch_axis: int | None,
        has_aux: bool,
    ) -> Any:
        """``call``'s answer, or ``NOT_READY`` where this call needs the full path."""
        signature = self.signature
        if (
            f is not self.function
            or batch_axis != signature.batch_axis
            or has_aux != signature.has_aux
            or type(contexts) is not tuple
        ):
            return NOT_READY
        if (
            backend is not self.backend
            and backend != self.backend
            and (backend_from_json(backend) != self.backend)
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
            return returned(op, [(o,) if i in batched else o for i, o in enumerate(out)], has_aux)

        return run, finish
    if tangents is None:
        if len(op.results) == 1 and not has_aux:
            return exe, lambda out: out[0]
        return exe, lambda out: returned(op, out, has_aux)
    return exe, lambda out: _finish(prep, operator, tangents, out)


#: numpy's scalars (``np.float64(0.7)``): programs take them as 0-d arrays of their dtype
_SCALARS = (
    np.float64,
    np.float32,
    np.float16,
    np.complex128,
    np.complex64,
    np.int64,
    np.int32,
    np.bool_,
)


def _is_array(value: Any) -> bool:
    return (
        hasattr(value, "shape")
        and hasattr(value, "dtype")
        and not isinstance(value, dict | list | tuple)
    )


def _on_device(framework: Framework, results: tuple[str, ...], outputs: tuple) -> tuple:
    """Per-tangent results (numpy views, see ``packing``) as the framework's arrays, as
    the library returns every other result: one transfer for the whole batch."""
    return tuple(
        framework.to_device(out) if name in BATCH_RESULTS else out
        for name, out in zip(results, outputs, strict=True)
    )
