"""How many contexts a function takes, checked before it is traced.

A function is called ``f(x, *contexts)``; a call with too few or too many contexts is
refused naming the first context that is missing or extra (``contexts[k]``), so the
error points at the request field to fix rather than at ``x``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from dxcontract.errors import InvalidArgumentError

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def context_names(f: Callable) -> tuple[list[str], int | None] | None:
    """``(names of the contexts, most contexts or None for any number)`` of ``f(x, ...)``;
    the names are the required ones after x. None when ``f``'s signature is unknown."""
    try:
        params = list(inspect.signature(f).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in _POSITIONAL]
    variadic = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    if not positional:
        return None
    required = [p.name for p in positional[1:] if p.default is inspect.Parameter.empty]
    return required, None if variadic else len(positional) - 1


def wrong_count(
    name: str, wanted: int | Sequence[str], most: int | None, given: int
) -> InvalidArgumentError:
    """The 422 for ``given`` contexts where ``wanted`` (a count, or the names of the
    required ones) and at most ``most`` are taken."""
    names = [] if isinstance(wanted, int) else list(wanted)
    count = wanted if isinstance(wanted, int) else len(names)
    listed = f" ({', '.join(names)})" if names else ""
    takes = f"{count} context{'s' if count != 1 else ''}{listed} after x"
    if given < count:
        which = f" ({names[given]})" if names else ""
        return InvalidArgumentError(
            f"{name} takes {takes}, got {given}: contexts[{given}]{which} is missing",
            field=f"contexts[{given}]",
        )
    extra = most if most is not None else count
    return InvalidArgumentError(
        f"{name} takes {takes}, got {given}: contexts[{extra}] and after are extra",
        field=f"contexts[{extra}]",
    )


def check_contexts(f: Callable, contexts: Sequence[Any]) -> None:
    """Raise ``InvalidArgumentError(field="contexts[k]")`` unless ``f(x, *contexts)`` binds."""
    found = context_names(f)
    if found is None:
        return
    wanted, most = found
    given = len(contexts)
    if given < len(wanted) or (most is not None and given > most):
        name = getattr(f, "__name__", None) or type(f).__name__
        raise wrong_count(name, wanted, most, given)
