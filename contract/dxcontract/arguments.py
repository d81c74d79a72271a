"""Which arguments an operator differentiates: ``wrt``, JAX's ``argnums``.

A function is called ``f(x, *contexts)``; its arguments are numbered as JAX numbers
them, 0 for x and 1, 2, ... for the contexts. ``wrt`` names the arguments an operator
differentiates:

* ``None`` (the default) or ``0``: x alone, as always;
* an integer ``k``: argument k alone; results are shaped like it (tangents too);
* a list or tuple of integers: those arguments, in that order, as one tuple; results
  (and tangents) are tuples with one entry per named argument, as ``jax.grad(f,
  argnums=(0, 1))`` returns them.

The arguments not named are held fixed. ``split`` and ``merge`` move the named
arguments to the front and back; the library and the server differentiate
``g(xs, *rest) = f(x, *contexts)`` for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import InvalidArgumentError

Wrt = int | tuple[int, ...]

__all__ = ["Wrt", "argument_name", "check_wrt", "merge", "positions", "split"]


def argument_name(position: int) -> str:
    """How a message names argument ``position``: ``x`` or ``contexts[k]``."""
    return "x" if position == 0 else f"contexts[{position - 1}]"


def check_wrt(wrt: Any, count: int | None = None, field: str = "wrt") -> Wrt | None:
    """``wrt`` as an int or a tuple of ints (``None`` stays ``None``); with ``count``
    (the number of arguments, x included) each must name one of them.
    ``InvalidArgumentError`` naming ``field`` otherwise."""
    if wrt is None:
        return None
    if isinstance(wrt, bool) or not isinstance(wrt, int | list | tuple):
        raise InvalidArgumentError(
            f"{field} must be an argument's position (0 for x, 1 for contexts[0], ...) or a "
            f"list of them, got {wrt!r}",
            field=field,
        )
    items = (wrt,) if isinstance(wrt, int) else tuple(wrt)
    if not items:
        raise InvalidArgumentError(
            f"{field} is empty: name at least one argument (0 for x, 1 for contexts[0], ...)",
            field=field,
        )
    for i, k in enumerate(items):
        where = field if isinstance(wrt, int) else f"{field}[{i}]"
        if isinstance(k, bool) or not isinstance(k, int):
            raise InvalidArgumentError(
                f"{where} must be an integer position (0 for x, 1 for contexts[0], ...), got {k!r}",
                field=where,
            )
        if k < 0 or (count is not None and k >= count):
            most = "" if count is None else f" (this call has {count}: 0 to {count - 1})"
            raise InvalidArgumentError(
                f"{where} is {k}, which names no argument{most}; 0 is x and k is contexts[k-1]",
                field=where,
            )
    if len(set(items)) != len(items):
        raise InvalidArgumentError(
            f"{field} names an argument twice ({list(items)}); name each once", field=field
        )
    return wrt if isinstance(wrt, int) else items


def positions(wrt: Wrt) -> tuple[int, ...]:
    """The positions ``wrt`` names, in its order."""
    return (wrt,) if isinstance(wrt, int) else tuple(wrt)


def split(args: Sequence[Any], wrt: Wrt) -> tuple[Any, tuple]:
    """``(xs, rest)``: the named arguments (one, or a tuple of them) and the others in
    their order."""
    named = positions(wrt)
    chosen = tuple(args[k] for k in named)
    rest = tuple(a for k, a in enumerate(args) if k not in named)
    return (chosen[0] if isinstance(wrt, int) else chosen), rest


def merge(xs: Any, rest: Sequence[Any], wrt: Wrt) -> list:
    """The arguments ``split`` took apart, back in their positions."""
    chosen = (xs,) if isinstance(wrt, int) else tuple(xs)
    args = list(rest)
    for k, value in sorted(zip(positions(wrt), chosen, strict=True), key=lambda p: p[0]):
        args.insert(k, value)
    return args
