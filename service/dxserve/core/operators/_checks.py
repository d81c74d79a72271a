"""Input checks shared by operators; each raises a typed, field-naming error."""

from __future__ import annotations

from typing import Any

import numpy as np

from dxcontract import dtypes
from dxcontract.errors import (
    FIX,
    DtypeMismatchError,
    NotScalarInputError,
    NotScalarOutputError,
    ShapeMismatchError,
    UnsupportedOperatorError,
)
from dxserve.core.preparation import Inputs


def _is_array(tree: Any) -> bool:
    return not isinstance(tree, (dict, list, tuple)) and hasattr(tree, "shape")


def differentiable_x(inputs: Inputs) -> None:
    for leaf in inputs.framework.leaves(inputs.x):
        if not dtypes.is_inexact(leaf.dtype):  # bfloat16 too, which numpy calls no float
            raise DtypeMismatchError(
                f"x must be floating point to be differentiated, got {np.dtype(leaf.dtype).name}; "
                "send floats (or a float dtype) for the active input",
                field="x",
            )


def scalar_output(inputs: Inputs, operator: str) -> None:
    y = inputs.y
    if isinstance(y, tuple | list) and len(y) == 2 and _is_array(y[0]) and y[0].shape == ():
        # (loss, aux), as JAX's has_aux functions return: say how to ask for that
        raise NotScalarOutputError(
            f"{operator} needs a scalar-valued function but it returns a pair (a scalar "
            f"and more); if the second element is auxiliary output, call it with {FIX}",
            field="function", fix={"has_aux": True},
        )
    if not _is_array(y) or y.shape != ():
        shape = y.shape if _is_array(y) else "a pytree"
        raise NotScalarOutputError(
            f"{operator} needs a scalar-valued function but it returns {shape}; "
            "use jacobian or pullback for vector outputs",
            field="function",
        )


def holomorphic_gradient(inputs: Inputs, operator: str) -> None:
    """A complex-valued f has a gradient only as ``jax.grad(holomorphic=True)``'s, ``f'(z)``:
    every leaf of x complex."""
    if np.dtype(inputs.y.dtype).kind != "c":
        return
    for leaf in inputs.framework.leaves(inputs.x):
        if np.dtype(leaf.dtype).kind != "c":
            raise DtypeMismatchError(
                f"{operator} of a complex-valued function needs complex x (its gradient is "
                f"f'(z), as jax.grad(holomorphic=True)), got {np.dtype(leaf.dtype).name}; send "
                "complex x, or use jacobian, derivative or pullback",
                field="x",
            )


def _complex(leaf: Any) -> bool:
    try:
        return np.dtype(leaf.dtype).kind == "c"
    except TypeError:  # a dtype numpy does not know (a typed PRNG key's)
        return False


def complex_jacobian(inputs: Inputs, operator: str) -> None:
    """A Jacobian of complex x is a matrix only where f is holomorphic: refused unless
    the caller says so (``holomorphic=True``, as ``jax.jacfwd`` and ``jax.hessian``
    take it), and then every leaf of x and of f(x) must be complex (as JAX requires)."""
    fw = inputs.framework
    x_leaves, y_leaves = fw.leaves(inputs.x), fw.leaves(inputs.y)
    if not inputs.holomorphic:
        if any(_complex(v) for v in x_leaves):
            other = (
                "hvp, gradient, pushforward or pullback" if operator in ("hessian", "second_derivative")
                else "pushforward or pullback (JAX's jvp and vjp)"
            )
            raise UnsupportedOperatorError(
                f"{operator} of a function of complex x is a complex matrix only where the "
                f"function is holomorphic (then it is f'(z), and J @ t its pushforward); "
                f"declare that with {FIX}, as jax.jacfwd and jax.hessian take it, or use "
                f"{other}, which answer for any function",
                field="holomorphic", fix={"holomorphic": True},
            )
        return
    for what, leaves in (("x", x_leaves), ("f(x)", y_leaves)):
        for leaf in leaves:
            if not _complex(leaf):
                raise DtypeMismatchError(
                    f"holomorphic=True needs every leaf of {what} complex (as JAX's "
                    f"holomorphic=True does), got {np.dtype(leaf.dtype).name}; send complex "
                    f"values, or call {operator} without holomorphic",
                    field="holomorphic",
                )


def scalar_input(inputs: Inputs, operator: str) -> None:
    if not _is_array(inputs.x) or inputs.x.shape != ():
        shape = inputs.x.shape if _is_array(inputs.x) else "a pytree"
        raise NotScalarInputError(
            f"{operator} needs a scalar x, got {shape}; use pushforward or jacobian",
            field="x",
        )


def array_input(inputs: Inputs, operator: str) -> None:
    if not _is_array(inputs.x):
        raise UnsupportedOperatorError(
            f"{operator} of a pytree input is not supported; jacobian and hessian give "
            "blocks of pytrees, gradient, pullback and hvp keep x's structure",
            field="x",
        )


def array_output(inputs: Inputs, operator: str) -> None:
    if not _is_array(inputs.y):
        raise UnsupportedOperatorError(
            f"{operator} of a pytree-valued function is not supported; jacobian gives "
            "its blocks, pullback keeps its structure",
            field="function",
        )


def flat_numbers(tangents: tuple, like: Any, what: str) -> None:
    """One tangent sent unwrapped (``[1, 1, 1]`` for ``[[1, 1, 1]]``): every tangent a
    number where one array is wanted. Refused with the wrapped spelling to send."""
    if not _is_array(like) or like.shape == ():
        return
    if not all(_is_array(t) and t.shape == () for t in tangents):
        return
    shown = [f"{float(np.real(t)):g}" for t in tangents[:8]] + (["..."] if len(tangents) > 8 else [])
    raise ShapeMismatchError(
        f"tangents is a list of tangents, each shaped like {what} {tuple(like.shape)}; "
        f"for one tangent write [[{', '.join(shown)}]]",
        field="tangents",
    )


def tangents_like(inputs: Inputs, like: Any, what: str) -> None:
    """Every tangent must have ``like``'s structure, shapes and dtypes."""
    tangents = inputs.tangents
    if not tangents:
        raise ShapeMismatchError(
            "tangents must be a non-empty batch (a list of tangents, e.g. [t])", field="tangents"
        )
    flatten = inputs.framework.flatten
    want_leaves, want_def = flatten(like)
    flat_numbers(tangents, like, what)
    for i, t in enumerate(tangents):
        got_leaves, got_def = flatten(t)
        field = f"tangents[{i}]"
        if got_def != want_def:
            raise ShapeMismatchError(
                f"tangent structure {got_def} differs from {what}'s {want_def}", field=field
            )
        for g, w in zip(got_leaves, want_leaves, strict=True):
            if tuple(g.shape) != tuple(w.shape):
                raise ShapeMismatchError(
                    f"tangent shape {tuple(g.shape)} differs from {what}'s shape {tuple(w.shape)}",
                    field=field,
                )
            if np.dtype(g.dtype) != np.dtype(w.dtype):
                raise DtypeMismatchError(
                    f"tangent dtype {np.dtype(g.dtype).name} differs from {what}'s dtype "
                    f"{np.dtype(w.dtype).name}",
                    field=field,
                )
