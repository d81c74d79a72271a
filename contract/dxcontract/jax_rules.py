"""JAX rules for a function computed outside JAX: its value and derivatives from a caller.

The two JAX bridges share them: ``dxclient.jax.remote_function`` (the caller sends
requests to a server) and dxserve's ``DifferentiateWith`` and operators called inside a
JAX transformation with a backend that cannot trace (the caller runs dxserve's own
operators in process). This is the contract's one JAX module: only those bridges import
it, and nothing else in the contract imports it.

A ``Caller`` computes the function ``g(x, *contexts)``: ``value``, ``value_and_gradient``
and ``batch_op`` (``hvp``, ``pushforward``, ``pullback`` and the derivative maps it
names in ``derivatives``), on numpy arrays inside ``jax.pure_callback`` (vmap method
``expand_dims``), or on traced arrays where the caller ``traces``. Under ``vmap``,
nested or not, all points go in one call with ``batch_axis=0`` (the vmapped axes
flattened into one), unless contexts differ between points: a batched call shares its
contexts, so those go one call per point. Derivatives are custom rules, never JAX
tracing the function:

* **scalar output**. The JVP of ``g`` is ``<∇g(x), t>`` with ``∇g(x)`` from one
  ``value_and_gradient``: an ordinary dot product, which JAX transposes itself. The
  gradient is in turn a ``custom_jvp`` function whose tangent rule is ``hvp``, a linear
  map (``linear``) whose transpose is ``hvp`` again (the Hessian is symmetric).
* **array output**. The JVP is ``pushforward``, a linear map whose transpose is
  ``pullback``. Where the caller names their derivatives with respect to x
  (``Caller.derivatives``), those are linear maps too: second order of an array-valued
  function.

Every floating-point argument is differentiated, x and contexts alike: a rule sees
which arguments its JVP moves (JAX's ``argnums``, from the tangents that are not
symbolic zeros) and asks the caller for the derivatives in those, with ``wrt``
(``dxcontract.arguments``): ``value_and_gradient`` and the linear maps over a tuple of
those arguments, and for the gradient's own derivative one ``hvp`` over the arguments
of both (its mixed blocks). A derivative the caller does not serve (third order;
second order of an array-valued function without ``derivatives``, or of a linear map
in an argument it holds fixed) raises ``TypeError(caller.beyond)`` (or ``fixed``) at
trace time rather than returning a wrong zero.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.interpreters import ad, batching, mlir

from .arguments import Wrt, argument_name, merge, positions, split

#: The name of the linear-map primitive (what a program that holds one shows).
LINEAR_MAP = "dx_linear_map"

__all__ = ["LINEAR_MAP", "Caller", "Function", "apply", "linear", "value_and_gradient"]


class Caller(Protocol):
    """Computes ``g(x, *contexts)`` and its derivatives for the rules.

    Methods take numpy arrays (inside callbacks) unless ``traces``; with
    ``batch_axis=0``, x and the tangents lead with an axis of points, contexts shared.
    ``batch_op(op, x, tangents, contexts, batch_axis)`` returns one result per tangent:
    ``hvp``, ``pushforward``, ``pullback``, and the ops ``derivatives`` names.
    ``wrt`` (``dxcontract.arguments``): the arguments differentiated, as the operators
    take it; the gradient, tangents and results are then tuples over them, and
    ``batch_axis`` applies to those arguments, the others shared.
    """

    #: ``value_and_gradient`` and ``batch_op`` take traced arrays and return JAX
    #: expressions, which JAX then transposes, batches and differentiates itself
    traces: bool
    #: ``value`` takes traced arrays (the function itself traces)
    value_traces: bool
    #: the message of the ``TypeError`` for a derivative the caller does not serve
    beyond: str
    #: the message of the ``TypeError`` for a derivative of a linear map with respect
    #: to a context (None: ``beyond``'s); the function itself is differentiated in any
    #: floating-point argument, through ``wrt``
    fixed: str | None
    #: for a linear map ``op``, ``(d, d_transpose)``: the ops of its derivative with
    #: respect to x, as a linear map of x's tangent (the map's own tangent becomes the
    #: first context), and of that map's transpose
    derivatives: Mapping[str, tuple[str, str]]

    def value(
        self, x: Any, contexts: tuple, batch_axis: int | None = None, wrt: Wrt | None = None
    ) -> Any: ...

    def value_and_gradient(
        self, x: Any, contexts: tuple, batch_axis: int | None = None, wrt: Wrt | None = None
    ) -> tuple[Any, Any]: ...

    def batch_op(
        self, op: str, x: Any, tangents: list, contexts: tuple, batch_axis: int | None = None,
        wrt: Wrt | None = None,
    ) -> list: ...


class Function:
    """``g(x, *contexts)``: a JAX-callable whose value and derivatives come from ``caller``.

    ``result_shape``: g's output as a (pytree of) ``jax.ShapeDtypeStruct``; by default
    learnt from one ``caller.value`` per input signature (at x's value if concrete, else
    at zeros) and remembered. One set of rules is built per signature.
    """

    def __init__(
        self, caller: Caller, result_shape: Any = None, name: str = "g", label: str | None = None
    ) -> None:
        self.caller = caller
        self.result_shape = result_shape
        self._shapes: dict[Any, Any] = {}
        self._rules: dict[Any, Callable] = {}
        self.__name__ = name
        self._label = label or f"Function({name!r})"

    def __repr__(self) -> str:
        return self._label

    def __call__(self, x: Any, *contexts: Any) -> Any:
        x = jax.tree.map(jnp.asarray, x)
        contexts = tuple(jax.tree.map(jnp.asarray, c) for c in contexts)
        # typed PRNG keys cross the callbacks as their words (uint32), made keys again
        # on the caller's side (``_Keys``)
        contexts, keys = _key_words(contexts)
        caller = self.caller if keys is None else _Keys(self.caller, *keys)
        out = self._result_shape(x, contexts, caller, keys)
        x_struct = _struct(x)
        leaves, tree = jax.tree.flatten((out, x_struct, _struct(contexts)))
        key = (tree, tuple(leaves), None if keys is None else keys[1])
        g = self._rules.get(key)
        if g is None:
            g = self._rules[key] = _rules(caller, out, x_struct)
        return g(x, *contexts)

    def _result_shape(
        self, x: Any, contexts: tuple, caller: Caller | None = None, keys: Any = None
    ) -> Any:
        if self.result_shape is not None:
            return self.result_shape
        caller = self.caller if caller is None else caller
        key = (jax.tree.structure((x, contexts)),
               tuple((np.shape(a), str(a.dtype)) for a in jax.tree.leaves((x, contexts))),
               None if keys is None else keys[1])
        out = self._shapes.get(key)
        if out is None:
            def concrete(a: Any) -> np.ndarray:
                if isinstance(a, jax.core.Tracer):
                    return np.zeros(np.shape(a), a.dtype)
                return np.asarray(a)

            y = caller.value(
                jax.tree.map(concrete, x), tuple(jax.tree.map(concrete, c) for c in contexts)
            )
            out = self._shapes[key] = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), y
            )
        return out


def _key_words(contexts: tuple) -> tuple[tuple, tuple[Any, tuple] | None]:
    """``(contexts with each typed PRNG key as its words, (their structure, each leaf's
    key impl or None))``; ``(contexts, None)`` when they hold no key."""
    leaves, tree = jax.tree.flatten(contexts)
    impls = tuple(
        str(jax.random.key_impl(v)) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key)
        else None
        for v in leaves
    )
    if all(i is None for i in impls):
        return contexts, None
    words = [v if i is None else jax.random.key_data(v) for v, i in zip(leaves, impls, strict=True)]
    return jax.tree.unflatten(tree, words), (tree, impls)


class _Keys:
    """``caller`` given its typed PRNG keys back: the contexts it is handed (the last
    ones, after a derivative map's own tangent) hold their words; each is wrapped into
    a key of its impl (``jax.random.wrap_key_data``) before the caller sees it."""

    def __init__(self, caller: Caller, tree: Any, impls: tuple) -> None:
        self.caller, self.tree, self.impls = caller, tree, impls
        self.count = len(jax.tree.unflatten(tree, [0] * len(impls)))  # the contexts
        self.traces, self.value_traces = caller.traces, caller.value_traces
        self.beyond, self.fixed = caller.beyond, caller.fixed
        self.derivatives = caller.derivatives
        self.derivatives_take_wrt = getattr(caller, "derivatives_take_wrt", False)

    def _keys(self, contexts: tuple, batch_axis: int | None = None) -> tuple:
        head, own = contexts[: len(contexts) - self.count], contexts[len(contexts) - self.count :]
        leaves = jax.tree.leaves(tuple(own))
        wrapped = [
            v if impl is None else jax.random.wrap_key_data(np.asarray(v), impl=impl)
            for v, impl in zip(leaves, self.impls, strict=True)
        ]
        return (*head, *jax.tree.unflatten(self.tree, wrapped))

    def value(self, x: Any, contexts: tuple, batch_axis: int | None = None, **kw: Any) -> Any:
        return self.caller.value(x, self._keys(contexts), batch_axis, **kw)

    def value_and_gradient(
        self, x: Any, contexts: tuple, batch_axis: int | None = None, **kw: Any
    ) -> tuple[Any, Any]:
        return self.caller.value_and_gradient(x, self._keys(contexts), batch_axis, **kw)

    def batch_op(
        self, op: str, x: Any, tangents: list, contexts: tuple, batch_axis: int | None = None,
        **kw: Any,
    ) -> list:
        return self.caller.batch_op(op, x, tangents, self._keys(contexts), batch_axis, **kw)


def apply(caller: Caller, out: Any, x: Any, contexts: tuple) -> Any:
    """``g(x, *contexts)`` with ``caller``'s rules; ``out``: g's output specs."""
    return _rules(caller, out, _struct(x))(x, *contexts)


def value_and_gradient(caller: Caller, out: Any, x: Any, contexts: tuple) -> tuple[Any, Any]:
    """``(g(x), ∇g(x))`` for a scalar ``g``: the gradient's JVP is ``caller``'s hvp."""
    return _value_and_gradient_rules(caller, out, 0)(x, *contexts)


def _rules(caller: Caller, out: Any, x_struct: Any) -> Callable:
    leaves = jax.tree.leaves(out)
    scalar = len(leaves) == 1 and tuple(leaves[0].shape) == () and out is leaves[0]
    return (_scalar_rules if scalar else _array_rules)(caller, out, x_struct)


def _leaves_ndim(tree: Any) -> list[int]:
    return [np.ndim(leaf) for leaf in jax.tree.leaves(tree)]


def _struct(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def _cast(like: Any, result: Any, batch: tuple[int, ...] = ()) -> Any:
    """``result`` as numpy arrays of ``like``'s structure, dtypes and (batched) shapes."""
    specs, tree = jax.tree.flatten(like)
    got = jax.tree.leaves(result)
    return jax.tree.unflatten(tree, [
        np.asarray(r, s.dtype).reshape(batch + tuple(s.shape))
        for r, s in zip(got, specs, strict=True)
    ])


class _Batched:
    """Reads the arrays ``pure_callback`` hands over under ``vmap``.

    With ``vmap_method="expand_dims"`` each enclosing ``vmap`` adds one leading axis to
    every argument (size 1 where that argument is not mapped). The point's unbatched
    rank is known at trace time, so the number of leading axes is too.
    """

    def __init__(self, point: Any) -> None:
        self.point_ndim = _leaves_ndim(point)[0]

    def split(self, point: Any, *others: Any) -> tuple[tuple[int, ...], int]:
        """(batch shape, its rank)."""
        leaves = jax.tree.leaves(point)
        nb = np.ndim(leaves[0]) - self.point_ndim
        shapes = [np.shape(leaf)[:nb] for leaf in (*leaves, *jax.tree.leaves(others))]
        return tuple(np.broadcast_shapes(*shapes)), nb


def _index(tree: Any, nb: int, idx: tuple[int, ...]) -> Any:
    """Element ``idx`` of the leading ``nb`` (broadcast) axes of every leaf."""
    return jax.tree.map(lambda a: _pick(a, nb, idx), tree)


def _stack(results: list[Any], batch: tuple[int, ...], like: Any) -> Any:
    specs, tree = jax.tree.flatten(like)
    columns = [jax.tree.leaves(r) for r in results]

    def stack(k: int, s: Any) -> np.ndarray:
        out = (np.stack([np.asarray(c[k], dtype=s.dtype) for c in columns]) if columns
               else np.zeros((0, *s.shape), s.dtype))
        return out.reshape(batch + tuple(s.shape))

    return jax.tree.unflatten(tree, [stack(k, s) for k, s in enumerate(specs)])


def _evaluate(
    traces: bool, point: Any, contexts: tuple, out: Any,
    run: Callable[[Any, tuple, int | None], Any],
) -> Any:
    """``run(point, contexts, None)`` where it traces, else through ``_callback``."""
    if traces:
        return run(point, contexts, None)
    return _callback(point, contexts, out, run)


def _callback(
    point: Any, contexts: tuple, out: Any,
    run: Callable[[Any, tuple, int | None], Any],
) -> Any:
    """``pure_callback`` of ``run(x, contexts, batch_axis)``.

    Under ``vmap`` (any depth) the points travel in one call with ``batch_axis=0``, the
    vmapped axes flattened into one; only contexts that differ between points force one
    call per point, since a batched call shares its contexts.
    """
    batched = _Batched(point)

    def host(x: Any, ctx: tuple) -> Any:
        batch, nb = batched.split(x, ctx)
        if not nb:
            return _cast(out, run(x, ctx, None))
        items = list(itertools.product(*map(range, batch)))
        if items and _shared(ctx, nb):
            flat = _flatten_points(x, nb, batch)
            return _cast(out, run(flat, _index(ctx, nb, (0,) * nb), 0), batch)
        results = [run(_index(x, nb, i), _index(ctx, nb, i), None) for i in items]
        return _stack(results, batch, out)

    return jax.pure_callback(host, out, point, contexts, vmap_method="expand_dims")


def _shared(tree: Any, nb: int) -> bool:
    """Whether no leaf of ``tree`` is mapped along its ``nb`` leading axes."""
    return all(math.prod(np.shape(a)[:nb]) == 1 for a in jax.tree.leaves(tree))


def _flatten_points(tree: Any, nb: int, batch: tuple[int, ...]) -> Any:
    """Every leaf broadcast over ``batch`` (its ``nb`` leading axes) and flattened to one axis."""

    def flat(a: Any) -> np.ndarray:
        a = np.asarray(a)
        point = a.shape[nb:]
        return np.broadcast_to(a, batch + point).reshape((math.prod(batch), *point))

    return jax.tree.map(flat, tree)


def _perturbed(tangents: Sequence[Any]) -> tuple[int, ...]:
    """The positions of the arguments whose tangent is not all symbolic zeros: those a
    JVP moves (JAX's ``argnums`` of the transformation around)."""
    return tuple(
        k for k, t in enumerate(tangents)
        if any(not isinstance(v, SymbolicZero) for v in jax.tree.leaves(t))
    )


def _instantiate(tangent: Any) -> Any:
    """``tangent`` with its symbolic zeros made arrays of zeros."""
    return jax.tree.map(
        lambda t: jnp.zeros(t.shape, t.dtype) if isinstance(t, SymbolicZero) else t, tangent
    )


def _wrt_of(active: tuple[int, ...]) -> Wrt:
    """``wrt`` for the arguments ``active`` names: 0 for x alone (x itself, not a tuple)."""
    return 0 if active == (0,) else active


def _selection(caller: Caller, wrt: Wrt) -> Caller:
    """``caller`` differentiating the arguments ``wrt`` names (itself for x alone)."""
    return caller if wrt == 0 else _Selected(caller, wrt)


class _Selected:
    """``caller``'s function as one of the arguments ``wrt`` names (a tuple, ``xs``) and
    the others (``rest``): ``g(xs, *rest)``. Each call puts the arguments back in their
    places and asks the caller with ``wrt``, so its results for ``xs`` are tuples."""

    def __init__(self, caller: Caller, wrt: tuple[int, ...]) -> None:
        self.caller, self.wrt = caller, wrt
        self.traces, self.value_traces = caller.traces, caller.value_traces
        names = ", ".join(argument_name(k) for k in wrt)
        self.beyond = (
            f"{caller.beyond}; with respect to {names} (not x alone) the second "
            "derivatives of an array-valued function are not available either"
        )
        #: a map's derivative in an argument held fixed: not served (see ``_linear_jvp``)
        self.fixed = (
            f"{caller.beyond}; a derivative of the linear maps taken with respect to "
            f"{names} in the direction of another argument is not available either: "
            "differentiate with respect to all of them at once"
        )
        # a caller whose derivative maps take wrt (``derivatives_take_wrt``) serves them
        # for these arguments too; for another they are not available
        self.derivatives: Mapping[str, tuple[str, str]] = (
            caller.derivatives if getattr(caller, "derivatives_take_wrt", False) else {}
        )
        self.derivatives_take_wrt = False

    def _args(self, xs: Any, rest: tuple) -> tuple[Any, tuple]:
        x, *contexts = merge(xs, rest, self.wrt)
        return x, tuple(contexts)

    def value(self, xs: Any, rest: tuple, batch_axis: int | None = None) -> Any:
        return self.caller.value(*self._args(xs, rest), batch_axis, wrt=self.wrt)

    def value_and_gradient(
        self, xs: Any, rest: tuple, batch_axis: int | None = None
    ) -> tuple[Any, Any]:
        return self.caller.value_and_gradient(*self._args(xs, rest), batch_axis, wrt=self.wrt)

    def batch_op(
        self, op: str, xs: Any, tangents: list, rest: tuple, batch_axis: int | None = None
    ) -> list:
        if op in ("hvp", "pushforward", "pullback"):
            x, contexts = self._args(xs, rest)
        else:  # a derivative map: its own tangent first, then the arguments held fixed
            x, contexts = self._args(xs, tuple(rest[1:]))
            contexts = (rest[0], *contexts)
        return self.caller.batch_op(op, x, tangents, contexts, batch_axis, wrt=self.wrt)


def _zeros_like(tree: Any) -> Any:
    return jax.tree.map(jnp.zeros_like, tree)


# --- linear maps of the tangent: hvp, pushforward and its transpose, pullback -------
#
# JAX transposes only primitives with a transpose rule: a ``pure_callback`` has none,
# a ``custom_vjp`` in a tangent's path is not transposable, and ``linear_call`` is not
# batchable. So the linear maps are one small primitive whose rules say what they are:
# linear in the tangent (JVP: the same map on the tangent's tangent, plus the caller's
# derivative map where x moves), transposed by the paired op, batched by adding a
# leading axis that the host side turns into calls. Its lowering is a ``pure_callback``.


@dataclass(frozen=True, eq=False)
class _LinearOp:
    """One linear map ``t -> op(x, (t,), *contexts)``; compared by identity."""

    caller: Caller
    op: str
    transpose_op: str
    x_tree: Any
    ctx_tree: Any
    t_tree: Any
    out_tree: Any
    out_leaves: tuple  # ShapeDtypeStructs of the unbatched result
    n_x: int
    n_ctx: int
    x_ndim: int  # rank of x's first leaf, unbatched
    transposed: list = field(default_factory=list)  # [the transposed _LinearOp], lazily
    t_leaves: tuple = ()  # ShapeDtypeStructs of the unbatched tangent
    x_leaves: tuple = ()  # ShapeDtypeStructs of the unbatched point
    #: 0 for a map of the function; 1 for its derivative in x (not differentiated again)
    level: int = 0
    derived: list = field(default_factory=list)  # [the derivative in x], lazily

    def transpose(self) -> _LinearOp:
        """The paired map (pushforward <-> pullback, hvp <-> hvp), made once."""
        if not self.transposed:
            self.transposed.append(_LinearOp(
                self.caller, self.transpose_op, self.op, self.x_tree, self.ctx_tree,
                t_tree=self.out_tree, out_tree=self.t_tree, out_leaves=self.t_leaves,
                n_x=self.n_x, n_ctx=self.n_ctx, x_ndim=self.x_ndim, transposed=[self],
                t_leaves=self.out_leaves, x_leaves=self.x_leaves, level=self.level,
            ))
        return self.transposed[0]

    def derivative(self) -> _LinearOp | None:
        """``s -> d/dε op(x + ε s, (t,), *contexts)`` as a linear map of s with t moved
        to the front of the contexts (None where the caller serves none)."""
        ops = self.caller.derivatives.get(self.op) if self.level == 0 else None
        if ops is None:
            return None
        if not self.derived:
            t = jax.tree.unflatten(self.t_tree, [0] * len(self.t_leaves))
            ctx = jax.tree.unflatten(self.ctx_tree, [0] * self.n_ctx)
            ctx_tree = jax.tree.structure((t, *ctx))
            self.derived.append(_LinearOp(
                self.caller, ops[0], ops[1], self.x_tree, ctx_tree, t_tree=self.x_tree,
                out_tree=self.out_tree, out_leaves=self.out_leaves, n_x=self.n_x,
                n_ctx=len(self.t_leaves) + self.n_ctx, x_ndim=self.x_ndim,
                t_leaves=self.x_leaves, x_leaves=self.x_leaves, level=1,
            ))
        return self.derived[0]

    def host(self, *arrays: np.ndarray) -> list[np.ndarray]:
        """The caller's calls for (possibly batched) numpy arguments."""
        xs, cs, ts = arrays[: self.n_x], arrays[self.n_x : self.n_x + self.n_ctx], arrays[self.n_x + self.n_ctx :]
        nb = np.ndim(xs[0]) - self.x_ndim
        batch = tuple(np.broadcast_shapes(*(np.shape(a)[:nb] for a in arrays)))
        point_fixed = all(math.prod(np.shape(a)[:nb]) == 1 for a in (*xs, *cs))
        items = list(itertools.product(*map(range, batch)))

        def at(leaves: tuple, tree: Any, idx: tuple) -> Any:
            return jax.tree.unflatten(tree, [_pick(a, nb, idx) for a in leaves])

        tangents = [at(ts, self.t_tree, i) for i in items]
        z = (0,) * nb
        if point_fixed:  # one point, a batch of tangents: one call
            results = self.caller.batch_op(
                self.op, at(xs, self.x_tree, z), tangents, tuple(at(cs, self.ctx_tree, z))
            ) if tangents else []
        elif items and _shared(cs, nb):  # many points, one tangent each: one batched call
            flat_x = jax.tree.unflatten(self.x_tree, [_flatten_points(a, nb, batch) for a in xs])
            flat_t = jax.tree.unflatten(self.t_tree, [_flatten_points(a, nb, batch) for a in ts])
            (stacked,) = self.caller.batch_op(
                self.op, flat_x, [flat_t], tuple(at(cs, self.ctx_tree, z)), batch_axis=0
            )
            return [
                np.asarray(leaf, s.dtype).reshape(batch + tuple(s.shape))
                for leaf, s in zip(jax.tree.leaves(stacked), self.out_leaves, strict=True)
            ]
        else:
            results = [
                self.caller.batch_op(
                    self.op, at(xs, self.x_tree, i), [t], tuple(at(cs, self.ctx_tree, i))
                )[0]
                for i, t in zip(items, tangents, strict=True)
            ]
        outs = [jax.tree.leaves(r) for r in results]
        return [
            (np.stack([np.asarray(o[k], s.dtype) for o in outs]) if outs
             else np.zeros((0, *s.shape), s.dtype)).reshape(batch + tuple(s.shape))
            for k, s in enumerate(self.out_leaves)
        ]

    def out_avals(self, args: Sequence[Any]) -> list[jax.core.ShapedArray]:
        nb = len(np.shape(args[0])) - self.x_ndim
        batch = tuple(np.broadcast_shapes(*(tuple(np.shape(a)[:nb]) for a in args)))
        return [jax.core.ShapedArray(batch + tuple(s.shape), s.dtype) for s in self.out_leaves]


def _pick(a: np.ndarray, nb: int, idx: tuple[int, ...]) -> np.ndarray:
    """Element ``idx`` of ``a``'s ``nb`` leading (broadcast, size-1 or full) axes."""
    a = np.asarray(a)
    return a[tuple(i if a.shape[k] > 1 else 0 for k, i in enumerate(idx))] if nb else a


_linear_p = jax.extend.core.Primitive(LINEAR_MAP)
_linear_p.multiple_results = True


def _linear_impl(*args: Any, op: _LinearOp) -> list:
    return [jnp.asarray(a) for a in op.host(*(np.asarray(a) for a in args))]


def _linear_abstract(*avals: Any, op: _LinearOp) -> list:
    return op.out_avals(avals)


def _linear_lowering(ctx: Any, *args: Any, op: _LinearOp) -> Any:
    def call(*arrays: Any) -> Any:
        structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in op.out_avals(arrays)]
        return jax.pure_callback(op.host, structs, *arrays)

    return mlir.lower_fun(call, multiple_results=True)(ctx, *args)


def _linear_batch(args: Sequence[Any], dims: Sequence[int | None], *, op: _LinearOp) -> Any:
    # the new axis goes in front (size 1 where an argument is not mapped), which is how
    # ``host`` reads leading axes
    moved = [jnp.expand_dims(a, 0) if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims, strict=True)]
    out = _linear_p.bind(*moved, op=op)
    return out, [0] * len(out)


def _moved(tangents: Sequence[Any]) -> bool:
    return any(not isinstance(t, ad.Zero) for t in tangents)


def _linear_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, op: _LinearOp) -> Any:
    n = op.n_x + op.n_ctx
    if _moved(tangents[op.n_x : n]):  # a derivative map's contexts hold the map's tangent
        raise TypeError((op.caller.fixed if op.level == 0 else None) or op.caller.beyond)
    x_moves = _moved(tangents[: op.n_x])
    derivative = op.derivative() if x_moves else None
    if x_moves and derivative is None:
        raise TypeError(op.caller.beyond)
    out = _linear_p.bind(*primals, op=op)
    terms = []
    if x_moves:  # the map's own tangent becomes the derivative's first context
        tx = [ad.instantiate_zeros(t) for t in tangents[: op.n_x]]
        terms.append(_linear_p.bind(
            *primals[: op.n_x], *primals[n:], *primals[op.n_x : n], *tx, op=derivative
        ))
    if _moved(tangents[n:]):
        t_in = [ad.instantiate_zeros(t) for t in tangents[n:]]
        terms.append(_linear_p.bind(*primals[:n], *t_in, op=op))
    if not terms:
        return out, [jnp.zeros_like(o) for o in out]
    return out, [functools.reduce(jnp.add, parts) for parts in zip(*terms, strict=True)]


def _linear_transpose(cts: Sequence[Any], *args: Any, op: _LinearOp) -> list:
    n = op.n_x + op.n_ctx
    if any(ad.is_undefined_primal(a) for a in args[:n]):
        raise TypeError(f"the linear map {op.op} is linear in its tangent only")
    lin = args[n:]
    avals = [a.aval for a in lin]
    cts = [ad.zeros_like_aval(o) if isinstance(c, ad.Zero) else c
           for c, o in zip(cts, op.out_avals([*(a for a in args[:n]), *avals]), strict=True)]
    out = _linear_p.bind(*args[:n], *cts, op=op.transpose())
    # a tangent not mapped by an enclosing vmap holds size-1 leading axes: its
    # cotangent sums over them
    return [None] * n + [_unbroadcast(o, a.shape) for o, a in zip(out, avals, strict=True)]


def _unbroadcast(a: Any, shape: tuple[int, ...]) -> Any:
    if tuple(a.shape) == tuple(shape):
        return a
    axes = tuple(i for i, (got, want) in enumerate(zip(a.shape, shape, strict=True)) if want == 1 != got)
    return jnp.sum(a, axis=axes, keepdims=True)


_linear_p.def_impl(_linear_impl)
_linear_p.def_abstract_eval(_linear_abstract)
mlir.register_lowering(_linear_p, _linear_lowering)
batching.primitive_batchers[_linear_p] = _linear_batch
ad.primitive_jvps[_linear_p] = _linear_jvp
ad.primitive_transposes[_linear_p] = _linear_transpose


def linear(
    caller: Caller, op: str, transpose_op: str, x: Any, t: Any, contexts: tuple, out: Any
) -> Any:
    """``op(x, (t,), *contexts)`` as a JAX linear map of ``t``, transposed by
    ``transpose_op``; ``out``: its result's specs. Where the caller ``traces``, the op's
    own JAX expression."""
    if caller.traces:
        return caller.batch_op(op, x, [t], tuple(contexts))[0]
    # Python numbers as arrays: every operand of the primitive has a shape and a dtype
    x_leaves, x_tree = jax.tree.flatten(jax.tree.map(jnp.asarray, x))
    c_leaves, c_tree = jax.tree.flatten(jax.tree.map(jnp.asarray, tuple(contexts)))
    t_leaves, t_tree = jax.tree.flatten(jax.tree.map(jnp.asarray, t))
    out_structs, out_tree = jax.tree.flatten(out)
    lin = _LinearOp(
        caller, op, transpose_op, x_tree, c_tree, t_tree, out_tree, tuple(out_structs),
        len(x_leaves), len(c_leaves), np.ndim(x_leaves[0]),
        t_leaves=tuple(jax.tree.leaves(_struct(t_leaves))),
        x_leaves=tuple(jax.tree.leaves(_struct(x_leaves))),
    )
    result = _linear_p.bind(*x_leaves, *c_leaves, *t_leaves, op=lin)
    return jax.tree.unflatten(out_tree, result)


# --- the functions -----------------------------------------------------------------


def _value_and_gradient_rules(caller: Caller, out: Any, wrt: Wrt) -> Callable:
    """``(g(*args), ∇g)`` for scalar g, the gradient in the arguments ``wrt`` names. Its
    JVP moving arguments ``A``: ``<∇g, t>`` and the rows of ``wrt`` of the Hessian in
    the arguments ``wrt`` and ``A`` together, times t (one ``hvp``, mixed blocks too)."""
    sub = _selection(caller, wrt)
    named = positions(wrt)

    @jax.custom_jvp
    def value_and_gradient(*args: Any) -> Any:
        xs, rest = split(args, wrt)
        return _evaluate(
            sub.traces, xs, rest, (out, _struct(xs)),
            lambda x1, c1, axis: tuple(sub.value_and_gradient(x1, c1, axis)),
        )

    def vg_jvp(primals: tuple, tangents: tuple) -> Any:
        active = _perturbed(tangents)
        y, g = value_and_gradient(*primals)
        if not active:
            return (y, g), (jnp.zeros_like(y), _zeros_like(g))
        union = _wrt_of(named + tuple(k for k in active if k not in named))
        t = [_instantiate(tangents[k]) if k in active else None for k in range(len(primals))]
        for k in positions(union):  # an argument of wrt that does not move: zeros
            if t[k] is None:
                t[k] = _zeros_like(primals[k])
        xs, rest = split(primals, union)
        h = hvp(_selection(caller, union), xs, split(t, union)[0], rest)
        if union == wrt:
            dg, grad, t_grad = h, g, split(t, wrt)[0]
        else:  # the rows of wrt; y moves with the other arguments too
            dg = h[0] if wrt == 0 else tuple(h[: len(named)])
            grad = _value_and_gradient_rules(caller, out, union)(*primals)[1]
            t_grad = split(t, union)[0]
        return (y, g), (_dot(grad, t_grad), dg)

    value_and_gradient.defjvp(vg_jvp, symbolic_zeros=True)
    return value_and_gradient


def hvp(caller: Caller, x: Any, t: Any, contexts: tuple) -> Any:
    """``∇²g(x) t``, linear in t; the Hessian is symmetric, so its transpose is itself."""
    return linear(caller, "hvp", "hvp", x, t, contexts, _struct(x))


def _scalar_rules(caller: Caller, out: Any, x_struct: Any) -> Callable:
    """``g`` for a scalar output: value_and_gradient for first order, hvp for second,
    in whichever arguments move."""

    @jax.custom_jvp
    def g(x: Any, *contexts: Any) -> Any:
        return _evaluate(
            caller.value_traces, x, contexts, out, lambda x1, c1, axis: caller.value(x1, c1, axis)
        )

    def g_jvp(primals: tuple, tangents: tuple) -> Any:
        active = _perturbed(tangents)
        if not active:
            y = g(*primals)
            return y, jnp.zeros_like(y)
        wrt = _wrt_of(active)
        y, grad = _value_and_gradient_rules(caller, out, wrt)(*primals)
        return y, _dot(grad, split([_instantiate(t) for t in tangents], wrt)[0])

    g.defjvp(g_jvp, symbolic_zeros=True)
    return g


def _dot(a: Any, b: Any) -> Any:
    """<a, b> over matching pytrees."""
    terms = [jnp.sum(u * v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)]
    return functools.reduce(jnp.add, terms)


def _array_rules(caller: Caller, out: Any, x_struct: Any) -> Callable:
    """``g`` for an array output: pushforward forward, its transpose the pullback."""

    @jax.custom_jvp
    def g(x: Any, *contexts: Any) -> Any:
        return _evaluate(
            caller.value_traces, x, contexts, out, lambda x1, c1, axis: caller.value(x1, c1, axis)
        )

    def g_jvp(primals: tuple, tangents: tuple) -> Any:
        active = _perturbed(tangents)
        y = g(*primals)
        if not active:
            return y, _zeros_like(y)
        wrt = _wrt_of(active)
        xs, rest = split(primals, wrt)
        t = split([_instantiate(t) for t in tangents], wrt)[0]
        return y, linear(
            _selection(caller, wrt), "pushforward", "pullback", xs, t, tuple(rest), out
        )

    g.defjvp(g_jvp, symbolic_zeros=True)
    return g
