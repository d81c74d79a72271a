"""The ``expression`` kind: a whitelisted ``jnp`` expression (``dxserve.frameworks.jax.expressions``).

Body fields: ``expression`` (the text) and ``args`` (its argument names, the first
one differentiated). Content: the canonical JSON ``{"args", "expression"}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field

from dxserve.server.kinds import BaseKind, Built

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
        from dxserve.frameworks.jax.expressions import compile_expression

        # Compiling checks the text and the names (InvalidExpressionError, field
        # "expression" or "args") before anything is stored; it is cheap.
        compile_expression(values["expression"], values["args"])
        return expression_content(values["expression"], values["args"])

    def build(self, content: bytes) -> Built:
        from dxserve.frameworks.jax.expressions import compile_expression

        spec = json.loads(content)
        fn = compile_expression(spec["expression"], spec["args"])
        signature = {"args": spec["args"], "expression": spec["expression"]}
        return Built(fn, signature, probe(fn, len(spec["args"])))


#: Shapes tried for each argument to find ones an expression takes (``probe``).
PROBE_SHAPES = ((3,), (), (3, 3))
#: With more arguments than this, only shapes that every argument shares are tried.
PROBE_EVERY_COMBINATION = 4


def probe(fn: Any, n_args: int) -> dict[str, Any] | None:
    """What ``describe`` shows of an expression, found by tracing it on float64 arrays
    of ``PROBE_SHAPES``: the first combination of shapes it takes whose output is a
    scalar (so its example request can be a gradient), else the first it takes at all;
    ``operators``, those that some combination it takes allows. None if none works."""
    import itertools

    import numpy as np

    from dxserve.frameworks import get_framework
    from dxserve.server.describe import allowed_operators, facts

    framework = get_framework("jax")  # an expression is written in jnp

    if n_args <= PROBE_EVERY_COMBINATION:
        combos = list(itertools.product(PROBE_SHAPES, repeat=n_args))
    else:
        combos = [(shape,) * n_args for shape in PROBE_SHAPES]
    working = []
    for shapes in combos:
        args = [framework.spec(shape, np.float64) for shape in shapes]
        with framework.precision_scope():
            found = facts(fn, args, "probe")
        if found is not None:
            working.append(found)
    if not working:
        return None
    scalar = [
        f for f in working if isinstance(f["output"], dict) and f["output"].get("shape") == []
    ]
    chosen = dict((scalar or working)[0])
    operators = {op for f in working for op in allowed_operators(f)}
    chosen["operators"] = [op for op in allowed_operators(None) if op in operators]
    return chosen


EXPRESSION = ExpressionKind()
