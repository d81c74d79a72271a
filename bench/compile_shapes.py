"""Compile time against request shape: tangents, pytree leaves, depth.

Each case prepares one operator (``dxserve.core.preparation.prepare``: probe, trace,
compile; for a chunked run also its chunk executable, as the server's compile
threads do) in a fresh Python process, so no cache is warm, and prints the seconds.

1. ``hvp`` of rosenbrock (n = 3) against the number of tangents k, with this tree's
   packed tangents (one argument per leaf, k a dimension: ``packing``) and, given
   ``--base DIR`` (a source tree of the code before, e.g. ``git archive <commit> |
   tar -x -C DIR``), with each tangent an argument of its own.
2. The worst requests the default shape limits accept (``request_shapes``):
   ``DXSERVE_MAX_TANGENTS`` tangents, ``DXSERVE_MAX_LEAVES`` leaves (x a dict of
   arrays beside two contexts), and that many leaves ``DXSERVE_MAX_DEPTH`` deep.
3. That gradient against the number of leaves, past the default limit too.

"Now" includes the chunk executables a run needs (``Prep.compile_for``), "before"
only the one-shot program ``prepare`` compiled.

    .venv/bin/python bench/compile_shapes.py [--base /tmp/base] [--save '']
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from _common import ROOT, Tee, machine_line, markdown_table

TANGENT_COUNTS = (16, 128, 512, 1024, 4096)
LEAF_COUNTS = (256, 1024, 4096, 8192)


def _one(case: str, size: int) -> None:
    """In a fresh process: prepare one case and print ``{"seconds": ...}``."""
    import numpy as np

    from dxserve.core.preparation import prepare
    from dxserve.examples import least_squares, rosenbrock

    x3 = np.array([1.0, 2.0, 3.0])
    X, Y = np.ones((4, 2)), np.ones((4, 1))
    if case == "hvp":
        rng = np.random.default_rng(0)
        args = ("hvp", rosenbrock, "auto", x3, tuple(rng.normal(size=(size, 3))), ())
    elif case in ("leaves", "deep"):
        params: dict = {"w": np.ones((2, 1)), "b": np.zeros(1)}
        extras = {f"u{i}": np.ones(2) for i in range(size - 4)}  # + w, b and 2 contexts
        if case == "deep":
            from dxserve.server.request_shapes import MAX_DEPTH

            for _ in range(MAX_DEPTH - 2):  # leaves at MAX_DEPTH: params, extra, 14 more
                extras = {"d": extras}
        params["extra"] = extras
        args = ("gradient", least_squares, "jax-reverse", params, None, (X, Y))
    else:
        raise SystemExit(f"unknown case {case}")
    start = time.perf_counter()
    prep = prepare(*args)
    if hasattr(prep, "compile_for"):  # this tree: the chunk executables too, as served
        from dxserve.core.preparation import normalize

        prep.compile_for(args[0], *normalize(*args[3:]))
    print(json.dumps({"seconds": time.perf_counter() - start}))


def _measure(case: str, size: int, source: str | None, timeout: float) -> float | None:
    env = dict(os.environ)
    paths = [f"{source}/service", f"{source}/clients/python"] if source else [
        str(ROOT / "service"), str(ROOT / "clients/python")
    ]
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(ROOT / "bench")])
    try:
        out = subprocess.run(
            [sys.executable, __file__, "--one", case, str(size)], env=env, cwd=ROOT,
            capture_output=True, text=True, timeout=timeout, check=True,
        ).stdout
    except subprocess.TimeoutExpired:
        return None
    return json.loads(out.strip().splitlines()[-1])["seconds"]


def _cell(seconds: float | None, timeout: float) -> str:
    return f"> {timeout:.0f}" if seconds is None else f"{seconds:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", help="source tree of the code before, for table 1")
    parser.add_argument("--base-max-k", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--save", default="compile-shapes-cpu.md")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        _one(args.one[0], int(args.one[1]))
        return
    from dxserve.server.request_shapes import MAX_DEPTH, MAX_LEAVES, MAX_TANGENTS

    out = Tee()
    out(f"# Compile time against request shape\n\n{machine_line()}\n")
    out("## 1. hvp of rosenbrock (n = 3): seconds to prepare, against the tangents k\n")
    rows = []
    for k in TANGENT_COUNTS:
        packed = _measure("hvp", k, None, args.timeout)
        row = [k, _cell(packed, args.timeout)]
        if args.base:
            before = (
                _measure("hvp", k, args.base, args.timeout) if k <= args.base_max_k else "-"
            )
            row.insert(1, before if before == "-" else _cell(before, args.timeout))
        rows.append(row)
    header = ["k", "one argument per tangent (before)", "packed (now)"] if args.base else [
        "k", "packed (now)"
    ]
    out(markdown_table(header, rows))
    out(f"\n## 2. The worst accepted requests under the defaults "
        f"(tangents {MAX_TANGENTS}, leaves {MAX_LEAVES}, depth {MAX_DEPTH})\n")
    cases = [
        ("hvp", MAX_TANGENTS, f"hvp, {MAX_TANGENTS} tangents"),
        ("leaves", MAX_LEAVES, f"gradient, x a dict: {MAX_LEAVES} leaves with the contexts"),
        ("deep", MAX_LEAVES, f"the same {MAX_LEAVES} leaves, {MAX_DEPTH} levels deep"),
    ]
    rows = [[label, _cell(_measure(case, size, None, args.timeout), args.timeout)]
            for case, size, label in cases]
    out(markdown_table(["request", "seconds to trace and compile"], rows))
    out(f"\n## 3. gradient, x a dict, against its leaves (past {MAX_LEAVES}: refused)\n")
    rows = [[leaves, _cell(_measure("leaves", leaves, None, args.timeout), args.timeout)]
            for leaves in LEAF_COUNTS]
    out(markdown_table(["leaves", "seconds to trace and compile"], rows))
    if args.save:
        out(f"\nsaved to {out.save(args.save)}")


if __name__ == "__main__":
    main()
