"""Load an uploaded JAX export bundle into one ordinary, fully differentiable callable.

The client (``dxclient.export.export_function``) uploads five ``jax.export``
artifacts: the primal ``f(x, *c)`` and four derivative maps over flat leaves,
each batched over a symbolic leading ``k`` on its linear inputs::

    jvp      L(x, T[k])        = Df(x) T_i                 linear in T
    vjp      LT(x, W[k])       = Df(x)^T W_i               linear in W
    jvp_jvp  Q(x, A[k], B[k])  = D2f(x)[A_i, B_i]          bilinear
    jvp_vjp  S(x, U[k], W[k])  = d/dx(Df(x)^T W_i) . U_i   bilinear

A deserialized ``Exported`` only knows reverse mode, so each artifact is bound
through one JAX primitive (``dxserve_export_call``, the artifact being a
parameter) that carries its own rules, closed under every transformation up to
second order:

* JVP     f -> L;  L -> Q (w.r.t. x) + L;  LT -> S (w.r.t. x) + LT;
          Q, S are bilinear in their linear inputs (w.r.t. x: third order, refused).
* transpose (linear inputs only)  L <-> LT;  Q w.r.t. A -> S(x, B, ct),
          w.r.t. B -> S(x, A, ct);  S w.r.t. U -> S(x, ct, W), w.r.t. W -> Q(x, U, ct).
          (This uses the symmetry of the second derivative, D2f[a, b] = D2f[b, a].)
* vmap    batching only linear inputs folds the vmapped axis into ``k``: one call
          of the batched artifact; batching ``x`` or a context falls back to
          ``lax.map`` (a sequential loop over the batch).
* jit     the primitive lowers to the artifact's ``Exported.call``.

So ``g = load_exported(bundle).fn`` takes ``(x, *contexts)`` and works with
jit, grad, vjp, jvp, linearize, linear_transpose, vmap, jacfwd, jacrev, hessian
and all second-order compositions (forward-over-reverse, reverse-over-forward,
reverse-over-reverse, forward-over-forward). Third-order derivatives raise.
Contexts are never differentiated (a non-zero context tangent raises).

A forward-only bundle (``modes: ["forward"]``, for a function whose reverse mode the
client could not trace) has no ``vjp`` and ``jvp_vjp``: jvp, linearize, jacfwd and
forward-over-forward work, and any transposition (reverse mode) raises an
``UnsupportedOperatorError`` naming what the function serves, when it is traced.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jex
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from dxcontract import dtypes
from dxcontract.bundle import MODES, artifacts_for, bundle_modes, split_bundle
from dxcontract.errors import (
    DtypeMismatchError,
    InvalidExportError,
    ShapeMismatchError,
    UnsupportedOperatorError,
)
from dxcontract.keys import dtype_name as key_dtype_name
from dxcontract.platforms import export_platform
from dxserve.core.arity import wrong_count
from dxserve.frameworks.jax.loops import unbounded_loops

__all__ = [
    "ALLOWED_CUSTOM_CALL_TARGETS",
    "DEFAULT_MAX_BUNDLE_BYTES",
    "LoadedExport",
    "example_args",
    "exercise",
    "load_exported",
    "server_platform",
]

DEFAULT_MAX_BUNDLE_BYTES = 64 << 20  # 64 MiB
MAX_LEAVES = 4096

# -- custom calls -------------------------------------------------------------
# Only targets that jax itself emits for common ops on CPU and CUDA and whose
# backward compatibility jax guarantees (a subset of
# jax._src.export._export._CUSTOM_CALL_TARGETS_GUARANTEED_STABLE). Notably refused:
# host callbacks (pure_callback / io_callback / debug.print), Triton and Pallas
# kernels, tf.call_tf_function, TPU kernels and any user-registered FFI target.
_LAPACK = [
    f"lapack_{p}{op}_ffi"
    for op, prefixes in {
        "potrf": "sdcz",
        "geqrf": "sdcz",
        "getrf": "sdcz",
        "gesdd": "sdcz",
        "geev": "sdcz",
        "gehrd": "sdcz",
        "gees": "sdcz",
        "trsm": "sdcz",
        "gtsv": "sdcz",
    }.items()
    for p in prefixes
] + [
    "lapack_sorgqr_ffi", "lapack_dorgqr_ffi", "lapack_cungqr_ffi", "lapack_zungqr_ffi",
    "lapack_ssyevd_ffi", "lapack_dsyevd_ffi", "lapack_cheevd_ffi", "lapack_zheevd_ffi",
    "lapack_ssytrd_ffi", "lapack_dsytrd_ffi", "lapack_chetrd_ffi", "lapack_zhetrd_ffi",
]  # fmt: skip
_CUDA = [
    "cu_lu_pivots_to_permutation", "cusolver_getrf_ffi",
    "cusolver_geqrf_ffi", "cusolver_orgqr_ffi",
    "cusolver_potrf_ffi", "cusolver_syevd_ffi",
    "cusolver_gesvd_ffi", "cusolver_gesvdj_ffi",
    "cusolver_sytrd_ffi", "cusparse_gtsv2_ffi",
    "cu_threefry2x32_ffi",
]  # fmt: skip
_GENERIC = [
    "shape_assertion",  # shape-polymorphism checks
    "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape",  # sharding annotations
    "AllocateBuffer",  # lax.empty
    "stablehlo.dynamic_reduce_window", "stablehlo.dynamic_rng_bit_generator",
    "stablehlo.dynamic_top_k",
]  # fmt: skip
ALLOWED_CUSTOM_CALL_TARGETS: frozenset[str] = frozenset(_LAPACK + _CUDA + _GENERIC)

# ops that talk to the host or other devices: refused
_FORBIDDEN_OPS = (
    "stablehlo.infeed", "stablehlo.outfeed", "stablehlo.send", "stablehlo.recv",
    "stablehlo.all_reduce", "stablehlo.all_gather", "stablehlo.all_to_all",
    "stablehlo.collective_permute", "stablehlo.reduce_scatter",
    "stablehlo.collective_broadcast",
)  # fmt: skip

_CC_PRETTY = re.compile(r'stablehlo\.custom_call\s+@("(?:[^"\\]|\\.)*"|[A-Za-z0-9_.$\-]+)')
_CC_GENERIC = re.compile(r'call_target_name\s*=\s*"((?:[^"\\]|\\.)*)"')
_CC_ANY = re.compile(r"stablehlo\.custom_call\b")


def custom_call_targets(mlir_text: str) -> set[str]:
    """Custom-call targets named in a StableHLO module's text.

    Raises ``ValueError`` when some custom call's target cannot be read.
    """
    names = [m.strip('"') for m in _CC_PRETTY.findall(mlir_text)]
    generic = _CC_GENERIC.findall(mlir_text)
    if len(names) + len(generic) < len(_CC_ANY.findall(mlir_text)):
        raise ValueError("a custom call whose target cannot be read")
    return set(names) | set(generic)


def server_platform() -> str:
    """This process's default platform in ``jax.export`` terms (``gpu`` -> ``cuda``)."""
    return export_platform(jax.devices()[0].platform)


def jax_version() -> str:
    """The version of JAX that reads bundles here (an export gate's pass records it)."""
    return jax.__version__


# ----------------------------------------------------------------------------
# artifacts + primitive
# ----------------------------------------------------------------------------
class _Artifacts:
    """The deserialized exports of one bundle. Hashed by identity (primitive param)."""

    def __init__(
        self, exps: dict[str, Any], nx: int, nc: int, ny: int, name: str,
        modes: tuple[str, ...] = MODES,
    ):
        self.exps = exps
        self.modes = modes
        self.nx, self.nc, self.ny = nx, nc, ny
        self.name = name
        self.primal = exps["primal"]
        #: the output leaves the derivative maps cover: the floating-point ones (integer
        #: outputs, a has_aux function's counts, are carried along, not differentiated)
        self.live = [
            i for i, a in enumerate(self.primal.out_avals) if dtypes.is_inexact(a.dtype)
        ]
        self.poly = any(jex.is_symbolic_dim(d) for a in self.primal.in_avals for d in a.shape)
        self._y_cache: dict[Any, list[jax.core.ShapedArray]] = {}
        self.constraints: list[Any] = []  # parsed symbolic constraints (from the manifest)

    def __repr__(self) -> str:
        return f"<dxserve export {self.name}>"

    def y_avals(self, xc_avals: list[Any]) -> list[Any]:
        """Output avals of the primal for these (x, contexts) avals."""
        if not self.poly:
            return [jax.core.ShapedArray(a.shape, a.dtype) for a in self.primal.out_avals]
        key = tuple((tuple(a.shape), _dtype(a.dtype)) for a in xc_avals)
        hit = self._y_cache.get(key)
        if hit is None:
            specs = [jax.ShapeDtypeStruct(s, d) for s, d in key]
            out = jax.eval_shape(lambda *a: self.call("primal", a), *specs)
            hit = [jax.core.ShapedArray(o.shape, o.dtype) for o in out]
            self._y_cache[key] = hit
        return hit

    def call(self, kind: str, args: Any) -> list[Any]:
        exp = self.exps[kind]
        if kind == "primal":
            a, kw = self.primal.in_tree.unflatten(list(args))
            return jax.tree_util.tree_leaves(exp.call(*a, **kw))
        return list(exp.call(*args))


dx_export_p = Primitive("dxserve_export_call")
dx_export_p.multiple_results = True

# number of linear input groups per artifact, and what each group is (x-like or y-like)
_LINEAR = {
    "primal": (),
    "jvp": ("x",),
    "vjp": ("y",),
    "jvp_jvp": ("x", "x"),
    "jvp_vjp": ("x", "y"),
}
_OUT = {"primal": "y", "jvp": "y", "vjp": "x", "jvp_jvp": "y", "jvp_vjp": "x"}


def _split(args: Any, kind: str, h: _Artifacts):
    """flat args -> (x leaves, [linear groups], context leaves)."""
    args = list(args)
    xs = args[: h.nx]
    pos = h.nx
    groups = []
    for what in _LINEAR[kind]:
        n = h.nx if what == "x" else len(h.live)
        groups.append(args[pos : pos + n])
        pos += n
    cs = args[pos:]
    assert len(cs) == h.nc, (kind, len(args))
    return xs, groups, cs


def _bind(kind: str, h: _Artifacts, xs, groups, cs) -> list[Any]:
    """Bind the primitive; a zero-size batch short-circuits to empty results. A map the
    bundle does not carry (reverse mode's, in a forward-only one) raises here, as the
    transformation that needs it is traced."""
    if kind not in h.exps:
        raise _forward_only(h)
    if groups:
        k = groups[0][0].shape[0]
        if k == 0:
            avals = _abstract_eval(*map(jax.typeof, [*xs, *sum(groups, []), *cs]),
                                   kind=kind, h=h)  # fmt: skip
            return [jnp.zeros(a.shape, a.dtype) for a in avals]
    return dx_export_p.bind(*xs, *[v for g in groups for v in g], *cs, kind=kind, h=h)


def _impl(*args, kind: str, h: _Artifacts):
    return h.call(kind, args)


def _abstract_eval(*avals, kind: str, h: _Artifacts):
    xs, groups, cs = _split(avals, kind, h)
    if _OUT[kind] == "x":
        base = [jax.core.ShapedArray(a.shape, a.dtype) for a in xs]
    else:
        base = h.y_avals([*xs, *cs])
    if kind == "primal":
        return base
    if _OUT[kind] == "y":
        base = [base[i] for i in h.live]
    k = groups[0][0].shape[0]
    return [jax.core.ShapedArray((k, *a.shape), a.dtype) for a in base]


def _is_zero(t) -> bool:
    return type(t) is ad.Zero


def _inst(ts) -> list[Any]:
    return [ad.instantiate_zeros(t) for t in ts]


def _bcast(vals, k):
    return [jnp.broadcast_to(v, (k, *jnp.shape(v))) for v in vals]


def _add(a, b):
    if a is None:
        return b
    return [u + v for u, v in zip(a, b, strict=True)]


def _third_order(h: _Artifacts):
    return UnsupportedOperatorError(
        f"uploaded export {h.name!r} provides derivatives up to order 2; "
        "a third-order derivative was requested",
        field="backend",
    )


def _forward_only(h: _Artifacts) -> UnsupportedOperatorError:
    return UnsupportedOperatorError(
        f"uploaded export {h.name!r} carries forward mode only (its reverse mode did not "
        "trace when it was exported): pullback by JAX, 'jax-reverse' and forward-over-"
        "reverse are not available. Supported: value, derivative, second_derivative, "
        "gradient, jacobian, pushforward, hvp and hessian with 'jax-forward' (second order "
        '{"type":"second-order","outer":"jax-forward","inner":"jax-forward"}) or \'auto\'; '
        "pullback with 'finite-differences' or 'auto'",
        field="backend",
    )


def _jvp_rule(primals, tangents, *, kind: str, h: _Artifacts):
    xs, groups, cs = _split(primals, kind, h)
    dxs, dgroups, dcs = _split(tangents, kind, h)
    if not all(_is_zero(t) for t in dcs):
        raise UnsupportedOperatorError(
            f"contexts of uploaded export {h.name!r} are not differentiable", field="contexts"
        )
    out = _bind(kind, h, xs, groups, cs)
    dx_live = not all(_is_zero(t) for t in dxs)
    live = [not all(_is_zero(t) for t in g) for g in dgroups]
    acc = None
    if kind == "primal":
        if dx_live:
            t = [jnp.expand_dims(v, 0) for v in _inst(dxs)]
            pushed = iter(v[0] for v in _bind("jvp", h, xs, [t], cs))
            acc = [  # an integer output's tangent: a symbolic zero (float0)
                next(pushed) if i in h.live else ad.Zero(jax.typeof(o).to_tangent_aval())
                for i, o in enumerate(out)
            ]
    elif kind in ("jvp", "vjp"):
        (g,), (dg,) = groups, dgroups
        k = g[0].shape[0]
        if dx_live:
            dx_b = _bcast(_inst(dxs), k)
            if kind == "jvp":  # d/dx Df(x)T = D2f[T, dx]
                acc = _bind("jvp_jvp", h, xs, [g, dx_b], cs)
            else:  # d/dx Df(x)^T W . dx = S(x, dx, W)
                acc = _bind("jvp_vjp", h, xs, [dx_b, g], cs)
        if live[0]:
            acc = _add(acc, _bind(kind, h, xs, [_inst(dg)], cs))
    else:  # bilinear second-order maps
        if dx_live:
            raise _third_order(h)
        g0, g1 = groups
        if live[0]:
            acc = _add(acc, _bind(kind, h, xs, [_inst(dgroups[0]), g1], cs))
        if live[1]:
            acc = _add(acc, _bind(kind, h, xs, [g0, _inst(dgroups[1])], cs))
    if acc is None:
        acc = [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in out]
    return out, acc


def _transpose_rule(cts, *args, kind: str, h: _Artifacts):
    xs, groups, cs = _split(args, kind, h)
    if kind == "primal" or any(ad.is_undefined_primal(v) for v in [*xs, *cs]):
        raise NotImplementedError(
            f"dxserve export {h.name}: transpose of {kind!r} with respect to a non-linear input"
        )
    undefined = [any(ad.is_undefined_primal(v) for v in g) for g in groups]
    if sum(undefined) != 1:
        raise NotImplementedError(f"dxserve export {h.name}: {kind!r} is not linear here")
    # zero cotangents: nothing flows back
    if all(_is_zero(c) for c in cts):
        return [None] * len(args)
    avals = _abstract_eval(
        *[v.aval if ad.is_undefined_primal(v) else jax.typeof(v) for v in args],
        kind=kind,
        h=h,
    )
    ct = [
        jnp.zeros(a.shape, a.dtype) if _is_zero(c) else c for c, a in zip(cts, avals, strict=True)
    ]
    which = undefined.index(True)
    if kind == "jvp":
        res = _bind("vjp", h, xs, [ct], cs)
    elif kind == "vjp":
        res = _bind("jvp", h, xs, [ct], cs)
    elif kind == "jvp_jvp":  # <Q(a, b), ct> = <a, S(b, ct)> = <b, S(a, ct)>
        other = groups[1 - which]
        res = _bind("jvp_vjp", h, xs, [other, ct], cs)
    else:  # jvp_vjp: <S(u, w), z> = <u, S(z, w)> = <w, Q(u, z)>
        u, w = groups
        res = (
            _bind("jvp_vjp", h, xs, [ct, w], cs)
            if which == 0
            else _bind("jvp_jvp", h, xs, [u, ct], cs)
        )
    out: list[Any] = [None] * h.nx
    for i, g in enumerate(groups):
        out += list(res) if i == which else [None] * len(g)
    return out + [None] * h.nc


def _batch_rule(vals, dims, *, kind: str, h: _Artifacts):
    size = next(v.shape[d] for v, d in zip(vals, dims, strict=True) if d is not None)
    xs, groups, cs = _split(vals, kind, h)
    xd, gd, cd = _split(dims, kind, h)
    if groups and all(d is None for d in [*xd, *cd]):
        # only linear inputs batched: fold the vmapped axis into k (one call)
        new_groups = []
        k = None
        for g, ds in zip(groups, gd, strict=True):
            ng = []
            for v, d in zip(g, ds, strict=True):
                v = jnp.broadcast_to(v, (size, *v.shape)) if d is None else jnp.moveaxis(v, d, 0)
                k = v.shape[1]
                ng.append(v.reshape((size * k, *v.shape[2:])))
            new_groups.append(ng)
        outs = _bind(kind, h, xs, new_groups, cs)
        return [o.reshape((size, k, *o.shape[1:])) for o in outs], [0] * len(outs)
    # x or a context batched: a sequential loop over the batch
    moved = [v if d is None else jnp.moveaxis(v, d, 0) for v, d in zip(vals, dims, strict=True)]
    idx = [i for i, d in enumerate(dims) if d is not None]

    def body(batched):
        full = list(moved)
        for i, v in zip(idx, batched, strict=True):
            full[i] = v
        return tuple(_bind(kind, h, *_split(full, kind, h)))

    outs = jax.lax.map(body, [moved[i] for i in idx])
    return list(outs), [0] * len(outs)


dx_export_p.def_impl(_impl)
dx_export_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[dx_export_p] = _jvp_rule
ad.primitive_transposes[dx_export_p] = _transpose_rule
batching.primitive_batchers[dx_export_p] = _batch_rule
mlir.register_lowering(dx_export_p, mlir.lower_fun(_impl, multiple_results=True))


def _eval_dim(e: Any, env: dict[str, int]) -> int | None:
    if isinstance(e, int):
        return e
    try:
        return int(e._evaluate(env))
    except Exception:
        return None


# ----------------------------------------------------------------------------
# the user-facing callable
# ----------------------------------------------------------------------------
def _make_fn(h: _Artifacts) -> Callable[..., Any]:
    """``g(x, *contexts)`` over the artifacts ``h``: checks its arguments against the
    export's signature, then binds the primal (whose rules make it differentiable)."""
    in_tree = h.primal.in_tree
    out_tree = h.primal.out_tree
    n_contexts = len(in_tree.children()[0].children()) - 1  # in_tree: ((x, *contexts), {})

    def g(x, *contexts):
        if len(contexts) != n_contexts:
            raise wrong_count(f"export {h.name!r}", n_contexts, n_contexts, len(contexts))
        leaves, tree = jax.tree_util.tree_flatten(((x, *contexts), {}))
        if tree != in_tree:
            raise ShapeMismatchError(
                f"arguments have structure {tree}, the export expects {in_tree}", field="x"
            )
        leaves = _checked_leaves(h, leaves)
        outs = _bind("primal", h, leaves[: h.nx], [], leaves[h.nx :])
        return jax.tree_util.tree_unflatten(out_tree, outs)

    g.__name__ = h.name
    g.__qualname__ = h.name
    return g


def _checked_leaves(h: _Artifacts, leaves: list[Any]) -> list[Any]:
    """The argument ``leaves`` as arrays, checked against the primal's input avals;
    raises ``DtypeMismatchError`` or ``ShapeMismatchError``."""
    dims: dict[str, int] = {}  # symbolic dimension -> its size in these arguments
    out = []
    for i, (v, a) in enumerate(zip(leaves, h.primal.in_avals, strict=True)):
        out.append(_checked_leaf(i, v, a, "x" if i < h.nx else "contexts", dims))
    if h.poly:
        _check_symbolic(h, out, dims)
    return out


def _checked_leaf(i: int, v: Any, a: Any, where: str, dims: dict[str, int]) -> Any:
    """Leaf ``i`` as an array of aval ``a``'s dtype and shape; the sizes of ``a``'s
    symbolic dimensions named by one symbol are recorded in (and checked against)
    ``dims``."""
    if isinstance(v, int | float) and not isinstance(v, bool):
        v = jnp.asarray(v, dtype=a.dtype)
    elif not isinstance(v, jax.Array | jax.core.Tracer):
        v = np.asarray(v)
    if _dtype(v.dtype) != _dtype(a.dtype):
        raise DtypeMismatchError(
            f"leaf {i} has dtype {_dtype_name(v.dtype)}, the export expects "
            f"{_dtype_name(a.dtype)}",
            field=where,
        )
    shape = tuple(np.shape(v))
    ok = len(shape) == len(a.shape)
    for s, e in zip(shape, a.shape, strict=True) if ok else ():
        if jex.is_symbolic_dim(e):
            name = str(e)
            if name.isidentifier():
                ok = ok and dims.setdefault(name, s) == s and s >= 1
        else:
            ok = ok and s == e
    if not ok:
        raise ShapeMismatchError(
            f"leaf {i} has shape {shape}, the export expects "
            f"({', '.join(str(d) for d in a.shape)})" + (f" with {dims}" if dims else ""),
            field=where,
        )
    return jnp.asarray(v)


def _check_symbolic(h: _Artifacts, leaves: list[Any], env: dict[str, int]) -> None:
    """Compound dims (``2*n``) and the export's constraints, before lowering.

    Uses JAX's symbolic-expression evaluator (``_evaluate``, private); where
    it is unavailable the check is skipped and JAX's own shape assertions
    report the problem when the call is lowered.
    """
    for i, (v, a) in enumerate(zip(leaves, h.primal.in_avals, strict=True)):
        for j, e in enumerate(a.shape):
            if jex.is_symbolic_dim(e):
                want = _eval_dim(e, env)
                if want is not None and want != v.shape[j]:
                    raise ShapeMismatchError(
                        f"leaf {i} dimension {j} is {v.shape[j]}, the export expects "
                        f"{e} = {want} with {env}",
                        field="x" if i < h.nx else "contexts",
                    )
    for c in h.constraints:
        v1, v2 = _eval_dim(c.e1, env), _eval_dim(c.e2, env)
        if v1 is None or v2 is None:
            continue
        if (v1 == v2) if c.cmp.name == "EQ" else (v1 >= v2):
            continue
        raise ShapeMismatchError(
            f"the argument shapes ({env}) violate the export's constraint {c.debug_str!r}",
            field="x",
        )


# ----------------------------------------------------------------------------
# loading + validation
# ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LoadedExport:
    fn: Callable[..., Any]
    """``g(x, *contexts)``: an ordinary JAX-transformable callable."""
    signature: dict[str, Any]
    """The bundle manifest (format, versions, platforms, signature, artifacts)."""
    platforms: tuple[str, ...]
    modes: tuple[str, ...] = MODES
    """The modes the bundle carries: ``("forward", "reverse")`` or ``("forward",)``."""
    custom_call_targets: frozenset[str] = frozenset()
    nbytes: int = 0
    artifacts: Any = dataclasses.field(default=None, repr=False, compare=False)
    """The deserialized exports (``_Artifacts``): their avals give example shapes."""
    unbounded_loops: int = 0
    """Loops of its artifacts with no static trip count (see ``loops``)."""


def _bad(detail: str) -> InvalidExportError:
    return InvalidExportError(detail, field="export")


def _skeleton(spec: Any) -> Any:
    """Rebuild a pytree of placeholder leaves from the manifest's JSON tree spec."""
    if not isinstance(spec, dict) or len(spec) not in (1, 2):
        raise ValueError("bad tree node")
    if "none" in spec:
        return None
    if "dict" in spec:
        if not isinstance(spec["dict"], dict):
            raise ValueError("bad dict node")
        return {str(k): _skeleton(v) for k, v in spec["dict"].items()}
    if "list" in spec:
        return [_skeleton(v) for v in _as_list(spec["list"])]
    if "tuple" in spec:
        return tuple(_skeleton(v) for v in _as_list(spec["tuple"]))
    if "shape" in spec and "dtype" in spec:
        return (tuple(str(d) for d in _as_list(spec["shape"])), str(spec["dtype"]))
    raise ValueError("bad tree node")


def _as_list(v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise ValueError("expected a list")
    return v


def _is_leaf(v: Any) -> bool:
    return isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], str)


def _aval_key(a: Any) -> tuple[tuple[str, ...], str]:
    return (tuple(str(d) for d in a.shape), _dtype_name(a.dtype))


def _is_key(dtype: Any) -> bool:
    """Is ``dtype`` a typed PRNG key's (``key<fry>``), which numpy cannot read?"""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _dtype(dtype: Any) -> Any:
    """A dtype to compare and hash: numpy's, or a typed key's own."""
    return dtype if _is_key(dtype) else np.dtype(dtype)


def _dtype_name(dtype: Any) -> str:
    """numpy's name, or a typed key's wire dtype (``"key<threefry2x32>"``), as manifests
    write them."""
    return key_dtype_name(dtype) if _is_key(dtype) else np.dtype(dtype).name


def _example_leaf(shape: tuple, dtype: Any) -> Any:
    """A leaf of an example call: 0.5 for floating point, 0 for integers, key 0 for keys."""
    if _is_key(dtype):
        impl = dtype._impl  # the key's implementation (JAX keeps it on the dtype)
        words = np.zeros((*shape, *impl.key_shape), np.uint32)
        return jax.random.wrap_key_data(words, impl=impl)
    return np.full(shape, 0.5 if dtypes.is_inexact(dtype) else 0, dtype=dtype)


@functools.cache
def _x64_dtypes() -> frozenset[str]:
    return frozenset({"float64", "int64", "uint64", "complex128"})


def load_exported(
    bundle: bytes,
    *,
    platform: str | None = None,
    max_bytes: int = DEFAULT_MAX_BUNDLE_BYTES,
    allowed_custom_calls: frozenset[str] | set[str] = ALLOWED_CUSTOM_CALL_TARGETS,
) -> LoadedExport:
    """Validate an uploaded bundle and wrap it into ``LoadedExport.fn``.

    Raises ``InvalidExportError(field="export")`` for anything that cannot run
    here: not a bundle, corrupt, unknown format version, too large, no lowering
    for ``platform`` (default: this process's platform), a serialization or
    calling-convention version this jax cannot read, side effects, several
    devices, a custom call outside ``allowed_custom_calls``, host/collective ops,
    64-bit dtypes without ``jax_enable_x64``, or a manifest that disagrees with
    the exports it describes.
    """
    manifest, blobs = _open_bundle(bundle, max_bytes)
    platform = export_platform(platform) if platform else server_platform()
    m = _read_manifest(manifest)
    if platform not in m.platforms:
        raise _bad(
            f"the export has lowerings for {list(m.platforms)} but this server runs on "
            f"{platform!r}; export again with platforms including {platform!r}"
        )
    if not (0 < m.nx <= MAX_LEAVES and 0 <= m.nc <= MAX_LEAVES and 0 < m.ny <= MAX_LEAVES):
        raise _bad("leaf counts out of range")

    modes = bundle_modes(manifest)  # checked by split_bundle
    exps: dict[str, Any] = {}
    targets: set[str] = set()
    loops = 0
    for art in artifacts_for(modes):
        exps[art] = _deserialize(art, blobs[art], manifest)
        found, unbounded = _check_artifact(art, exps[art], m.platforms, allowed_custom_calls)
        targets |= found
        loops += unbounded
    _check_signatures(exps, m)

    h = _Artifacts(exps, m.nx, m.nc, m.ny, m.name, modes)
    h.constraints = _constraints(manifest)
    fn = _make_fn(h)
    #: the service never runs such a function on its event loop (see ``worker``)
    fn.dx_unbounded_loops = loops  # type: ignore[attr-defined]
    return LoadedExport(
        fn=fn,
        signature=manifest,
        platforms=m.platforms,
        modes=modes,
        custom_call_targets=frozenset(targets),
        nbytes=len(bundle),
        artifacts=h,
        unbounded_loops=loops,
    )


def _open_bundle(bundle: Any, max_bytes: int) -> tuple[dict[str, Any], dict[str, bytes]]:
    """``(manifest, blobs)`` of the container ``bundle`` of at most ``max_bytes``."""
    if not isinstance(bundle, bytes | bytearray | memoryview):
        raise _bad(f"the export must be bytes, got {type(bundle).__name__}")
    if len(bundle) > max_bytes:
        raise _bad(f"the export is {len(bundle)} bytes; the limit is {max_bytes}")
    try:
        return split_bundle(bytes(bundle))
    except ValueError as e:
        raise _bad(str(e)) from None


@dataclasses.dataclass(frozen=True)
class _Manifest:
    """What ``load_exported`` reads of a manifest: platforms, leaf counts, the pytree
    skeletons of x, the contexts and the output, the batch dimension's name."""

    platforms: tuple[str, ...]
    nx: int
    nc: int
    ny: int
    x_sk: Any
    c_sk: list[Any]
    y_sk: Any
    batch_dim: str
    name: str


def _read_manifest(manifest: dict[str, Any]) -> _Manifest:
    """The fields ``load_exported`` needs of ``manifest``; malformed ones are refused."""
    try:
        platforms = tuple(str(p) for p in _as_list(manifest.get("platforms")))
        sig = manifest["signature"]
        nx, nc, ny = (int(sig[k]) for k in ("n_x_leaves", "n_context_leaves", "n_output_leaves"))
        return _Manifest(
            platforms=platforms,
            nx=nx, nc=nc, ny=ny,
            x_sk=_skeleton(sig["x"]),
            c_sk=[_skeleton(c) for c in _as_list(sig["contexts"])],
            y_sk=_skeleton(sig["output"]),
            batch_dim=str(manifest.get("batch_dim", "")),
            name=str(manifest.get("function_name", "export"))[:200],
        )
    except (KeyError, TypeError, ValueError) as e:
        raise _bad(f"malformed manifest: {e}") from None


def _deserialize(art: str, blob: bytes, manifest: dict[str, Any]) -> Any:
    """Artifact ``art``'s ``Exported``, in a calling convention this jax supports."""
    try:
        exp = jex.deserialize(bytearray(blob))
    except Exception as e:  # flatbuffer / MLIR errors come in many types
        raise _bad(
            f"artifact {art!r} cannot be read by this server's jax {jax.__version__} "
            f"(exported with jax {manifest.get('jax_version')!r}): "
            f"{type(e).__name__}: {str(e)[:300]}"
        ) from None
    ccv = exp.calling_convention_version
    lo, hi = (
        jex.minimum_supported_calling_convention_version,
        jex.maximum_supported_calling_convention_version,
    )
    if not lo <= ccv <= hi:
        raise _bad(
            f"artifact {art!r} uses calling convention {ccv}; this server's jax "
            f"{jax.__version__} supports {lo}..{hi}"
        )
    return exp


def _check_artifact(
    art: str, exp: Any, platforms: tuple[str, ...], allowed_custom_calls: frozenset[str] | set[str]
) -> tuple[set[str], int]:
    """Refuse what ``exp`` may not do here (other platforms, several devices, effects,
    disabled checks, custom calls not in ``allowed_custom_calls``, host or collective
    ops); returns its custom-call targets and how many loops it has with no static
    trip count."""
    if tuple(exp.platforms) != platforms:
        raise _bad(f"artifact {art!r} is lowered for {exp.platforms}, manifest says {platforms}")
    if exp.nr_devices != 1:
        raise _bad(f"artifact {art!r} needs {exp.nr_devices} devices; only 1 is supported")
    if exp.ordered_effects or exp.unordered_effects:
        raise _bad(f"artifact {art!r} has side effects")
    if exp.disabled_safety_checks:
        raise _bad(f"artifact {art!r} was exported with disabled safety checks")
    try:
        text = exp.mlir_module()
        found = custom_call_targets(text)
        unbounded = unbounded_loops(text)
    except Exception as e:
        raise _bad(f"artifact {art!r}: cannot inspect the module: {str(e)[:300]}") from None
    bad = sorted(found - set(allowed_custom_calls))
    if bad:
        raise _bad(f"artifact {art!r} uses custom calls that are not allowed here: {bad}")
    for op in _FORBIDDEN_OPS:
        if re.search(re.escape(op) + r"\b", text):
            raise _bad(f"artifact {art!r} uses {op}, which is not allowed")
    return found, unbounded


def load_float64(bundle: bytes, **options: Any) -> LoadedExport:
    """``load_exported(bundle, **options)`` in 64-bit mode (this thread only), as dxserve
    runs an export: a float64 export loads as float64 whether or not the process turned
    64-bit mode on globally."""
    with jax.enable_x64(True):
        return load_exported(bundle, **options)


def check_bundle(bundle: bytes, platform: str, refuse_loops: bool) -> list[str]:
    """Everything a server will do with ``bundle``, once, in 64-bit mode: load it for
    ``platform``, refuse unbounded loops (``refuse_loops``; before running it: it might
    not end), and ``exercise`` it where it runs on the CPU. The maps run; raises what
    loading (``InvalidExportError``) or running raises."""
    with jax.enable_x64(True):
        loaded = load_exported(bundle, platform=platform)
        if refuse_loops:
            refuse_unbounded_loops(loaded)
        return exercise(loaded) if "cpu" in loaded.platforms else []


def refuse_unbounded_loops(loaded: LoadedExport) -> None:
    """``InvalidExportError`` when ``loaded`` has a loop with no static trip count."""
    if loaded.unbounded_loops:
        raise _bad(
            f"the export has {loaded.unbounded_loops} loop(s) whose trip count depends on "
            "its data (a lax.while_loop, or a fori_loop with a traced bound); nothing could "
            "stop one that never ends, so this server refuses them. Export loops with bounds "
            "known when exporting (lax.fori_loop with int bounds, lax.scan), or ask the "
            "operator to set DXSERVE_EXPORT_UNBOUNDED_LOOPS=allow"
        )


def _check_signatures(exps: dict[str, Any], m: _Manifest) -> None:
    """The manifest must describe the exports exactly: the primal's structure, shapes
    and dtypes, and each derivative map's signature for its role."""
    primal = exps["primal"]
    _check_primal_signature(primal, m)
    xk = [_aval_key(a) for a in primal.in_avals[: m.nx]]
    ck = [_aval_key(a) for a in primal.in_avals[m.nx :]]
    yk = [_aval_key(a) for a in primal.out_avals]

    def kb(keys):
        return [((m.batch_dim, *s), d) for s, d in keys]

    yd = [k for k in yk if dtypes.is_inexact(k[1])]  # what the derivative maps cover
    expect = {
        "jvp": (xk + kb(xk) + ck, kb(yd)),
        "vjp": (xk + kb(yd) + ck, kb(xk)),
        "jvp_jvp": (xk + kb(xk) + kb(xk) + ck, kb(yd)),
        "jvp_vjp": (xk + kb(xk) + kb(yd) + ck, kb(xk)),
    }
    for art, (ins, outs) in expect.items():
        e = exps.get(art)
        if e is None:  # a mode the bundle does not carry
            continue
        if [_aval_key(a) for a in e.in_avals] != ins or [_aval_key(a) for a in e.out_avals] != outs:
            raise _bad(f"artifact {art!r} does not have the signature its role requires")
    for _, d in xk:
        if not dtypes.is_inexact(d):
            raise _bad(f"x must be floating point (real, complex or bfloat16), found {d}")
    if not yd:
        raise _bad("no output is floating point (real, complex or bfloat16)")
    if not jax.config.jax_enable_x64 and any(d in _x64_dtypes() for _, d in xk + ck + yk):
        raise _bad("the export uses 64-bit dtypes but this server runs without jax_enable_x64")


def _check_primal_signature(primal: Any, m: _Manifest) -> None:
    """The primal's pytrees, shapes, dtypes and leaf counts are the manifest's."""
    tu = jax.tree_util
    try:
        want_tree = tu.tree_structure(((m.x_sk, *m.c_sk), {}), is_leaf=_is_leaf)
        want_in = tu.tree_leaves(((m.x_sk, *m.c_sk), {}), is_leaf=_is_leaf)
        want_out = tu.tree_leaves(m.y_sk, is_leaf=_is_leaf)
        want_out_tree = tu.tree_structure(m.y_sk, is_leaf=_is_leaf)
    except Exception as e:
        raise _bad(f"malformed signature: {e}") from None
    if want_tree != primal.in_tree or want_out_tree != primal.out_tree:
        raise _bad("the manifest's signature does not match the exported function's structure")
    if [_aval_key(a) for a in primal.in_avals] != want_in or [
        _aval_key(a) for a in primal.out_avals
    ] != want_out:
        raise _bad("the manifest's shapes/dtypes do not match the exported function")
    if len(want_in) != m.nx + m.nc or len(want_out) != m.ny:
        raise _bad("the manifest's leaf counts do not match its signature")


def _constraints(manifest: dict[str, Any]) -> list[Any]:
    """The manifest's symbolic constraints, parsed (empty without any)."""
    try:
        constraints = [str(c) for c in _as_list(manifest.get("constraints", []))]
        if constraints:
            scope = jex.SymbolicScope(constraints)
            return list(getattr(scope, "_explicit_constraints", ()))
    except Exception as e:
        raise _bad(f"bad symbolic constraints {manifest.get('constraints')!r}: {e}") from None
    return []


# ----------------------------------------------------------------------------
# exercising a loaded export (the export gate runs this in a child process)
# ----------------------------------------------------------------------------
_EXAMPLE_SIZES = (3, 2, 4, 8, 16, 1)


def example_args(loaded: LoadedExport) -> tuple[Any, tuple[Any, ...]] | None:
    """``(x, contexts)`` of the export's declared shapes, filled with 0.5 (or 0 for integers).

    A symbolic dimension takes the first size in ``_EXAMPLE_SIZES`` (every symbol alike)
    that satisfies the export's constraints; None when none does.
    """
    h = loaded.artifacts
    avals = h.primal.in_avals
    for n in _EXAMPLE_SIZES:
        env = {
            str(v): n
            for a in avals
            for d in a.shape
            if jex.is_symbolic_dim(d)
            for v in d._get_vars()
        }
        shapes = [tuple(_eval_dim(d, env) for d in a.shape) for a in avals]
        if any(s is None or s < 0 for shape in shapes for s in shape):
            continue
        leaves = [_example_leaf(s, a.dtype) for s, a in zip(shapes, avals, strict=True)]
        (x, *contexts), _ = jax.tree_util.tree_unflatten(h.primal.in_tree, leaves)
        try:
            jax.eval_shape(loaded.fn, x, *contexts)
        except ShapeMismatchError:
            continue
        return x, tuple(contexts)
    return None


def exercise(loaded: LoadedExport) -> list[str]:
    """Compile and run, once, what the server will: value, JVP, VJP, both second-order maps
    (those of the modes the bundle carries).

    Uses ``example_args``; returns the names of the maps run (empty when no example
    shape satisfies the constraints). Raises whatever compiling or running raises.
    """
    found = example_args(loaded)
    if found is None:
        return []
    x, contexts = found
    fn = loaded.fn

    def f(z, *c):
        return fn(z, *c)

    y = jax.eval_shape(f, x, *contexts)
    w = jax.tree_util.tree_map(lambda s: np.ones(s.shape, s.dtype), y)

    def jvp(z, t, *c):
        return jax.jvp(lambda u: f(u, *c), (z,), (t,))[1]

    def vjp(z, ct, *c):
        return jax.vjp(lambda u: f(u, *c), z)[1](ct)[0]

    maps = {
        "primal": (f, (x, *contexts)),
        "jvp": (jvp, (x, x, *contexts)),
        "vjp": (vjp, (x, w, *contexts)),
        # forward over forward reaches jvp_jvp; forward over reverse, jvp_vjp
        "jvp_jvp": (lambda z, t, *c: jax.jvp(lambda u: jvp(u, t, *c), (z,), (t,))[1],
                    (x, x, *contexts)),
        "jvp_vjp": (lambda z, t, ct, *c: jax.jvp(lambda u: vjp(u, ct, *c), (z,), (t,))[1],
                    (x, x, w, *contexts)),
    }  # fmt: skip
    carried = [name for name in maps if name in loaded.artifacts.exps]
    for name in carried:
        run, args = maps[name]
        jax.block_until_ready(jax.jit(run)(*args))
    return carried
