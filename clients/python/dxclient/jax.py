"""Served functions inside JAX: ``remote_function(client, name)`` is a JAX-callable.

    g = remote_function(client, "rosenbrock")
    jax.jit(jax.grad(g))(x); jax.hessian(g)(x); jax.vmap(jax.grad(g))(xs)

Every call to the service goes through ``jax.pure_callback`` (``vmap_method=
"expand_dims"``), so ``g`` works under ``jit`` and ``vmap``. Under ``vmap``, nested or
not, all points travel in one request with ``batch_axis=0`` (the vmapped axes flattened
into one), unless contexts differ between points: a batched request shares its contexts,
so those go one request per point. Derivatives are custom rules, never JAX tracing the
served function:

* **scalar output** (the case of losses, log-densities, objectives). The JVP of ``g``
  is ``<∇g(x), t>`` with ``∇g(x)`` from one ``/value_and_gradient`` request: an ordinary
  JAX dot product, so JAX transposes it itself, and ``jax.grad``, ``jax.vjp`` and
  ``jax.jacfwd`` all cost that one request. The gradient is in turn a ``custom_jvp``
  function whose tangent rule is the service's ``/hvp`` (forward-over-reverse on the
  server), and that HVP is a linear map (``jax.custom_derivatives.linear_call``)
  whose transpose is ``/hvp`` again (the Hessian is symmetric). So ``jax.hessian(g)``, ``jax.jvp(jax.grad(g), ...)`` and
  ``jax.grad`` of any function of ``jax.grad(g)`` reach ``/hvp``; batched tangents
  (``jacfwd``, ``hessian``, ``vmap`` over tangents) travel in one ``/hvp`` request.
* **array output**. The JVP is ``/pushforward``, a linear map whose transpose is
  ``/pullback``: ``jax.jvp``, ``jax.jacfwd``, ``jax.vjp`` and ``jax.jacrev`` work.

Differentiating a JVP or HVP with respect to its point (third order of a scalar
function, second order of an array-valued one) raises a ``TypeError`` at trace time
rather than returning a wrong zero.

Contexts (arguments after ``x``) are passed to the service as they are and are not
differentiated: their derivatives are zero, as in the library. ``x`` may be a pytree
(a dict of arrays) for scalar functions, as on the server.

The output's shape and dtype come from ``result_shape`` if given, else from one
``/value`` request per input signature at trace time (at ``x``'s value if concrete,
else at zeros), remembered per signature.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

try:
    import jax
except ImportError as exc:
    from dxcontract.extras import install_hint

    raise ImportError(f"dxclient.jax needs JAX: {install_hint('jax')}") from exc
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, batching, mlir

from dxcontract.backends import Backend

from ._client import Client
from ._models import RemoteFunction, function_name

__all__ = ["remote_function"]


def remote_function(
    client: Client,
    f: RemoteFunction | str,
    backend: Backend | str = "auto",
    *,
    result_shape: jax.ShapeDtypeStruct | None = None,
) -> Callable[..., Any]:
    """A JAX-callable ``g(x, *contexts)`` evaluating and differentiating ``f`` on the server.

    ``client`` is a synchronous ``dxclient.Client`` (callbacks run synchronously).
    ``result_shape``: ``f``'s output as a ``jax.ShapeDtypeStruct``; by default learnt
    from one ``/value`` request per input signature.
    """
    return _Remote(client, function_name(f), backend, result_shape)


def _leaves_ndim(tree: Any) -> list[int]:
    return [np.ndim(leaf) for leaf in jax.tree.leaves(tree)]


def _struct(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


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
    def stack(s: jax.ShapeDtypeStruct, *rs: Any) -> np.ndarray:
        out = np.stack([np.asarray(r, dtype=s.dtype) for r in rs]) if rs else np.zeros((0, *s.shape), s.dtype)
        return out.reshape(batch + tuple(s.shape))

    return jax.tree.map(stack, like, *results)


class _Remote:
    """The callable ``remote_function`` returns; one set of JAX rules per signature."""

    def __init__(
        self, client: Client, name: str, backend: Backend | str,
        result_shape: jax.ShapeDtypeStruct | None,
    ) -> None:
        self.client, self.name, self.backend = client, name, backend
        self.result_shape = result_shape
        self._shapes: dict[Any, Any] = {}
        self._rules: dict[Any, Callable] = {}  # one set of custom rules per signature
        self.__name__ = name

    def __repr__(self) -> str:
        return f"remote_function({self.name!r}, backend={self.backend!r})"

    def __call__(self, x: Any, *contexts: Any) -> Any:
        x = jax.tree.map(jnp.asarray, x)
        contexts = tuple(jax.tree.map(jnp.asarray, c) for c in contexts)
        out = self._result_shape(x, contexts)
        x_struct, ctx_struct = _struct(x), _struct(contexts)
        key = (out, *jax.tree.flatten((x_struct, ctx_struct)))
        key = (out, key[2], tuple(key[1]))
        g = self._rules.get(key)
        if g is None:
            rules = _scalar_rules if out.shape == () else _array_rules
            g = self._rules[key] = rules(self, out, x_struct, ctx_struct)
        return g(x, *contexts)

    def _result_shape(self, x: Any, contexts: tuple) -> jax.ShapeDtypeStruct:
        if self.result_shape is not None:
            return self.result_shape
        key = (jax.tree.structure((x, contexts)),
               tuple((np.shape(a), str(a.dtype)) for a in jax.tree.leaves((x, contexts))))
        out = self._shapes.get(key)
        if out is None:
            def concrete(a: Any) -> np.ndarray:
                if isinstance(a, jax.core.Tracer):
                    return np.zeros(np.shape(a), a.dtype)
                return np.asarray(a)

            y = np.asarray(self.client.value(
                self.name, self.backend, jax.tree.map(concrete, x),
                *(jax.tree.map(concrete, c) for c in contexts),
            ))
            out = self._shapes[key] = jax.ShapeDtypeStruct(y.shape, y.dtype)
        return out

    # --- service calls on numpy arguments (inside callbacks) ----------------------
    def value(self, x: Any, contexts: tuple, batch_axis: int | None = None) -> Any:
        return self.client.value(self.name, self.backend, x, *contexts, batch_axis=batch_axis)

    def value_and_gradient(self, x: Any, contexts: tuple, batch_axis: int | None = None) -> Any:
        return self.client.value_and_gradient(
            self.name, self.backend, x, *contexts, batch_axis=batch_axis
        )

    def batch_op(
        self, op: str, x: Any, tangents: list, contexts: tuple, batch_axis: int | None = None
    ) -> list:
        """``op`` (hvp, pushforward, pullback) at one point for a list of tangents; with
        ``batch_axis=0``, at B points (x's leading axis) for tangents that lead with B too."""
        if not tangents:
            return []
        return list(getattr(self.client, op)(
            self.name, self.backend, x, tuple(tangents), *contexts, batch_axis=batch_axis
        ))


def _callback(
    point: Any, contexts: tuple, out: Any,
    run: Callable[[Any, tuple, int | None], Any],
) -> Any:
    """``pure_callback`` of ``run(x, contexts, batch_axis)``.

    Under ``vmap`` (any depth) the points travel in one request with ``batch_axis=0``,
    the vmapped axes flattened into one; only contexts that differ between points force
    one request per point, since a batched request shares its contexts.
    """
    batched = _Batched(point)

    def host(x: Any, ctx: tuple) -> Any:
        batch, nb = batched.split(x, ctx)
        if not nb:
            return run(x, ctx, None)
        items = list(itertools.product(*map(range, batch)))
        if items and _shared(ctx, nb):
            flat = _flatten_points(x, nb, batch)
            result = run(flat, _index(ctx, nb, (0,) * nb), 0)
            return jax.tree.map(
                lambda s, r: np.asarray(r, s.dtype).reshape(batch + tuple(s.shape)), out, result
            )
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


# --- linear maps of the tangent: hvp, pushforward and its transpose, pullback -------
#
# JAX transposes only primitives with a transpose rule: a ``pure_callback`` has none,
# a ``custom_vjp`` in a tangent's path is not transposable, and ``linear_call`` is not
# batchable. So the served linear maps are one small primitive whose rules say what
# they are: linear in the tangent (JVP: the same map on the tangent's tangent),
# transposed by the paired operator, batched by adding a leading axis that the host
# side turns into requests. Its lowering is a ``pure_callback``.


@dataclass(frozen=True, eq=False)
class _LinearOp:
    """One served linear map ``t -> op(x, (t,), *contexts)``; compared by identity."""

    remote: _Remote
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

    def transpose(self) -> _LinearOp:
        """The paired map (pushforward <-> pullback, hvp <-> hvp), made once."""
        if not self.transposed:
            self.transposed.append(_LinearOp(
                self.remote, self.transpose_op, self.op, self.x_tree, self.ctx_tree,
                t_tree=self.out_tree, out_tree=self.t_tree, out_leaves=self.t_leaves,
                n_x=self.n_x, n_ctx=self.n_ctx, x_ndim=self.x_ndim, transposed=[self],
                t_leaves=self.out_leaves,
            ))
        return self.transposed[0]

    def host(self, *arrays: np.ndarray) -> list[np.ndarray]:
        """The service calls for (possibly batched) numpy arguments."""
        xs, cs, ts = arrays[: self.n_x], arrays[self.n_x : self.n_x + self.n_ctx], arrays[self.n_x + self.n_ctx :]
        nb = np.ndim(xs[0]) - self.x_ndim
        batch = tuple(np.broadcast_shapes(*(np.shape(a)[:nb] for a in arrays)))
        point_fixed = all(math.prod(np.shape(a)[:nb]) == 1 for a in (*xs, *cs))
        items = list(itertools.product(*map(range, batch)))

        def at(leaves: tuple, tree: Any, idx: tuple) -> Any:
            return jax.tree.unflatten(tree, [_pick(a, nb, idx) for a in leaves])

        tangents = [at(ts, self.t_tree, i) for i in items]
        z = (0,) * nb
        if point_fixed:  # one point, a batch of tangents: one request
            results = self.remote.batch_op(
                self.op, at(xs, self.x_tree, z), tangents, tuple(at(cs, self.ctx_tree, z))
            )
        elif items and _shared(cs, nb):  # many points, one tangent each: one batched request
            flat_x = jax.tree.unflatten(self.x_tree, [_flatten_points(a, nb, batch) for a in xs])
            flat_t = jax.tree.unflatten(self.t_tree, [_flatten_points(a, nb, batch) for a in ts])
            (stacked,) = self.remote.batch_op(
                self.op, flat_x, [flat_t], tuple(at(cs, self.ctx_tree, z)), batch_axis=0
            )
            return [
                np.asarray(leaf, s.dtype).reshape(batch + tuple(s.shape))
                for leaf, s in zip(jax.tree.leaves(stacked), self.out_leaves, strict=True)
            ]
        else:
            results = [
                self.remote.batch_op(
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
        nb = len(args[0].shape) - self.x_ndim
        batch = tuple(np.broadcast_shapes(*(tuple(a.shape[:nb]) for a in args)))
        return [jax.core.ShapedArray(batch + tuple(s.shape), s.dtype) for s in self.out_leaves]


def _pick(a: np.ndarray, nb: int, idx: tuple[int, ...]) -> np.ndarray:
    """Element ``idx`` of ``a``'s ``nb`` leading (broadcast, size-1 or full) axes."""
    a = np.asarray(a)
    return a[tuple(i if a.shape[k] > 1 else 0 for k, i in enumerate(idx))] if nb else a


_linear_p = jax.extend.core.Primitive("dxclient_served_linear")
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


def _linear_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, op: _LinearOp) -> Any:
    n = op.n_x + op.n_ctx
    if any(not isinstance(t, ad.Zero) for t in tangents[:n]):
        raise TypeError(
            "dxclient.jax: derivatives of a served function's JVP or HVP with respect to "
            "its point (third order, or second order of an array-valued function) are "
            "not available: the service serves up to Hessian-vector products"
        )
    out = _linear_p.bind(*primals, op=op)
    t_in = tangents[n:]
    if all(isinstance(t, ad.Zero) for t in t_in):
        return out, [jnp.zeros_like(o) for o in out]
    t_in = [ad.instantiate_zeros(t) for t in t_in]
    return out, _linear_p.bind(*primals[:n], *t_in, op=op)


def _linear_transpose(cts: Sequence[Any], *args: Any, op: _LinearOp) -> list:
    n = op.n_x + op.n_ctx
    if any(ad.is_undefined_primal(a) for a in args[:n]):
        raise TypeError("dxclient.jax: a served linear map is linear in its tangent only")
    lin = args[n:]
    avals = [a.aval for a in lin]
    cts = [ad.zeros_like_aval(o) if isinstance(c, ad.Zero) else c
           for c, o in zip(cts, op.out_avals([*(a for a in args[:n]), *avals]), strict=True)]
    flipped = op.transpose()
    out = _linear_p.bind(*args[:n], *cts, op=flipped)
    return [None] * n + list(out)


_linear_p.def_impl(_linear_impl)
_linear_p.def_abstract_eval(_linear_abstract)
mlir.register_lowering(_linear_p, _linear_lowering)
batching.primitive_batchers[_linear_p] = _linear_batch
ad.primitive_jvps[_linear_p] = _linear_jvp
ad.primitive_transposes[_linear_p] = _linear_transpose


def _linear(
    remote: _Remote, op: str, transpose_op: str, x: Any, t: Any, contexts: tuple, out: Any
) -> Any:
    """``op(x, (t,), *contexts)`` as a JAX linear map of ``t``, transposed by ``transpose_op``."""
    x_leaves, x_tree = jax.tree.flatten(x)
    c_leaves, c_tree = jax.tree.flatten(contexts)
    t_leaves, t_tree = jax.tree.flatten(t)
    out_structs, out_tree = jax.tree.flatten(out)
    t_structs = tuple(jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in t_leaves)
    lin = _LinearOp(
        remote, op, transpose_op, x_tree, c_tree, t_tree, out_tree, tuple(out_structs),
        len(x_leaves), len(c_leaves), np.ndim(x_leaves[0]), t_leaves=t_structs,
    )
    result = _linear_p.bind(*x_leaves, *c_leaves, *t_leaves, op=lin)
    return jax.tree.unflatten(out_tree, result)


def _scalar_rules(remote: _Remote, out: Any, x_struct: Any, ctx_struct: Any) -> Callable:
    """``g`` for a scalar output: value_and_gradient for first order, hvp for second."""

    def vg_host(x: Any, contexts: tuple) -> Any:
        return _callback(
            x, contexts, (out, x_struct),
            lambda x1, c1, axis: tuple(remote.value_and_gradient(x1, c1, axis)),
        )

    def hvp(x: Any, t: Any, contexts: tuple) -> Any:
        # linear in t; the Hessian is symmetric, so its transpose is itself
        return _linear(remote, "hvp", "hvp", x, t, contexts, x_struct)

    @jax.custom_jvp
    def value_and_gradient(x: Any, *contexts: Any) -> Any:
        return vg_host(x, contexts)

    @value_and_gradient.defjvp
    def vg_jvp(primals: tuple, tangents: tuple) -> Any:
        x, *contexts = primals
        tx = tangents[0]
        y, g = value_and_gradient(x, *contexts)
        return (y, g), (_dot(g, tx), hvp(x, tx, tuple(contexts)))

    @jax.custom_jvp
    def g(x: Any, *contexts: Any) -> Any:
        return _callback(x, contexts, out, lambda x1, c1, axis: remote.value(x1, c1, axis))

    @g.defjvp
    def g_jvp(primals: tuple, tangents: tuple) -> Any:
        x, *contexts = primals
        y, grad = value_and_gradient(x, *contexts)
        return y, _dot(grad, tangents[0])

    return g


def _dot(a: Any, b: Any) -> Any:
    """<a, b> over matching pytrees; a symbolic-zero tangent gives 0."""
    terms = [jnp.sum(u * v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)]
    return functools.reduce(jnp.add, terms)


def _array_rules(remote: _Remote, out: Any, x_struct: Any, ctx_struct: Any) -> Callable:
    """``g`` for an array output: pushforward forward, its transpose the pullback."""

    def push(x: Any, t: Any, contexts: tuple) -> Any:
        # linear in t: JAX transposes it to the pullback
        return _linear(remote, "pushforward", "pullback", x, t, contexts, out)

    @jax.custom_jvp
    def g(x: Any, *contexts: Any) -> Any:
        return _callback(x, contexts, out, lambda x1, c1, axis: remote.value(x1, c1, axis))

    @g.defjvp
    def g_jvp(primals: tuple, tangents: tuple) -> Any:
        x, *contexts = primals
        return g(x, *contexts), push(x, tangents[0], tuple(contexts))

    return g
