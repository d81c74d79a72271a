"""Static trip counts of the loops in a StableHLO module (its printed text).

A ``stablehlo.while`` runs until its condition is false, so an uploaded program can
loop for as long as its data says: no deadline stops XLA once it runs. JAX lowers
``lax.scan`` and ``lax.fori_loop`` with concrete bounds to one shape of loop, whose
trip count is known before it runs::

    %r:3 = stablehlo.while(%iterArg = %c_1, ...)   # the counter starts at a constant
    cond {
      %2 = stablehlo.compare LT, %iterArg, %c_0, SIGNED   # ... below a constant
      stablehlo.return %2
    } do {
      %3 = stablehlo.add %iterArg, %c                     # ... steps by a constant > 0
      stablehlo.return %3, ...

``trip_counts`` finds that shape and nothing else: any other loop (a ``lax.while_loop``
on data, a ``fori_loop`` whose bound is traced) has no static bound, ``None``. The text
is the one this process's JAX prints (``Exported.mlir_module()``), whatever produced the
bundle, so its form is known; anything it does not recognise counts as unbounded.
"""

from __future__ import annotations

import math
import re

__all__ = ["trip_counts", "unbounded_loops"]

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_WHILE_ANY = re.compile(r"stablehlo\.while\b")
_WHILE = re.compile(r"^\s*%[\w#:.]+ = stablehlo\.while\((?P<args>[^)]*)\)")
_ARG = re.compile(r"(%iterArg\w*) = (%[\w#.]+)")
_CONST = re.compile(r"^\s*(%[\w.]+) = stablehlo\.constant dense<(-?\d+)> : tensor<[su]?i\d+>")
_LT = re.compile(r"^\s*(%[\w.]+) = stablehlo\.compare\s+LT, (%iterArg\w*), (%[\w.]+), SIGNED\b")
_RETURN = re.compile(r"^\s*stablehlo\.return ([^:]*)")
_ADD = re.compile(r"^\s*(%[\w.]+) = stablehlo\.add (%[\w.]+), (%[\w.]+) : tensor<[su]?i\d+>")
_FUNC = re.compile(r"^\s*func\.func\b")


def unbounded_loops(mlir_text: str) -> int:
    """How many loops of ``mlir_text`` have no static trip count."""
    return sum(1 for n in trip_counts(mlir_text) if n is None)


def trip_counts(mlir_text: str) -> list[int | None]:
    """One entry per ``stablehlo.while`` of ``mlir_text``: its static trip count, or
    ``None`` when it has none (or its form is not the one recognised)."""
    lines = mlir_text.splitlines()
    depths = _depths(lines)
    found: list[int | None] = []
    func_start = 0
    for i, line in enumerate(lines):
        if _FUNC.match(line):
            func_start = i
        if _WHILE.match(line):
            found.append(_trip_count(lines, depths, func_start, i))
    # a loop printed in a form the pattern above does not match is unbounded too
    found += [None] * (len(_WHILE_ANY.findall(mlir_text)) - len(found))
    return found


def _depths(lines: list[str]) -> list[int]:
    """The brace depth at the start of each line (strings, e.g. locations, left out)."""
    depths, depth = [], 0
    for line in lines:
        depths.append(depth)
        bare = _STRING.sub("", line)
        depth += bare.count("{") - bare.count("}")
    return depths


def _trip_count(lines: list[str], depths: list[int], func_start: int, at: int) -> int | None:
    head = _WHILE.match(lines[at])
    if head is None or at + 1 >= len(lines) or lines[at + 1].strip() != "cond {":
        return None
    args = _ARG.findall(head["args"])
    base = depths[at]
    cond, body, i = [], [], at + 2
    while i < len(lines) and not (depths[i] == base + 1 and lines[i].strip().startswith("} do {")):
        if depths[i] == base + 1:
            cond.append(lines[i])
        i += 1
    i += 1
    while i < len(lines) and not (depths[i] == base + 1 and lines[i].strip().startswith("}")):
        if depths[i] == base + 1:
            body.append(lines[i])
        i += 1
    if i >= len(lines):
        return None
    constants = _constants(lines[func_start:at]) | _constants(cond) | _constants(body)

    ops = [ln for ln in cond if not _CONST.match(ln)]
    if len(ops) != 2:
        return None
    lt, ret = _LT.match(ops[0]), _RETURN.match(ops[1])
    if lt is None or ret is None or ret[1].strip() != lt[1]:
        return None
    counter, limit = lt[2], constants.get(lt[3])
    names = [name for name, _ in args]
    if counter not in names or limit is None:
        return None
    k = names.index(counter)
    start = constants.get(args[k][1])

    returns = [m for m in map(_RETURN.match, body) if m]
    if len(returns) != 1 or start is None:
        return None
    outs = [o.strip() for o in returns[0][1].split(",")]
    if len(outs) != len(names):
        return None
    step = None
    for m in filter(None, map(_ADD.match, body)):
        if m[1] == outs[k] and counter in (m[2], m[3]):
            step = constants.get(m[3] if m[2] == counter else m[2])
    if step is None or step <= 0:
        return None
    return max(0, math.ceil((limit - start) / step))


def _constants(lines: list[str]) -> dict[str, int]:
    return {m[1]: int(m[2]) for m in map(_CONST.match, lines) if m}
