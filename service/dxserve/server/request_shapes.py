"""Bounds on a request's shape, checked before anything is traced or compiled.

What an operator's compile time grows with is the number of arrays its program
takes and returns: XLA's compile time grows faster than linearly in them
(bench/compile_shapes.py). A batch of tangents is stacked into one argument per
leaf (``packing``), so their count is only a dimension; the leaves of x, of the
contexts and of one tangent are the program's arguments. So a request is refused
(422 ``request-shape``, naming the field and the setting) when

* it sends more than ``max_tangents`` tangents (``DXSERVE_MAX_TANGENTS``);
* x, the contexts and its largest tangent hold more than ``max_leaves`` pytree leaves
  together (``DXSERVE_MAX_LEAVES``);
* any of them nests pytree nodes deeper than ``max_depth`` (``DXSERVE_MAX_DEPTH``;
  an array is depth 0, a dict of arrays 1).

The walk stops as soon as a bound is passed, so it costs at most ``max_leaves``
steps per tangent (far less than decoding those leaves took).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dxcontract.encodings.common import is_array_list
from dxcontract.errors import RequestShapeError

#: Defaults (``Settings``): the largest accepted request compiles in a few seconds
#: (bench/compile_shapes.py prints the worst case).
MAX_TANGENTS = 4096
MAX_LEAVES = 4096
MAX_DEPTH = 16


@dataclass(frozen=True)
class ShapeLimits:
    """Most tangents, pytree leaves and pytree depth one request may send."""

    max_tangents: int = MAX_TANGENTS
    max_leaves: int = MAX_LEAVES
    max_depth: int = MAX_DEPTH

    def check(self, x: Any, tangents: Any, contexts: Any) -> None:
        """Raise ``RequestShapeError`` naming the field past a bound (see the module)."""
        if tangents is not None and hasattr(tangents, "__len__") and len(tangents) > self.max_tangents:
            raise RequestShapeError(
                f"{len(tangents):,} tangents, over the limit of {self.max_tangents:,} "
                "(DXSERVE_MAX_TANGENTS); send them in several requests",
                field="tangents", limit="max_tangents", maximum=self.max_tangents,
                count=len(tangents),
            )
        left = self.max_leaves
        left -= self._leaves(x, "x", left)
        for i, context in enumerate(contexts if isinstance(contexts, tuple | list) else ()):
            left -= self._leaves(context, f"contexts[{i}]", left)
        for i, tangent in enumerate(tangents if isinstance(tangents, tuple | list) else ()):
            self._leaves(tangent, f"tangents[{i}]", left)  # each, beside x and the contexts

    def _leaves(self, tree: Any, field: str, left: int) -> int:
        """Leaves of ``tree`` (at most ``left``; past it, or past the depth: refused)."""
        count, stack = 0, [(tree, 0)]
        while stack:
            node, depth = stack.pop()
            if isinstance(node, dict):
                children: Any = node.values()
            elif isinstance(node, tuple) or (isinstance(node, list) and not is_array_list(node)):
                children = node
            elif node is None:  # an empty node
                continue
            else:
                count += 1
                if count > left:
                    raise RequestShapeError(
                        f"x, the contexts and one tangent hold more than "
                        f"{self.max_leaves:,} pytree leaves together (counted up to {field}), "
                        f"over the limit of {self.max_leaves:,} (DXSERVE_MAX_LEAVES); "
                        "compile time grows with them: send fewer, larger arrays",
                        field=field, limit="max_leaves", maximum=self.max_leaves,
                    )
                continue
            if depth >= self.max_depth and children:
                raise RequestShapeError(
                    f"{field} nests pytree nodes deeper than {self.max_depth} levels "
                    "(DXSERVE_MAX_DEPTH); flatten the structure",
                    field=field, limit="max_depth", maximum=self.max_depth,
                )
            stack.extend((child, depth + 1) for child in children)
        return count
