"""What wraps the family for a call: batches of points, auxiliary outputs, cotangents.

``batch_axis=0`` makes x (every leaf) and the tangents carry a leading axis of
independent points, contexts shared: the family is checked and built for one point
and the operator is vmapped over the points inside the one compiled call.

``has_aux=True``: f returns a pair ``(output, aux)``. The family is checked and built
for ``output`` alone (``primary``) and aux, f's second element at x, is one more result
(``with_aux``), never differentiated; under ``batch_axis=0`` it is stacked like the
others. Compiled, XLA computes f's shared work at x once for both.

A ``cotangent`` (shaped like f's output) makes an HVP family operator differentiate
the scalar ``<cotangent, f>`` (``with_cotangent``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dxcontract import dtypes
from dxcontract.errors import (
    FIX,
    DtypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
    UnsupportedOperatorError,
)
from dxcontract.operators import AUX, OPERATORS
from dxserve.core.preparation.inputs import Tree, as_tree, probe
from dxserve.core.wrt import dotted
from dxserve.frameworks import Framework, framework_of, get_framework


def check_batch_axis(batch_axis: Any) -> None:
    """Refuse a ``batch_axis`` other than None or 0 (``InvalidArgumentError`` naming it)."""
    if batch_axis is None or (type(batch_axis) is int and batch_axis == 0):
        return
    raise InvalidArgumentError(
        f"batch_axis must be 0 (x and the tangents lead with an axis of points) or null "
        f"(one point), got {batch_axis!r}",
        field="batch_axis",
    )


def batch_points(x: Tree, tangents: tuple | None, framework: Framework | None = None) -> int:
    """B, the leading dimension every leaf of x and of each tangent must share."""
    framework = framework or get_framework()
    points = None
    for leaf in framework.leaves(x):
        shape = np.shape(leaf)
        if not shape:
            raise ShapeMismatchError(
                "batch_axis=0 needs every leaf of x to lead with an axis of points; got a scalar",
                field="x",
            )
        if points is None:
            points = shape[0]
        elif shape[0] != points:
            raise ShapeMismatchError(
                f"batch_axis=0: the leaves of x disagree on the number of points "
                f"({points} and {shape[0]})",
                field="x",
            )
    if points is None:
        raise ShapeMismatchError("batch_axis=0 needs x to hold an array", field="x")
    if points == 0:
        raise ShapeMismatchError("batch_axis=0 with no points in x; send at least one", field="x")
    for i, t in enumerate(tangents or ()):
        for leaf in framework.leaves(t):
            shape = np.shape(leaf)
            if not shape or shape[0] != points:
                got = f"{shape[0]} points" if shape else "no axis of points"
                raise ShapeMismatchError(
                    f"batch_axis=0: tangents[{i}] has {got} where x has {points}; with a "
                    "batch every tangent leads with the same axis of points as x",
                    field=f"tangents[{i}]",
                )
    return points


def _first_point(framework: Framework, tree: Tree) -> Tree:
    """The first point of a batched pytree (a view for numpy leaves)."""
    return framework.tree_map(lambda v: v[0, ...], tree)


def over_points(run: Callable, batched_tangents: bool, framework: Framework) -> Callable:
    """``run(x, tangents, contexts) -> dict`` over a leading axis of points on x (and the
    tangents), results stacked on that axis, contexts shared: ``framework.vmap`` (for
    JAX one XLA program; for an eager framework a loop, point by point)."""
    return framework.vmap(run, in_axes=(0, 0 if batched_tangents else None, None))


def refuse_aux(operator: str) -> None:
    """``UnsupportedOperatorError`` (field ``has_aux``) for an operator without aux."""
    if not OPERATORS[operator].aux:
        raise UnsupportedOperatorError(
            f"{operator} takes no has_aux: it returns a pattern, no values to return aux "
            "beside; call it without has_aux, on a function returning its output alone",
            field="has_aux",
        )


def split_aux(f: Callable, y: Tree) -> tuple[Tree, Tree]:
    """``(output, aux)``: the probed output of a has_aux function, which must be a pair
    (a tuple or list of two, as JAX's ``has_aux`` takes); ``ShapeMismatchError``
    (field ``function``) naming the function and the fix otherwise."""
    if isinstance(y, tuple | list) and len(y) == 2:
        return y[0], y[1]
    if isinstance(y, tuple | list):
        got = f"a {type(y).__name__} of {len(y)}"
    elif hasattr(y, "shape"):
        got = f"an array of shape {tuple(y.shape)}"
    else:
        got = f"a {type(y).__name__}"
    name = function_name(f)
    raise ShapeMismatchError(
        f"has_aux needs {name} to return a pair (output, aux), but it returns {got}; "
        f"return a tuple (output, aux) from {name}, or call it without has_aux ({FIX})",
        field="function",
        fix={"has_aux": False},
    )


def function_name(f: Callable) -> str:
    """How messages name ``f``: its registered or Python name, an expression's text."""
    info = getattr(f, "__dxserve__", None)
    name = getattr(info, "name", None) or getattr(f, "__name__", None)
    if isinstance(name, str) and name != "<lambda>":
        return f"the function {name!r}"
    source = getattr(f, "source", None)
    if isinstance(source, str):
        return f"the expression {source[:80]!r}"
    return "the function"


def primary(f: Callable) -> Callable:
    """``f``'s output without its aux: what a has_aux operator differentiates."""

    def output(x: Tree, *contexts: Any) -> Tree:
        return f(x, *contexts)[0]

    return output


def with_aux(run: Callable, f: Callable) -> Callable:
    """``run`` (a family's builder output) with ``AUX``, f's aux at x, added to its
    results: computed at the primal point alone, never differentiated."""

    def run_with_aux(x: Tree, tangents: Any, contexts: tuple) -> dict:
        return {**run(x, tangents, contexts), AUX: f(x, *contexts)[1]}

    return run_with_aux


def with_cotangent(
    f: Callable, x: Any, contexts: Sequence[Any], cotangent: Any
) -> tuple[Callable, tuple]:
    """``(<cotangent, f>, contexts)`` for an HVP family operator given ``cotangent``
    (shaped like f's output): its gradient is f's pullback of it, its HVP the
    derivative of that pullback. ``ShapeMismatchError`` (field ``cotangent``) when the
    cotangent is not shaped like f's output."""
    contexts = tuple(contexts)
    cotangent = as_tree(cotangent)
    fw = framework_of(f)
    for leaf in fw.leaves(cotangent):  # numbers only: a key (or text) is no cotangent
        dtype = str(getattr(leaf, "dtype", "object")).removeprefix("torch.")
        try:
            numeric = not dtype.startswith("key<") and dtypes.is_inexact(dtype)
        except TypeError:
            numeric = False
        if not numeric:
            raise DtypeMismatchError(
                f"cotangent must hold floating-point arrays shaped like the function's "
                f"output, got dtype {dtype}",
                field="cotangent",
            )
    _, y = probe(f, as_tree(x), tuple(as_tree(c) for c in contexts), fw)
    got, want = fw.flatten(cotangent), fw.flatten(y)
    if got[1] != want[1] or any(
        tuple(np.shape(a)) != tuple(b.shape) for a, b in zip(got[0], want[0], strict=True)
    ):
        shapes = [tuple(b.shape) for b in want[0]]
        raise ShapeMismatchError(
            f"cotangent must be shaped like the function's output ({want[1]}, shapes "
            f"{shapes}), got {got[1]} with shapes {[tuple(np.shape(a)) for a in got[0]]}",
            field="cotangent",
        )
    return dotted(f), (cotangent, *contexts)
