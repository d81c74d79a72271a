"""``holomorphic=True``: the caller's word that f is holomorphic, as JAX's transformations take it.

A Jacobian of complex numbers is one matrix only where f is holomorphic: there ``J = f'(z)``
and ``J @ t`` is the pushforward along t. Elsewhere the pushforward is real-linear, not
complex-linear, and no complex matrix gives it. So, as ``jax.jacfwd`` and ``jax.hessian``
do, ``jacobian``, ``derivative``, ``hessian`` and ``second_derivative`` of complex x are
refused unless the caller declares f holomorphic; with the declaration they answer
``∂f/∂Re z`` (``f'(z)``), and then every leaf of x and of f(x) must be complex, as JAX
requires. A declared function is ``declared(f)``: one wrapper per function (kept while f
lives), so preparations and caches keyed by the function tell the two apart.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

from dxcontract.operators import HOLOMORPHIC_FAMILIES as FAMILIES

__all__ = ["FAMILIES", "declared", "is_declared", "maybe", "undeclared"]

_DECLARED: weakref.WeakKeyDictionary[Callable, Callable] = weakref.WeakKeyDictionary()


def declared(f: Callable) -> Callable:
    """f, declared holomorphic: the same wrapper for the same f (a new one for a
    function that cannot be weakly referenced)."""
    if is_declared(f):
        return f
    try:
        found = _DECLARED.get(f)
    except TypeError:
        found = None
    if found is not None:
        return found

    @functools.wraps(f)
    def holomorphic_f(*args: Any, **kwargs: Any) -> Any:
        return f(*args, **kwargs)

    holomorphic_f.__dxserve_holomorphic__ = f  # type: ignore[attr-defined]
    try:
        _DECLARED[f] = holomorphic_f
    except TypeError:
        pass
    return holomorphic_f


def is_declared(f: Callable) -> bool:
    """Was f declared holomorphic (``declared``)?"""
    return getattr(f, "__dxserve_holomorphic__", None) is not None


def undeclared(f: Callable) -> Callable:
    """The function behind ``declared(f)`` (f itself when not declared)."""
    return getattr(f, "__dxserve_holomorphic__", None) or f


def maybe(f: Callable, holomorphic: bool) -> Callable:
    """``declared(f)`` when ``holomorphic``, else f."""
    return declared(f) if holomorphic else f
