"""Serialize a JAX function for upload: ``export_function(fn, *example_args) -> bytes``.

A deserialized :class:`jax.export.Exported` runs, and supports reverse mode up to
its ``vjp_order``, but it has no ``jvp`` and no batching rule. So the client
exports, besides ``f`` itself, the derivative maps the server needs to rebuild a
function that every JAX transformation accepts (see ``dxserve.frameworks.jax.exported``):

=============  ===========================  ======================================
artifact       signature (flat leaves)      meaning (``k`` = symbolic batch size)
=============  ===========================  ======================================
``primal``     ``(x, *c) -> y``             ``f`` itself, original pytree structure
``jvp``        ``(x, T[k], c) -> Y[k]``     ``Y_i = Df(x) T_i``
``vjp``        ``(x, W[k], c) -> X[k]``     ``X_i = Df(x)^T W_i``
``jvp_jvp``    ``(x, A[k], B[k], c) -> Y``  ``Y_i = D2f(x)[A_i, B_i]``
``jvp_vjp``    ``(x, U[k], W[k], c) -> X``  ``X_i = d/dx (Df(x)^T W_i) . U_i``
=============  ===========================  ======================================

All derivative artifacts take flat leaves (x leaves, then the linear leaves with a
leading batch axis ``k``, then the context leaves) and return flat leaves.

A function whose reverse mode does not trace (a ``lax.while_loop`` iterated to
convergence, say) is exported with the forward artifacts only (``primal``, ``jvp``,
``jvp_jvp``; the manifest's ``modes`` is ``["forward"]``), and a warning says why: the
server then serves what forward mode can and refuses pullbacks and reverse mode.

The bundle's container (no pickle, no source code) is the contract's
(``dxcontract.bundle``), which the server reads.

JAX is imported lazily inside the functions: the client package imports without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dxcontract.bundle import (
    ARTIFACTS,
    BATCH_DIM,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAGIC,
    MODES,
    bundle_signature,
    format_version_for,
    pack,
    split_bundle,
    tree_spec,
)
from dxcontract.platforms import export_platform

__all__ = [
    "ARTIFACTS",
    "BATCH_DIM",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAGIC",
    "MODES",
    "ReverseModeWarning",
    "bundle_signature",
    "export_function",
    "split_bundle",
    "tree_spec",
]


# ----------------------------------------------------------------------------
# export
# ----------------------------------------------------------------------------
def _as_spec(leaf: Any) -> Any:
    import jax
    import numpy as np

    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):  # a typed key: its own
            return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype)
        return jax.ShapeDtypeStruct(tuple(leaf.shape), np.dtype(leaf.dtype))
    arr = np.asarray(leaf)
    if arr.dtype == object:
        raise ValueError(f"example argument leaf {leaf!r} is not an array")
    return jax.ShapeDtypeStruct(arr.shape, arr.dtype)


def export_function(
    fn: Callable[..., Any],
    *example_args: Any,
    platforms: Sequence[str] = ("cpu",),
    polymorphic_shapes: Any = None,
    constraints: Sequence[str] = (),
) -> bytes:
    """Export ``fn(x, *contexts)`` and its derivative maps into one bundle.

    Args:
      fn: a JAX-traceable function ``f(x, *contexts) -> y``; ``x`` (a pytree of
        real floating arrays) is the differentiated input, contexts pass through.
      example_args: ``x`` then the contexts: arrays, ShapeDtypeStructs or
        pytrees (dicts with string keys, lists, tuples) of them. Only their shapes
        and dtypes are used. 64-bit dtypes are exported as such (x64 is switched
        on while exporting when any example leaf is 64-bit).
      platforms: lowering platforms, e.g. ``("cpu",)`` or ``("cpu", "cuda")``.
      polymorphic_shapes: as ``jax.export.symbolic_args_specs``: a pytree prefix
        of ``example_args`` of shape strings, e.g. ``("(n,)",)`` or
        ``({"w": "(n, m)", "b": "(m,)"}, "(p, n)")``. ``None``: concrete shapes.
      constraints: symbolic-shape constraints, e.g. ``("n >= 2",)``.

    Returns:
      the bundle bytes (see the module docstring).
    """
    import jax
    import numpy as np

    if not example_args:
        raise ValueError("export_function needs at least the example x")
    platforms = tuple(str(p) for p in platforms)
    if not platforms:
        raise ValueError("platforms must not be empty")
    platforms = tuple(export_platform(p) for p in platforms)

    concrete = jax.tree_util.tree_map(_as_spec, tuple(example_args))
    leaves = jax.tree_util.tree_leaves(concrete)
    wide = any(np.dtype(s.dtype).itemsize == 8 for s in leaves)
    ctx = jax.enable_x64(True) if wide else _nullcontext()
    with ctx:
        return _export(fn, concrete, platforms, polymorphic_shapes, tuple(constraints))


def _tracer_errors() -> tuple[type[Exception], ...]:
    import jax

    errors = jax.errors
    return (errors.ConcretizationTypeError, errors.TracerArrayConversionError,
            errors.TracerIntegerConversionError, errors.UnexpectedTracerError)


def _untraceable_message(fn: Callable[..., Any], exc: Exception) -> str:
    """Why ``fn`` cannot be uploaded, and the two ways that work instead."""
    name = getattr(fn, "__name__", repr(fn))
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"client.register cannot export {name!r}: JAX cannot trace it "
        f"({type(exc).__name__}: {first}). Only functions written with jax.numpy can be "
        "uploaded. Register the formula with client.register_expression(name, "
        "'jnp....'), or put the function in a module on the server with "
        "@dxserve.function and start it with `dxserve serve --functions <module>`."
    )


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _export(fn, concrete, platforms, polymorphic_shapes, constraints) -> bytes:
    """The bundle of ``fn`` at the example specs ``concrete`` (x64 already set as needed)."""
    import jax
    from jax import export as jex

    def export(f, *args):
        return jex.export(jax.jit(f), platforms=platforms)(*args)

    scope = jex.SymbolicScope(constraints)
    specs = _input_specs(concrete, polymorphic_shapes, scope)
    x_spec, c_specs = specs[0], tuple(specs[1:])
    # validate structures early (also produces the JSON signature)
    signature = {
        "x": tree_spec(x_spec, "x"),
        "contexts": [tree_spec(c, f"contexts[{i}]") for i, c in enumerate(c_specs)],
    }
    x_leaves, x_tree = jax.tree_util.tree_flatten(x_spec)
    c_leaves, c_tree = jax.tree_util.tree_flatten(c_specs)
    _check_x_leaves(x_leaves)

    primal = _export_primal(export, fn, x_spec, c_specs)
    signature["output"] = tree_spec(_output_spec(primal), "output")
    signature.update(n_x_leaves=len(x_leaves), n_context_leaves=len(c_leaves),
                     n_output_leaves=len(primal.out_avals))
    from dxcontract.dtypes import is_inexact

    # integer outputs (a has_aux function's counts) are not differentiated: the derivative
    # maps cover the floating-point outputs only, in order
    live = [i for i, a in enumerate(primal.out_avals) if is_inexact(a.dtype)]
    maps = _FlatMaps(fn, x_tree, c_tree, len(x_leaves), len(c_leaves), live)
    (k,) = jex.symbolic_shape(BATCH_DIM, scope=scope)
    derivatives, modes = _export_derivatives(
        export, maps, k, x_leaves, [primal.out_avals[i] for i in live], c_leaves
    )
    exps = {"primal": primal, **derivatives}
    _check_exports(exps)
    blobs = {name: bytes(exps[name].serialize(vjp_order=0)) for name in ARTIFACTS if name in exps}
    manifest = _manifest(fn, primal, platforms, signature, specs, constraints, modes)
    return pack(manifest, blobs)


def _input_specs(concrete: tuple, polymorphic_shapes: Any, scope: Any) -> tuple:
    """The specs the functions are exported at: ``concrete``, or its symbolic shapes."""
    from jax import export as jex

    if polymorphic_shapes is None:
        return concrete
    return jex.symbolic_args_specs(concrete, polymorphic_shapes, scope=scope)


def _check_x_leaves(x_leaves: list[Any]) -> None:
    """Raise ``ValueError`` unless ``x`` has leaves, all floating point (real, complex or
    bfloat16, as module functions take them)."""
    from dxcontract.dtypes import is_inexact

    if not x_leaves:
        raise ValueError("x has no array leaves")
    for i, s in enumerate(x_leaves):
        if not is_inexact(s.dtype):
            raise ValueError(
                f"x leaf {i} has dtype {s.dtype}; the differentiated input must be "
                "floating point (pass integer data as a context)"
            )


def _export_primal(export: Callable, fn: Callable, x_spec: Any, c_specs: tuple) -> Any:
    """``fn`` exported with the user's pytree structure; its outputs checked to be real
    floating point. A function JAX cannot trace raises ``TypeError``."""

    try:
        primal = export(fn, x_spec, *c_specs)
    except _tracer_errors() as exc:
        raise TypeError(_untraceable_message(fn, exc)) from exc
    from dxcontract.dtypes import is_inexact

    if not any(is_inexact(a.dtype) for a in primal.out_avals):
        raise ValueError(
            "no output leaf is floating point (real, complex or bfloat16): nothing to "
            "differentiate (integer outputs, a has_aux function's counts say, are carried "
            "along, not differentiated)"
        )
    return primal


def _output_spec(primal: Any) -> Any:
    """The primal's output as a pytree of ShapeDtypeStructs."""
    import jax

    leaves = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in primal.out_avals]
    return jax.tree_util.tree_unflatten(primal.out_tree, leaves)


class _FlatMaps:
    """The four derivative maps of ``fn`` over flat leaves: each takes the x leaves, then
    its linear leaves (batched on a leading ``k``), then the context leaves, and returns
    flat leaves (see the module's table)."""

    def __init__(
        self, fn: Callable, x_tree: Any, c_tree: Any, nx: int, nc: int,
        live: list[int] | None = None,
    ) -> None:
        self.fn, self.x_tree, self.c_tree, self.nx, self.nc = fn, x_tree, c_tree, nx, nc
        self.live = live  # the output leaves differentiated (None: all)

    def unpack(self, args: tuple) -> tuple[list, list, list]:
        """flat args -> (x leaves, linear leaves, context leaves)"""
        nx, nc = self.nx, self.nc
        return list(args[:nx]), list(args[nx : len(args) - nc]), list(args[len(args) - nc :])

    def fx_of(self, cs: list) -> Callable[[list], list]:
        """``f`` of the x leaves alone, at the context leaves ``cs``, to flat outputs."""
        import jax

        tu = jax.tree_util
        contexts = tu.tree_unflatten(self.c_tree, cs)

        def fx(xs):
            ys = tu.tree_leaves(self.fn(tu.tree_unflatten(self.x_tree, xs), *contexts))
            return ys if self.live is None else [ys[i] for i in self.live]

        return fx

    def jvp_art(self, *args):
        import jax

        xs, lin, cs = self.unpack(args)
        fx = self.fx_of(cs)
        return tuple(jax.vmap(lambda t: jax.jvp(fx, (xs,), (t,))[1])(lin))

    def vjp_art(self, *args):
        import jax

        xs, lin, cs = self.unpack(args)
        _, pull = jax.vjp(self.fx_of(cs), xs)
        return tuple(jax.vmap(lambda w: pull(w)[0])(lin))

    def jvp_jvp_art(self, *args):
        import jax

        xs, lin, cs = self.unpack(args)
        fx = self.fx_of(cs)
        a_s, b_s = list(lin[: self.nx]), list(lin[self.nx :])

        def one(a, b):
            return jax.jvp(lambda z: jax.jvp(fx, (z,), (a,))[1], (xs,), (b,))[1]

        return tuple(jax.vmap(one)(a_s, b_s))

    def jvp_vjp_art(self, *args):
        import jax

        xs, lin, cs = self.unpack(args)
        fx = self.fx_of(cs)
        u_s, w_s = list(lin[: self.nx]), list(lin[self.nx :])

        def one(u, w):
            return jax.jvp(lambda z: jax.vjp(fx, z)[1](w)[0], (xs,), (u,))[1]

        return tuple(jax.vmap(one)(u_s, w_s))


class ReverseModeWarning(UserWarning):
    """``export_function`` uploads forward mode only: reverse mode does not trace."""


def _export_derivatives(
    export: Callable, maps: _FlatMaps, k: Any, x_leaves: list, y_avals: list, c_leaves: list
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``(artifacts, modes)``: the derivative artifacts, their linear inputs batched on
    the symbolic ``k``, and the modes they make up. The forward maps are required; the
    reverse ones are left out (with a ``ReverseModeWarning``) where they do not trace."""
    import warnings

    import jax

    def kb(avals):
        return [jax.ShapeDtypeStruct((k, *a.shape), a.dtype) for a in avals]

    xs = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in x_leaves]
    ys = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in y_avals]
    cs = list(c_leaves)
    forward = {
        "jvp": export(maps.jvp_art, *xs, *kb(xs), *cs),
        "jvp_jvp": export(maps.jvp_jvp_art, *xs, *kb(xs), *kb(xs), *cs),
    }
    try:
        reverse = {
            "vjp": export(maps.vjp_art, *xs, *kb(ys), *cs),
            "jvp_vjp": export(maps.jvp_vjp_art, *xs, *kb(xs), *kb(ys), *cs),
        }
    except Exception as exc:  # noqa: BLE001 - whatever stops reverse mode, forward stands
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        name = getattr(maps.fn, "__name__", "the function")
        warnings.warn(
            f"{name}: reverse mode does not trace ({type(exc).__name__}: {first[:200]}); "
            "exporting forward mode only: the server serves gradients, Jacobians, "
            "Hessians and pushforwards by forward mode, pullbacks by finite differences "
            "only, and refuses 'jax-reverse'",
            ReverseModeWarning,
            stacklevel=4,
        )
        return forward, ("forward",)
    return {**forward, **reverse}, MODES


def _check_exports(exps: dict[str, Any]) -> None:
    """Raise ``ValueError`` for an artifact the server would refuse: side effects, or
    more than one device."""
    for name, e in exps.items():
        if e.ordered_effects or e.unordered_effects:
            raise ValueError(f"{name}: functions with side effects cannot be exported")
        if e.nr_devices != 1:
            raise ValueError(f"{name}: only single-device functions can be exported")


def _symbolic_dims(specs: Any) -> list[str]:
    """The names of the symbolic dimensions in ``specs``, sorted."""
    import jax
    from jax import export as jex

    return sorted(
        {
            str(v)
            for s in jax.tree_util.tree_leaves(specs)
            for d in s.shape
            if jex.is_symbolic_dim(d)
            for v in d._get_vars()
        }
    )


def _manifest(fn, primal, platforms, signature, specs, constraints, modes) -> dict[str, Any]:
    """The bundle's manifest (see ``dxcontract.bundle``)."""
    import jax

    symbolic = _symbolic_dims(specs)
    return {
        "format": FORMAT_NAME,
        "format_version": format_version_for(modes),
        "modes": list(modes),
        "jax_version": jax.__version__,
        "calling_convention_version": primal.calling_convention_version,
        "platforms": list(platforms),
        "function_name": getattr(fn, "__name__", "fn"),
        "signature": signature,
        "polymorphic": bool(symbolic),
        "symbolic_dims": symbolic,
        "constraints": list(constraints),
        "batch_dim": BATCH_DIM,
        "max_derivative_order": 2,
    }
