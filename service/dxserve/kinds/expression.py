"""The ``expression`` kind: a whitelisted ``jnp`` expression (``dxserve.expressions``).

Body fields: ``expression`` (the text) and ``args`` (its argument names, the first
one differentiated). Content: the canonical JSON ``{"args", "expression"}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field

from . import BaseKind, Built

__all__ = ["EXPRESSION", "ExpressionKind", "expression_content"]


def expression_content(expression: str, args: Sequence[str]) -> bytes:
    """Canonical bytes of an expression, so identical registrations hash alike."""
    return json.dumps({"args": list(args), "expression": expression}, sort_keys=True).encode()


class ExpressionKind(BaseKind):
    name = "expression"
    summary = "an expression"
    fields = {
        "expression": (str | None, Field(None, description="Whitelisted jnp expression")),
        "args": (list[str], Field(default_factory=lambda: ["x"], description="First is active")),
    }
    example = {
        "name": "sq",
        "expression": "jnp.sum(jnp.sin(x) ** 2)",
        "args": ["x"],
        "description": "sum of squared sines",
    }

    def validate(self, values: Mapping[str, Any]) -> bytes:
        from ..expressions import compile_expression

        # Compiling checks the text and the names (InvalidExpressionError, field
        # "expression" or "args") before anything is stored; it is cheap.
        compile_expression(values["expression"], values["args"])
        return expression_content(values["expression"], values["args"])

    def build(self, content: bytes) -> Built:
        from ..expressions import compile_expression

        spec = json.loads(content)
        fn = compile_expression(spec["expression"], spec["args"])
        signature = {"args": spec["args"], "expression": spec["expression"]}
        return Built(fn, signature, probe(fn, len(spec["args"])))


#: Shapes tried, every argument alike, to find one an expression takes (``probe``).
PROBE_SHAPES = ((3,), (), (3, 3))


def probe(fn: Any, n_args: int) -> dict[str, Any] | None:
    """What ``describe`` shows of an expression: the first of ``PROBE_SHAPES`` (float64
    arrays, every argument alike) it evaluates on, with its output; None if none does."""
    import jax
    import numpy as np

    from ..describe import facts
    from ..precision import float64_scope

    for shape in PROBE_SHAPES:
        args = [jax.ShapeDtypeStruct(shape, np.float64)] * n_args
        with float64_scope():
            found = facts(fn, args, "probe")
        if found is not None:
            return found
    return None


EXPRESSION = ExpressionKind()
