"""Derivatives with respect to any arguments (``wrt``, JAX's ``argnums``).

``select(f, x, contexts, wrt)`` returns ``(g, xs, rest)`` with ``g(xs, *rest) ==
f(x, *contexts)``: the arguments ``wrt`` names (see ``dxcontract.arguments``) become
g's x, the others its contexts. Every operator then differentiates g as it
differentiates any function of x, so the results for several arguments are a tuple,
as ``jax.grad(f, argnums=(0, 1))`` returns them, and the tangents are tuples too.

One ``Selected`` is kept per (function, wrt) (an LRU), so that preps, the server's
caches and prep handles made for it find it again.

``Dotted`` is, for the HVP operators of an array-valued f given a cotangent c
(``preparation.with_cotangent``), the scalar ``<c, f>``, whose gradient is f's pullback
of c and whose HVP is that pullback's derivative in x: second order of array-valued
functions, served.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dxcontract import dtypes
from dxcontract.arguments import Wrt, argument_name, check_wrt, merge, positions, split
from dxcontract.errors import DtypeMismatchError, InvalidArgumentError
from dxcontract.lru import LRU
from dxserve.core.arity import check_contexts
from dxserve.core.functions import FunctionInfo
from dxserve.core.holomorphic import declared, is_declared, undeclared
from dxserve.frameworks import framework_of


class Selected:
    """``g(xs, *rest) = f(*merge(xs, rest))``: ``f`` differentiated in the arguments
    ``wrt`` names. It keeps ``f``'s framework and name (what messages show)."""

    def __init__(self, f: Callable, wrt: Wrt) -> None:
        self.f, self.wrt = f, wrt
        info = getattr(f, "__dxserve__", None)
        name = getattr(info, "name", None) or getattr(f, "__name__", None) or type(f).__name__
        self.__name__ = name
        self.__dxserve__ = FunctionInfo(
            name, getattr(info, "description", ""), None, framework_of(f).name
        )

    def __call__(self, xs: Any, *rest: Any) -> Any:
        return self.f(*merge(xs, rest, self.wrt))

    def __repr__(self) -> str:
        return f"Selected({self.__name__}, wrt={self.wrt!r})"


#: One ``Selected`` per (function, wrt) in use: the key holds ``id(f)``, and an entry
#: is used only while it still wraps that very function.
_SELECTED: LRU[tuple, Selected] = LRU(1024)


def selected(f: Callable, wrt: Wrt) -> Selected:
    """The ``Selected`` of ``f`` and ``wrt`` (the same object while it is kept)."""
    key = (id(f), wrt)
    found = _SELECTED.get(key)
    if found is None or found.f is not f:
        found = Selected(f, wrt)
        _SELECTED.put(key, found)
    return found


def select(
    f: Callable, x: Any, contexts: Sequence[Any], wrt: Any, field: str = "wrt"
) -> tuple[Callable, Any, tuple]:
    """``(g, xs, rest)`` differentiating the arguments ``wrt`` names (``f, x, contexts``
    themselves for None or 0). Refused, naming the argument: a position past the
    arguments, or an argument that is not floating point (integers, keys)."""
    contexts = tuple(contexts)
    check_contexts(f, contexts)  # a missing context is named in f's own numbering
    wrt = check_wrt(wrt, 1 + len(contexts), field)
    if wrt is None or wrt == 0:
        return f, x, contexts
    args = (x, *contexts)
    leaves = framework_of(f).leaves
    for i, k in enumerate(positions(wrt)):
        where = field if isinstance(wrt, int) else f"{field}[{i}]"
        _differentiable(leaves(args[k]), k, where)
    xs, rest = split(args, wrt)
    # a holomorphic declaration is about f: it holds for f in the arguments selected too
    g = selected(undeclared(f), wrt)
    return (declared(g) if is_declared(f) else g), xs, rest


def _differentiable(leaves: list, position: int, field: str) -> None:
    """``DtypeMismatchError`` unless every leaf is floating point (or complex)."""
    for leaf in leaves:
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            dtype = np.asarray(leaf).dtype
        name = str(dtype).removeprefix("torch.")
        try:
            inexact = not name.startswith("key<") and dtypes.is_inexact(name)
        except TypeError:  # a dtype numpy does not know: not one to differentiate
            inexact = False
        if not inexact:
            raise DtypeMismatchError(
                f"{field} names {argument_name(position)}, which holds {name} values: only "
                "floating-point arguments can be differentiated; leave it out of wrt (it is "
                "then held fixed)",
                field=field,
            )


class Dotted:
    """``d(x, c, *contexts) = <c, f(x, *contexts)>``: the scalar whose gradient is f's
    pullback of c and whose HVP is the derivative of that pullback in x (second order of
    an array-valued f, a JVP of its VJP)."""

    def __init__(self, f: Callable) -> None:
        self.f = f
        info = getattr(f, "__dxserve__", None)
        name = getattr(info, "name", None) or getattr(f, "__name__", None) or type(f).__name__
        self.__name__ = name
        self.framework = framework_of(f)
        self.__dxserve__ = FunctionInfo(
            name, getattr(info, "description", ""), None, self.framework.name
        )

    def __call__(self, x: Any, c: Any, *contexts: Any) -> Any:
        y = self.f(x, *contexts)
        leaves = self.framework.leaves
        terms = [(a * b).sum() for a, b in zip(leaves(c), leaves(y), strict=True)]
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        return total

    def __repr__(self) -> str:
        return f"Dotted({self.__name__})"


_DOTTED: LRU[int, Dotted] = LRU(256)


def dotted(f: Callable) -> Dotted:
    """The ``Dotted`` of ``f`` (the same object while it is kept)."""
    found = _DOTTED.get(id(f))
    if found is None or found.f is not f:
        found = Dotted(f)
        _DOTTED.put(id(f), found)
    return found


def refuse_cotangent(operator: str, has_aux: bool = False) -> None:
    """``InvalidArgumentError`` (field ``cotangent``) unless ``operator`` is of the HVP
    family, the operators that take one, without has_aux."""
    from dxcontract.operators import OPERATORS

    if has_aux:
        raise InvalidArgumentError(
            "cotangent with has_aux is not supported: <cotangent, f> needs f's output "
            "alone; call it without has_aux",
            field="cotangent",
        )
    if OPERATORS[operator].family != "hvp":
        raise InvalidArgumentError(
            f"{operator} takes no cotangent: hvp and gradient_and_hvp do (the HVP of "
            "<cotangent, f> for an array-valued f); leave it out",
            field="cotangent",
        )
