"""Frameworks: what the core asks of the array library a function is written in.

The operators, the engines' fallbacks, preparation, chunking, budgets and request
batching are written against ``Framework`` alone; JAX is one framework
(``frameworks/jax.py``). A function says which framework it is written in with
``@dxserve.function(framework="name")``; unmarked functions are JAX's.

A framework that has no abstract evaluation (torch, numpy) probes by calling the
function (on meta tensors, or small inputs); one that cannot compile returns its
functions as they are from ``compile``. ``eager()`` is the framework's companion for
functions it cannot trace (plain numpy inside a JAX server): concrete arrays, loops
for maps, nothing compiled.

Registering a framework is a plug-in's explicit call (``register_framework``);
importing dxserve registers JAX's lazily, on first use, and changes nothing else.
"""

from __future__ import annotations

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
    #: the array namespace the fallbacks compute with (``jnp``, ``numpy``): ``eye``,
    #: ``ones``, ``zeros``, ``empty``, ``arange``, ``reshape``, ``ravel``, ``concatenate``,
    #: ``abs``, ``max``, ``maximum``, ``asarray``, ``stack``, ``real``, ``imag``
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
        """An abstract array of ``shape`` and ``dtype`` (what ``probe`` returns)."""
        ...

    def to_device(self, tree: Tree) -> Tree:
        """``tree``'s arrays where the framework computes (the current device)."""
        ...

    def device(self) -> Any:
        """The current default device: executables are compiled per device (None: one)."""
        ...

    def block(self, tree: Tree) -> Tree:
        """``tree`` once its computation has finished (asynchronous frameworks)."""
        ...

    # --- probing ------------------------------------------------------------------
    def probe(self, f: Callable, x: Tree, contexts: tuple) -> tuple[bool, Tree]:
        """``(traceable, output specs)`` of ``f(x, *contexts)``: can the framework
        transform and compile ``f``, and what it returns (shapes and dtypes), learnt
        without running it where the framework can (``jax.eval_shape``). Errors of
        the function itself propagate."""
        ...

    def eval_shape(self, fn: Callable, *args: Any) -> Tree:
        """Output specs of ``fn(*args)`` inside a program being built."""
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
        output (a chunk's previous block); the executable has ``out_info``, the
        output's spec."""
        ...

    def executable_key(
        self, function: Callable, backend: Any, results: tuple, x: Tree, tangents: Tree,
        contexts: tuple, batch_axis: int | None,
    ) -> Any:
        """The persistent-cache key of an operator's executable (None: not cached)."""
        ...

    def estimate(self, executable: Any) -> Any:
        """``budget.Estimate`` of ``executable``'s memory and work, or None if unknown."""
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


_FRAMEWORKS: dict[str, Framework] = {}


def register_framework(framework: Framework) -> Framework:
    """Make ``framework`` available by its ``name`` (replacing one of that name)."""
    _FRAMEWORKS[framework.name] = framework
    return framework


def get_framework(name: str = DEFAULT) -> Framework:
    """The framework registered as ``name`` (JAX's is made on first use)."""
    found = _FRAMEWORKS.get(name)
    if found is None and name == DEFAULT:
        from .jax import JAX  # loaded when first asked for: importing dxserve stays light

        found = _FRAMEWORKS.setdefault(DEFAULT, JAX)
    if found is None:
        raise KeyError(f"no framework {name!r} is registered (known: {sorted(_FRAMEWORKS)})")
    return found


def framework_of(f: Callable) -> Framework:
    """The framework ``f`` is written in: the one its ``@dxserve.function(framework=...)``
    names, else ``DEFAULT``."""
    info = getattr(f, "__dxserve__", None)
    return get_framework(getattr(info, "framework", None) or DEFAULT)


__all__ = ["DEFAULT", "Estimate", "Framework", "framework_of", "get_framework", "register_framework"]
