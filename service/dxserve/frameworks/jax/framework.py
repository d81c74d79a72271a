"""JAX as a ``Framework``: eval_shape probes, jit compiles, XLA estimates, vmap batches.

``JAX`` is the default framework. ``JAX_EAGER`` is its companion for functions JAX
cannot trace (plain numpy code served beside JAX's): numpy arrays, JAX's pytrees,
maps by loops, nothing compiled and no estimate (trusted code, not bounded).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from dxcontract import jax_rules
from dxcontract.operators import OPERATORS
from dxserve.frameworks import Estimate
from dxserve.frameworks.jax import executable_cache
from dxserve.frameworks.jax import tangents as _tangents
from dxserve.frameworks.jax.precision import float64_scope

Tree = Any

#: What ``jax.eval_shape`` raises for a function that needs concrete values.
NOT_TRACEABLE = (
    jax.errors.TracerArrayConversionError,
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
)

#: Primitives whose programs are never merged across requests (``request_batching``):
#: vmap turns a ``cond`` into a select running both branches, callbacks and uploaded
#: exports are opaque.
UNBATCHABLE_PRIMITIVES = frozenset(
    {"cond", "while", "pure_callback", "io_callback", "callback", "dxserve_export_call",
     jax_rules.LINEAR_MAP}
)

_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


class _Trees:
    """JAX's pytrees (shared by both JAX frameworks)."""

    def leaves(self, tree: Tree) -> list[Any]:
        return jax.tree_util.tree_leaves(tree)

    def flatten(self, tree: Tree) -> tuple[list[Any], Any]:
        return jax.tree_util.tree_flatten(tree)

    def unflatten(self, structure: Any, leaves: Sequence[Any]) -> Tree:
        return jax.tree_util.tree_unflatten(structure, list(leaves))

    def tree_map(self, fn: Callable[..., Any], tree: Tree, *rest: Tree) -> Tree:
        return jax.tree_util.tree_map(fn, tree, *rest)

    def is_traced(self, tree: Tree) -> bool:
        return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(tree))

    def spec(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return jax.ShapeDtypeStruct(tuple(shape), dtype)

    def device(self) -> Any:
        return jax.config.jax_default_device

    def precision_scope(self) -> AbstractContextManager:
        return float64_scope()

    def substitute(
        self, operator: str, caller: Any, x: Tree, tangents: tuple | None, contexts: tuple,
        y: Tree,
    ) -> tuple:
        return substitute(operator, caller, x, tangents, contexts, y)


@dataclass(frozen=True)
class _Program:
    """A traced operator for request batching: flat arrays in and out."""

    closed: Any  # ClosedJaxpr
    out_tree: Any


class JaxFramework(_Trees):
    """JAX: traced by ``jax.jit``, estimated by XLA's analyses."""

    name = "jax"
    #: what the HTTP door answers as an internal error (or out of memory), not a crash
    runtime_errors = (jax.errors.JaxRuntimeError,)

    def devices(self) -> list[Any]:
        """The devices a server runs one device worker on each of."""
        return jax.devices()

    def on_device(self, device: Any) -> AbstractContextManager:
        """Computations inside run on ``device`` (a worker pinned to one of several)."""
        return jax.default_device(device)

    def clear_caches(self) -> None:
        """Drop JAX's trace and lowering caches (they hold a function's constants)."""
        jax.clear_caches()

    def runtime_info(self) -> dict[str, Any]:
        """What a server's readiness answer says it runs on."""
        from dxcontract.platforms import export_platform

        return {
            "platform": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()],
            "export_platforms": [export_platform(jax.default_backend())],
            "jax_version": jax.__version__,
        }
    xp = jnp
    #: arrays a compiled program takes as they are, beside numpy's (``preparation.Ready``)
    array_types = (type(jnp.zeros(())),)

    def in_precision_scope(self) -> bool:
        """Does JAX already keep float64 here (what ``precision_scope`` turns on)?"""
        return bool(jax.config.jax_enable_x64)

    def to_device(self, tree: Tree) -> Tree:
        return jax.device_put(tree, jax.config.jax_default_device)

    def block(self, tree: Tree) -> Tree:
        return jax.block_until_ready(tree)

    def probe(self, f: Callable, x: Tree, contexts: tuple) -> tuple[bool, Tree]:
        """``jax.eval_shape`` (remembered across restarts by ``executable_cache``); a
        function that needs concrete values is called once instead (not traceable)."""
        known = executable_cache.output_spec(f, x, contexts)
        if known is not None:
            return True, known
        try:
            y = jax.eval_shape(f, x, *contexts)
        except NOT_TRACEABLE:
            return JAX_EAGER.probe(f, x, contexts)
        executable_cache.keep_output_spec(f, x, contexts, y)
        return True, y

    def eval_shape(self, fn: Callable, *args: Any) -> Tree:
        return jax.eval_shape(fn, *args)

    def lower(self, fn: Callable, *args: Any) -> Any:
        """``fn`` traced and lowered for ``args``, not compiled: what ``compile`` would
        refuse at tracing or lowering (forward mode through a ``custom_vjp`` passes
        ``eval_shape`` and fails only here), it refuses."""
        return jax.jit(fn).lower(*args)

    def vmap(self, fn: Callable, in_axes: Any = 0) -> Callable:
        return jax.vmap(fn, in_axes=in_axes)

    def map(self, fn: Callable[[Tree], Tree], batch: Tree, batch_size: int | None) -> Tree:
        return _tangents.chunked_vmap(fn, batch, batch_size)

    def ravel(self, tree: Tree) -> tuple[Any, Callable[[Any], Tree]]:
        return ravel_pytree(tree)

    def compile(self, fn: Callable, args: tuple, key: Any = None) -> Callable:
        return executable_cache.compile_or_load(key, fn, *args)

    def compile_donating(self, fn: Callable, args: tuple) -> Any:
        return jax.jit(fn, donate_argnums=len(args) - 1).lower(*args).compile()

    def executable_key(
        self, function: Callable, backend: Any, results: tuple, x: Tree, tangents: Tree,
        contexts: tuple, batch_axis: int | None,
    ) -> Any:
        return executable_cache.key(function, backend, results, x, tangents, contexts, batch_axis)

    def estimate(self, executable: Any) -> Estimate | None:
        """XLA's memory and cost analyses of a compiled executable; a loop's body counts
        its largest stated trip count (``known_trip_count``) times."""
        return xla_estimate(executable)

    def batch_program(self, run: Callable, inputs: tuple) -> tuple[Any, str]:
        try:
            closed, out_shape = jax.make_jaxpr(run, return_shape=True)(*inputs)
        except Exception as exc:  # noqa: BLE001 - the unbatched path reports real errors
            return None, f"could not trace: {type(exc).__name__}"
        found = primitives(closed.jaxpr) & UNBATCHABLE_PRIMITIVES
        if found:
            return None, f"uses {', '.join(sorted(found))}"
        return _Program(closed, jax.tree_util.tree_structure(out_shape)), ""

    def compile_batched(self, program: Any, stacked: list[Any]) -> Callable:
        fn = jax.vmap(jex.jaxpr_as_fun(program.closed))
        return jax.jit(fn).lower(*stacked).compile()

    def out_structure(self, program: Any) -> Any:
        return program.out_tree

    def program_arrays(self, program: Any) -> list[Any]:
        """The constants a traced ``program`` keeps alive (what a prep cache counts)."""
        return list(program.closed.consts)

    def eager(self) -> JaxEagerFramework:
        return JAX_EAGER


class JaxEagerFramework(_Trees):
    """Functions JAX cannot trace: numpy arrays, loops, nothing compiled or estimated."""

    name = "jax-eager"
    xp = np

    def to_device(self, tree: Tree) -> Tree:
        return tree

    def block(self, tree: Tree) -> Tree:
        return tree

    def probe(self, f: Callable, x: Tree, contexts: tuple) -> tuple[bool, Tree]:
        return False, self.eval_shape(f, x, *contexts)

    def eval_shape(self, fn: Callable, *args: Any) -> Tree:
        return jax.tree_util.tree_map(
            lambda v: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype), fn(*args)
        )

    def vmap(self, fn: Callable, in_axes: Any = 0) -> Callable:
        return _loop_vmap(fn, in_axes)

    def map(self, fn: Callable[[Tree], Tree], batch: Tree, batch_size: int | None) -> Tree:
        return _tangents.loop_map(fn, batch, batch_size)

    def ravel(self, tree: Tree) -> tuple[Any, Callable[[Any], Tree]]:
        return _tangents.np_flat(tree)

    def compile(self, fn: Callable, args: tuple, key: Any = None) -> Callable:
        return fn

    def compile_donating(self, fn: Callable, args: tuple) -> Any:
        raise NotImplementedError("functions JAX cannot trace run one-shot, not in chunks")

    def executable_key(self, *args: Any) -> Any:
        return None

    def estimate(self, executable: Any) -> Estimate | None:
        return None

    def batch_program(self, run: Callable, inputs: tuple) -> tuple[Any, str]:
        return None, "not traceable by JAX"

    def compile_batched(self, program: Any, stacked: list[Any]) -> Callable:
        raise NotImplementedError("functions JAX cannot trace are not batched")

    def out_structure(self, program: Any) -> Any:
        raise NotImplementedError("functions JAX cannot trace are not batched")

    def program_arrays(self, program: Any) -> list[Any]:
        return []

    def eager(self) -> JaxEagerFramework:
        return self


def _loop_vmap(fn: Callable, in_axes: Any) -> Callable:
    """``vmap`` by a Python loop over the leading axis, results stacked in numpy."""

    def looped(*args: Any) -> Tree:
        axes = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(args)
        mapped = [a for a, axis in zip(args, axes, strict=True) if axis is not None]
        count = np.shape(jax.tree_util.tree_leaves(mapped)[0])[0]
        outs = []
        for i in range(count):
            one = [
                a if axis is None else jax.tree_util.tree_map(lambda v, i=i: v[i, ...], a)
                for a, axis in zip(args, axes, strict=True)
            ]
            outs.append(fn(*one))
        return jax.tree_util.tree_map(lambda *vs: np.stack([np.asarray(v) for v in vs]), *outs)

    return looped


def substitute(
    operator: str, caller: Any, x: Tree, tangents: tuple | None, contexts: tuple, y: Tree
) -> tuple:
    """``operator``'s results at one traced point from ``caller``'s function ``g``
    (``dxcontract.jax_rules``): the value is ``g`` itself, a gradient ``g``'s (its
    derivative the caller's hvp), per-tangent results the caller's linear maps (their
    derivatives the caller's second-order maps), and the dense derivatives JAX's
    ``jacfwd`` / ``jacrev`` of those, so each is differentiated by the next operator."""
    results = OPERATORS[operator].results
    x_spec = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), x)

    def g(u: Tree) -> Tree:
        return jax_rules.apply(caller, y, u, contexts)

    def gradient(u: Tree) -> Tree:
        return jax_rules.value_and_gradient(caller, y, u, contexts)[1]

    def maps(op: str, transpose_op: str, out: Tree) -> tuple:
        return tuple(
            jax_rules.linear(caller, op, transpose_op, x, t, contexts, out) for t in tangents or ()
        )

    done: dict[str, Any] = {}
    if "gradient" in results:  # one call for both (a scalar f: the family checked it)
        done["value"], done["gradient"] = jax_rules.value_and_gradient(caller, y, x, contexts)
    for name in results:
        if name in done:
            continue
        if name == "value":
            done[name] = g(x)
        elif name == "jacobian":  # columns or rows by size, as auto picks
            n, m = (sum(math.prod(np.shape(v)) for v in jax.tree_util.tree_leaves(t)) for t in (x, y))
            done[name] = (jax.jacfwd if n <= m else jax.jacrev)(g)(x)
        elif name == "hessian":
            done[name] = jax.jacfwd(gradient)(x)
        elif name == "derivative":  # a scalar x: the pushforward of 1
            done[name] = jax_rules.linear(
                caller, "pushforward", "pullback", x, jnp.ones_like(x), contexts, y
            )
        elif name == "second_derivative":  # the pushforward's derivative, at 1 and 1
            one = jnp.ones_like(x)
            done[name] = jax_rules.linear(
                caller, *caller.derivatives["pushforward"], x, one, (one, *contexts), y
            )
        elif name == "pushforwards":
            done[name] = maps("pushforward", "pullback", y)
        elif name == "pullbacks":
            done[name] = maps("pullback", "pushforward", x_spec)
        elif name == "hvps":
            done[name] = maps("hvp", "hvp", x_spec)
        else:
            raise NotImplementedError(f"{name} has no substitute inside a transformation")
    return tuple(done[name] for name in results)


def _subjaxprs(params: dict) -> list[Any]:
    found = []
    for value in params.values():
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, jex.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, jex.Jaxpr):
                found.append(item)
    return found


def primitives(jaxpr: Any) -> set[str]:
    """Names of every primitive in ``jaxpr`` and the jaxprs nested in it."""
    names: set[str] = set()
    stack = [jaxpr]
    while stack:
        current = stack.pop()
        for eqn in current.eqns:
            names.add(eqn.primitive.name)
            stack.extend(_subjaxprs(eqn.params))
    return names


def xla_estimate(executable: Any) -> Estimate | None:
    """``executable``'s memory and cost analysis, or None where XLA gives none."""
    try:
        memory = executable.memory_analysis()
        cost = executable.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without the analysis: nothing to bound
        return None
    if isinstance(cost, list | tuple):  # older JAX: one dict per computation
        cost = cost[0] if cost else None
    if memory is None and not cost:
        return None
    size = 0
    if memory is not None:
        size = sum(
            int(getattr(memory, name, 0) or 0)
            for name in (
                "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                "generated_code_size_in_bytes", "host_argument_size_in_bytes",
                "host_output_size_in_bytes", "host_temp_size_in_bytes",
                "host_generated_code_size_in_bytes",
            )
        )
        # a donated argument and the output it becomes share one buffer
        size -= sum(
            int(getattr(memory, name, 0) or 0)
            for name in ("alias_size_in_bytes", "host_alias_size_in_bytes")
        )
    cost = cost or {}
    trips = _longest_loop(executable)
    flops = (_number(cost.get("flops")) + _number(cost.get("transcendentals"))) * trips
    return Estimate(size, flops, _number(cost.get("bytes accessed")) * trips, trips)


def _number(value: Any) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return 0.0
    return value if math.isfinite(value) and value > 0 else 0.0


def _longest_loop(executable: Any) -> int:
    """The largest ``known_trip_count`` in the compiled program (1 if none or unknown)."""
    try:
        text = executable.as_text()
    except Exception:  # noqa: BLE001 - no text: count loops once
        return 1
    if not text or "while" not in text:
        return 1
    return max((int(n) for n in _TRIP_COUNT.findall(text)), default=1)


JAX = JaxFramework()
JAX_EAGER = JaxEagerFramework()


def rebuild_node(value: Any, normalize: Callable[[Any], Any]) -> Any:
    """``value`` rebuilt with ``normalize`` applied to its children where it is a node
    ``jax.tree_util`` knows (its type kept); anything else as it is."""
    children, node = jax.tree_util.tree_flatten(value, is_leaf=lambda v: v is not value)
    if node.num_nodes == 1:  # a leaf: no node to keep
        return value
    return jax.tree_util.tree_unflatten(node, [normalize(c) for c in children])


def reverse_traces(f: Callable, x: Any, contexts: tuple) -> bool:
    """Does JAX's reverse mode trace ``f`` at (abstract) ``x``?"""

    def pulled(u: Any) -> Any:
        y, vjp = jax.vjp(lambda v: f(v, *contexts), u)
        return vjp(jax.tree_util.tree_map(jax.numpy.zeros_like, y))

    try:
        jax.eval_shape(pulled, x)
    except Exception:  # noqa: BLE001 - any refusal: reverse mode does not trace it
        return False
    return True
