"""How fast expression functions are checked: accepted ones up to the length cap, and
the refusals a hostile caller sends (each must be refused before anything evaluates).

Cells: the median of 7 runs of ``compile_expression`` (parse, check, build; no JAX
tracing), in milliseconds.

    .venv/bin/python bench/expressions.py [--save '']
"""

from __future__ import annotations

import argparse
import time

from _common import Tee, machine_line, markdown_table, median

from dxcontract.errors import InvalidExpressionError
from dxserve.frameworks.jax.expressions import MAX_EXPRESSION_CHARS, compile_expression

RUNS = 7


def _longest_accepted() -> tuple[str, list[str]]:
    name = "v" * 60
    source = " + ".join([f"jnp.sin({name}[0]) * 2.5"] * 200)
    return source[: source.rfind(" + ", 0, MAX_EXPRESSION_CHARS)], [name]


CASES: list[tuple[str, str, list[str]]] = [
    (f"accepted: {len(_longest_accepted()[0])} chars, 200 terms", *_longest_accepted()),
    ("refused: 1,000,000 chars", "x" * 1_000_000, ["x"]),
    ("refused: 9**9**9**9**9", "9**9**9**9**9", ["x"]),
    ("refused: __import__('os')", "__import__('os')", ["x"]),
    ("refused: 'a' * 10**9", "'a' * 10**9", ["x"]),
    ("refused: nesting 1,000 deep", "(" * 1000 + "x" + ")" * 1000, ["x"]),
]


def _time(source: str, args: list[str]) -> tuple[float, str]:
    timings, outcome = [], "accepted"
    for _ in range(RUNS):
        start = time.perf_counter()
        try:
            compile_expression(source, args)
        except InvalidExpressionError:
            outcome = "422"
        timings.append(time.perf_counter() - start)
    return median(timings), outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", default="expressions-cpu.md",
                        help="file under bench/results/ for the table ('' to only print)")
    opts = parser.parse_args()
    out = Tee()
    out("# Checking expression functions (bench/expressions.py)")
    out()
    out(machine_line() + f"; median of {RUNS} runs")
    out()
    rows = []
    for label, source, args in CASES:
        seconds, outcome = _time(source, args)
        rows.append([label, outcome, f"{seconds * 1e3:.2f}"])
    out(markdown_table(["expression", "answer", "ms"], rows))
    if opts.save:
        out.save(opts.save)


if __name__ == "__main__":
    main()
