"""JAX specs (``jax.ShapeDtypeStruct``) of the values a served function is described from.

``dxserve.server.describe`` shows a function's shapes without running it: its example's
values, its annotations' shapes (a named dimension symbolic, as ``jax.export`` writes
one) and its output's, by abstract evaluation. The specs it traces with are JAX's,
made here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import export

from dxserve.frameworks import host_array
from dxserve.frameworks.jax import keys

__all__ = ["spec_tree", "symbolic_specs"]


def spec_tree(value: Any) -> Any:
    """``value``'s tree with each leaf a ``jax.ShapeDtypeStruct`` of its shape and dtype:
    a spec stays itself, a torch tensor is read on the host, a ``KeyArray`` becomes JAX's
    key (whose dtype is the spec's), anything else is read by numpy."""

    def leaf(v: Any) -> Any:
        if isinstance(v, jax.ShapeDtypeStruct):
            return v
        host = host_array(v)  # a torch tensor: read on the host
        if host is not None:
            return jax.ShapeDtypeStruct(host.shape, host.dtype)
        v = keys.to_jax(v)
        a = v if keys.is_jax_key(v) else np.asarray(v)
        return jax.ShapeDtypeStruct(a.shape, a.dtype)

    return jax.tree_util.tree_map(leaf, value)


def symbolic_specs(pending: Sequence[tuple[Sequence[str], Any]]) -> list[Any]:
    """One ``jax.ShapeDtypeStruct`` per ``(dims, dtype)`` of ``pending`` (one function's
    annotated arguments): a dimension of digits is its size, a name a ``jax.export``
    symbol, the same name the same symbol (symbols compare equal only within one scope,
    so all are made together). Raises what ``jax.export`` raises for a name it cannot
    parse."""
    names = list(dict.fromkeys(d for dims, _ in pending for d in dims if not d.isdigit()))
    symbols = (
        dict(zip(names, export.symbolic_shape(", ".join(names)), strict=True)) if names else {}
    )
    return [
        jax.ShapeDtypeStruct(tuple(int(d) if d.isdigit() else symbols[d] for d in dims), dtype)
        for dims, dtype in pending
    ]
