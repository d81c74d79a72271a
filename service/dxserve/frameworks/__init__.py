"""Frameworks: what the core asks of the array library a function is written in.

The operators, the engines' fallbacks, preparation, chunking, budgets and request
batching are written against ``Framework`` alone; JAX is one framework
(``frameworks/jax.py``). A function says which framework it is written in with
``@dxserve.function(framework="name")``; an unmarked one is the first registered
framework's whose ``owns(f)`` says so, else torch's where its code refers to torch and
not to JAX (``detect_framework``), else JAX's.

A framework that has no abstract evaluation (torch, numpy) probes by calling the
function (on meta tensors, or small inputs); one that cannot compile returns its
functions as they are from ``compile``. ``eager()`` is the framework's companion for
functions it cannot trace (plain numpy inside a JAX server): concrete arrays, loops
for maps, nothing compiled.

Registering a framework is a plug-in's explicit call (``register_framework``);
importing dxserve registers JAX's lazily, on first use, and changes nothing else.
``docs/frameworks.md`` builds a small framework and engine step by step.

Threads: the core calls a framework and its engines from several threads at once (one
worker per device, the compile threads that probe and estimate). A framework whose AD
keeps process-wide state takes its own lock (an ``RLock``: calls nest) around whatever
runs it: ``probe``, ``eval_shape``, the executables ``compile`` returns, and, for
operators that are not compiled (an engine with ``traces=False``, or ``probe`` saying
the function does not trace), the engine's ``pushforward``/``pullback`` themselves.
Torch's is its ``RUN_LOCK``.
"""

from __future__ import annotations

import sys
import types
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

Tree = Any

#: The framework of functions that do not name one.
DEFAULT = "jax"


@dataclass(frozen=True, slots=True)
class Estimate:
    """What a framework says one compiled executable costs (``budget`` bounds it)."""

    memory_bytes: int  # arguments + outputs + temporaries + generated code
    flops: float  # flops and transcendentals, times the longest stated loop
    bytes_accessed: float  # memory traffic, times the longest stated loop
    loop_trips: int = 1  # the largest known trip count of a loop in the program


@runtime_checkable
class Framework(Protocol):
    """The seam between dxserve's core and one array library.

    Trees are the library's own nested containers of arrays (JAX's pytrees); a
    "spec" is an abstract array with ``shape`` and ``dtype``; an "executable" is what
    ``compile`` returns: a callable the framework can ``estimate``.
    """

    name: str
    # optional: ``owns(f) -> bool``, True for a function written in this framework that
    # does not say so with ``@dxserve.function(framework=...)``: ``detect_framework``
    # asks every registered framework that has it (in registration order) before
    # torch's detection and the JAX default. It must be cheap and must not raise; it
    # is asked once per function (weakly cached). ``refers_to`` helps write one.

    #: the array namespace the fallbacks compute with (``jnp``, ``numpy``): ``eye``,
    #: ``ones``, ``zeros``, ``empty``, ``arange``, ``reshape``, ``ravel``, ``concatenate``,
    #: ``abs``, ``max``, ``maximum``, ``asarray``, ``stack``, ``real``, ``imag``, ``finfo``,
    #: and ``astype`` where its arrays have no ``astype`` method (see ``astype``)
    xp: Any

    # --- pytrees ------------------------------------------------------------------
    def leaves(self, tree: Tree) -> list[Any]:
        """The arrays of ``tree``, in its canonical order."""
        ...

    def flatten(self, tree: Tree) -> tuple[list[Any], Any]:
        """``(leaves, structure)``; ``unflatten(structure, leaves)`` rebuilds ``tree``."""
        ...

    def unflatten(self, structure: Any, leaves: Sequence[Any]) -> Tree:
        """The tree of ``structure`` holding ``leaves``."""
        ...

    def tree_map(self, fn: Callable[..., Any], tree: Tree, *rest: Tree) -> Tree:
        """``fn`` over the leaves of ``tree`` (and of ``rest``, shaped alike)."""
        ...

    # --- arrays -------------------------------------------------------------------
    def is_traced(self, tree: Tree) -> bool:
        """Is some leaf of ``tree`` a value inside another transformation of this
        framework (a JAX tracer under ``jax.grad``, ``jit`` or ``vmap``)?"""
        ...

    def spec(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """An abstract array of ``shape`` and ``dtype`` (what ``probe`` returns): any
        object with ``shape`` (a tuple of ints) and ``dtype`` (one numpy reads) will do.
        ``eval_shape`` must accept these as arguments."""
        ...

    def to_device(self, tree: Tree) -> Tree:
        """``tree``'s arrays where the framework computes (the current device)."""
        ...

    def device(self) -> Any:
        """The current default device: executables are compiled per device (None: one)."""
        ...

    # optional: ``background_compiles() -> {outcome: count}``, for a framework that
    # compiles hot executables in the background (torch's): ``/metrics`` reports them.

    # optional: ``per_device = False`` for a framework whose executables are not bound to
    # the device they were compiled on (its ``device()`` is always None): a worker pinned
    # to any device then finds the one executable compiled.

    def block(self, tree: Tree) -> Tree:
        """``tree`` once its computation has finished (asynchronous frameworks)."""
        ...

    # --- probing ------------------------------------------------------------------
    def probe(self, f: Callable, x: Tree, contexts: tuple) -> tuple[bool, Tree]:
        """``(traceable, output specs)`` of ``f(x, *contexts)``: can the framework
        transform and compile ``f``, and what it returns (shapes and dtypes), learnt
        without running it where the framework can (``jax.eval_shape``). Errors of
        the function itself propagate. ``x`` and ``contexts`` are concrete (numpy
        arrays, or the caller's arrays of this framework).

        ``traceable`` decides how operators run: True compiles them (``compile``, with
        ``estimate`` for budgets) and lets Jacobians and Hessians run in chunks with
        progress, provided the engine also has ``traces = True``; False runs the
        engine on concrete arrays through ``eager()``, one shot, unchunked and
        unbounded. A framework without a compiler still says True where its engines
        can run inside the "executables" it returns."""
        ...

    def eval_shape(self, fn: Callable, *args: Any) -> Tree:
        """Output specs of ``fn(*args)`` (``spec``'s kind), ``fn`` not run where the
        framework can avoid it. ``args`` (a pytree each) hold, leaf by leaf: concrete
        arrays (numpy, or this framework's), values inside one of this framework's
        programs (where the engines call it), and specs made by this framework's own
        ``spec`` (when a served function is described from its example or its
        annotations). A framework without abstract evaluation calls ``fn`` on arrays
        of the specs' shapes and dtypes (``numpy.ones``). An exception means "not
        known": the description shows no shapes."""
        ...

    # --- transforming -------------------------------------------------------------
    def vmap(self, fn: Callable, in_axes: Any = 0) -> Callable:
        """``fn`` over a leading axis of its arguments (``in_axes`` as ``jax.vmap``'s;
        None: shared), results stacked on a leading axis."""
        ...

    def map(self, fn: Callable[[Tree], Tree], batch: Tree, batch_size: int | None) -> Tree:
        """``vmap(fn)(batch)``, computed ``batch_size`` items at a time (None: all)."""
        ...

    def ravel(self, tree: Tree) -> tuple[Any, Callable[[Any], Tree]]:
        """``(vector, unravel)``: ``tree``'s leaves as one flat vector, and the inverse."""
        ...

    # --- compiling and what it costs ----------------------------------------------
    def compile(self, fn: Callable, args: tuple, key: Any = None) -> Callable:
        """``fn`` compiled for ``args`` (its shapes and dtypes). ``key``: from
        ``executable_key``, persists the executable across restarts where supported."""
        ...

    def compile_donating(self, fn: Callable, args: tuple) -> Any:
        """``fn`` compiled for ``args`` with its last argument's buffer donated to the
        output: a chunk of a chunked Jacobian or Hessian.

        ``fn(x, contexts, start, previous) -> block``; ``args`` is ``(x, contexts,
        np.int32(0), previous)`` with concrete ``x`` and ``contexts``, and ``previous``
        the spec of one block (from this framework's ``eval_shape``): ``fn`` ignores it,
        and a framework that cannot donate buffers ignores it too. The executable
        (called as ``exe(x, contexts, np.int32(start), previous_block)``) must have an
        attribute ``out_info``: the spec of its output, one array (``shape``,
        ``dtype``), from which the core allocates the result; ``estimate`` reads its
        cost as it reads ``compile``'s."""
        ...

    def executable_key(
        self, function: Callable, backend: Any, results: tuple, x: Tree, tangents: Tree,
        contexts: tuple, batch_axis: int | None,
    ) -> Any:
        """The persistent-cache key of an operator's executable (None: not cached)."""
        ...

    def estimate(self, executable: Any) -> Any:
        """``Estimate`` of ``executable``'s memory and work, or None if unknown.

        None means unbounded: the compute budgets do not refuse it, and the memory
        budget never splits it (it still runs in chunks, for progress, from
        ``DXSERVE_CHUNK_FROM`` basis vectors on). ``memory_bytes`` is what the budgets and the chunk planner read:
        a Jacobian whose one-shot estimate is over the chunk budget runs in chunks sized
        from it, and a chunk is shrunk until its own estimate fits. ``flops`` and
        ``bytes_accessed`` bound the time. A framework without a compiler estimates from
        what it knows: the bytes of the arguments and outputs, and work from their
        sizes (one call, or one run on abstract arrays, measures the outputs)."""
        ...

    def batch_program(self, run: Callable, inputs: tuple) -> tuple[Any, str]:
        """``(program, "")``: ``run`` as a program whose concurrent calls may be merged
        into one (``request_batching``), taking and returning flat lists of arrays;
        ``(None, why)`` where they may not."""
        ...

    def compile_batched(self, program: Any, stacked: list[Any]) -> Callable:
        """``program`` vmapped over a leading axis of ``stacked`` and compiled."""
        ...

    def out_structure(self, program: Any) -> Any:
        """The tree structure of ``program``'s outputs (``unflatten`` rebuilds them)."""
        ...

    def program_arrays(self, program: Any) -> list[Any]:
        """The arrays ``program`` keeps alive (constants), for the caches' byte bounds."""
        ...

    # --- precision and fallbacks --------------------------------------------------
    def precision_scope(self) -> AbstractContextManager:
        """A context in which float64 inputs compute in float64 (this thread only)."""
        ...

    def eager(self) -> Framework:
        """The framework for functions this one cannot trace: concrete arrays, maps by
        loops, ``compile`` returning its function (itself where it is eager already)."""
        ...

    # --- what a transformation must not trace -------------------------------------
    def substitute(
        self, operator: str, caller: Any, x: Tree, tangents: tuple | None, contexts: tuple,
        y: Tree,
    ) -> tuple:
        """``operator``'s results (its table's order; a tuple of k per-tangent results)
        at traced inputs, for one point, without tracing the function: computed by
        ``caller`` on concrete arrays (or on traced ones where it says it traces), the
        derivatives the transformations take coming from ``caller`` too (see
        ``dxcontract.jax_rules.Caller``). ``y``: the function's output specs. A
        framework without it (one without tracing) never gets here."""
        ...

    # optional: ``from_host(tree)``, for a framework whose executables return host arrays
    # (torch's): every result of a library call as the framework's arrays. Without it, the
    # library returns what the executables return (per-tangent results ``to_device``).


_FRAMEWORKS: dict[str, Framework] = {}


def loaded_frameworks() -> list[Framework]:
    """The frameworks in use in this process (made or registered so far)."""
    return list(_FRAMEWORKS.values())


def is_runtime_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a framework's own runtime error (its compiler or device
    failing: JAX's ``JaxRuntimeError``), by the ``runtime_errors`` (a tuple of exception
    types; optional) of the frameworks loaded in this process. Such an error can only be
    raised once its library is loaded, so no framework is loaded to answer."""
    frameworks = loaded_frameworks()
    if DEFAULT not in _FRAMEWORKS and _LIBRARIES.get(DEFAULT) in sys.modules:
        frameworks.append(get_framework(DEFAULT))
    return any(isinstance(exc, getattr(fw, "runtime_errors", ())) for fw in frameworks)


def clear_caches() -> None:
    """Each loaded framework's caches of traces and lowerings dropped (``clear_caches``,
    optional), so a dropped function's constants are freed."""
    frameworks = loaded_frameworks()
    if DEFAULT not in _FRAMEWORKS and _LIBRARIES.get(DEFAULT) in sys.modules:
        frameworks.append(get_framework(DEFAULT))
    for fw in frameworks:
        clear = getattr(fw, "clear_caches", None)
        if clear is not None:
            clear()


def register_framework(framework: Framework) -> Framework:
    """Make ``framework`` available by its ``name`` (replacing one of that name). Its
    ``owns(f)``, if it has one, takes part in detection from now on."""
    _FRAMEWORKS[framework.name] = framework
    _DETECTED.clear()  # a function detected before may now be this framework's
    return framework


def get_framework(name: str = DEFAULT) -> Framework:
    """The framework registered as ``name`` (JAX's and torch's are made on first use;
    torch's needs torch installed: the server's ``torch`` extra)."""
    found = _FRAMEWORKS.get(name)
    if found is None and name == DEFAULT:
        from dxserve.frameworks.jax.framework import (
            JAX,  # loaded when first asked for: importing dxserve stays light
        )

        found = _FRAMEWORKS.setdefault(DEFAULT, JAX)
    if found is None and name == "torch":
        try:
            from dxserve.frameworks.torch.framework import (
                TORCH,  # imports torch: only for torch functions
            )
        except ImportError as exc:
            from dxcontract.extras import SERVER, install_hint

            raise KeyError(
                f"framework 'torch' needs PyTorch installed ({install_hint('torch', SERVER)}): "
                f"{exc}"
            ) from None
        found = _FRAMEWORKS.setdefault("torch", TORCH)
    if found is None:
        raise KeyError(f"no framework {name!r} is registered (known: {sorted(_FRAMEWORKS)})")
    return found


def framework_of(f: Callable) -> Framework:
    """The framework ``f`` is written in: the one its ``@dxserve.function(framework=...)``
    names, else the one its code refers to (``detect_framework``)."""
    f = getattr(f, "__dxserve_holomorphic__", None) or f  # declared holomorphic: its own
    info = getattr(f, "__dxserve__", None)
    name = getattr(info, "framework", None)
    return get_framework(name or _detected(f))


_DETECTED: weakref.WeakKeyDictionary[Callable, str] = weakref.WeakKeyDictionary()
#: libraries whose functions are told apart by what their code refers to
_LIBRARIES = {"torch": "torch", "jax": "jax", "jaxlib": "jax"}


def _detected(f: Callable) -> str:
    try:
        found = _DETECTED.get(f)
    except TypeError:  # not weakly referable: detected each time
        return detect_framework(f)
    if found is None:
        found = detect_framework(f)
        try:
            _DETECTED[f] = found
        except TypeError:
            pass
    return found


def detect_framework(f: Callable) -> str:
    """The name of the framework an unmarked ``f`` is written in: the first registered
    framework whose ``owns(f)`` is true; else ``"torch"`` when ``f``'s code refers to
    torch (the module or anything from it: a function, a tensor, an ``nn.Module``,
    among its globals and closure, and those of the functions it calls in its own
    modules) and not to JAX; else ``DEFAULT``. Ambiguous and plain-Python functions
    are JAX's, as before."""
    for framework in list(_FRAMEWORKS.values()):
        owns = getattr(framework, "owns", None)
        if owns is not None and owns(f):
            return framework.name
    if "torch" not in sys.modules:  # nothing can be torch's
        return DEFAULT
    found = _libraries(f, depth=3, seen=set())
    return "torch" if found == {"torch"} else DEFAULT


def refers_to(f: Callable, test: Callable[[Any], bool], depth: int = 3) -> bool:
    """Does ``f``'s code refer to a value for which ``test`` is true: ``f`` itself, or a
    global or closure variable its code names, or one named by the plain functions
    those refer to (``depth`` levels down)? What torch's detection walks; a framework's
    ``owns`` can use it, e.g. ``refers_to(f, lambda v: getattr(v, "__name__", "") ==
    "autograd.numpy")`` for functions written with ``import autograd.numpy as np``."""
    return bool(_libraries(f, depth, set(), lambda v: "yes" if test(v) else None))


def _libraries(
    f: Any, depth: int, seen: set[int], label: Callable[[Any], str | None] | None = None
) -> set[str]:
    """The labels (``label``, by default ``_library_of``: ``_LIBRARIES``' values) of the
    values ``f`` refers to; a labelled value is not looked into."""
    label = label or _library_of
    if id(f) in seen:
        return set()
    seen.add(id(f))
    f = getattr(f, "func", f)  # functools.partial
    own = label(f)
    if own is not None:
        return {own}
    code = getattr(f, "__code__", None)
    if code is None:
        return set()
    names: set[str] = set()
    stack = [code]
    while stack:
        current = stack.pop()
        names.update(current.co_names)
        stack.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
    scope = getattr(f, "__globals__", {})
    values = [scope[n] for n in names if n in scope]
    for cell in getattr(f, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    found: set[str] = set()
    for value in values:
        library = label(value)
        if library is not None:
            found.add(library)
        elif depth > 0 and isinstance(value, types.FunctionType):
            found |= _libraries(value, depth - 1, seen, label)
    return found


def _library_of(value: Any) -> str | None:
    """``"torch"`` or ``"jax"`` for a module, function, class or object of theirs (an
    ``nn.Module`` subclass of the caller's is torch's: its bases are)."""
    if isinstance(value, types.ModuleType):
        names = [value.__name__]
    elif isinstance(value, type):
        names = [c.__module__ for c in value.__mro__]
    elif isinstance(value, types.FunctionType):
        names = [value.__module__]
    else:
        names = [getattr(value, "__module__", None), *(c.__module__ for c in type(value).__mro__)]
    for name in names:
        found = _LIBRARIES.get(name.split(".")[0]) if isinstance(name, str) else None
        if found is not None:
            return found
    return None


def host_array(value: Any) -> Any:
    """A torch tensor (torch is loaded: its caller made it) as a numpy array on the host,
    of its dtype, detached from any autograd graph; None for anything else. Operators
    take numpy at their edge: a tensor's data is read once, never tracked."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor):
        return None
    from dxserve.frameworks.torch.framework import host_numpy

    try:
        return host_numpy(value)
    except RuntimeError as exc:  # a tensor inside torch.func's own transforms
        from dxcontract.errors import InvalidArgumentError

        raise InvalidArgumentError(
            "a torch tensor being transformed by torch.func (grad, vmap, ...) cannot be "
            f"passed to a dxserve operator; pass concrete tensors ({exc})"[:400]
        ) from None


def astype(xp: Any, a: Any, dtype: Any) -> Any:
    """``a`` cast to ``dtype``: ``xp.astype`` (the array API's function) where the namespace
    has one, else the array's own method (numpy 1.x)."""
    cast = getattr(xp, "astype", None)
    return a.astype(dtype) if cast is None else cast(a, dtype)


__all__ = [
    "DEFAULT", "Estimate", "Framework", "astype", "detect_framework", "framework_of",
    "get_framework", "host_array", "refers_to", "register_framework",
]
