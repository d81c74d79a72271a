"""How the latency targets hold from run to run: ``latency.py`` run K times, each in a
fresh set of processes, and every target's ratio summarised over the runs.

    .venv/bin/python bench/latency_spread.py               # 20 runs, n = 10, 1e5, 1e6
    .venv/bin/python bench/latency_spread.py --runs 5 --sizes 10,1e5

One ``latency.py`` run reports medians of interleaved rounds, which are steady within the
run. Between runs they are not: each run starts its own servers, the scheduler places
their threads anew, and the raw loopback floor at 10^5 moves between ~0.15 and ~0.30 ms
on the 2-core reference machine. A target met in one saved table can still be missed
in the next run. This prints, for every ratio ``latency.py`` checks, the lowest, median
and highest value over the runs and how many runs met the target.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

from _common import PYTHON, Tee, machine_line, markdown_table
from latency import ASYNC_TARGET, ENCODINGS, FLOOR_TARGETS, SMALL_TARGET

HERE = Path(__file__).resolve().parent


def one_run(sizes: str, path: Path) -> list[dict]:
    """One whole ``latency.py`` run (its own servers); its medians."""
    subprocess.run(
        [PYTHON, str(HERE / "latency.py"), "--sizes", sizes, "--save", "", "--json", str(path),
         "--log-level", "warning"],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    return json.loads(path.read_text())


def ratios(medians: list[dict]) -> dict[tuple[str, str, float | None], float]:
    """``(n label, what, target) -> ratio`` for every target ``latency.py`` checks, and
    the 10^5 and 10^6 binary times themselves (target None)."""
    out = {}
    for row in medians:
        n, label = row["n"], f"{row['n']:.0e}" if row["n"] >= 1000 else str(row["n"])
        if "client" in row:
            out[(label, "async/sync (binary)", ASYNC_TARGET)] = row["async"] / row["client"]
            continue
        if n <= 10:
            out[(label, f"dxserve/echo ({row['encoding']})", SMALL_TARGET)] = (
                row["dxserve"] / row["echo"])
        target = FLOOR_TARGETS.get(n)
        if target is not None and row["encoding"] == "binary":
            out[(label, "dxserve/raw (binary)", target)] = row["dxserve"] / row["raw"]
            out[(label, "raw ms (binary)", None)] = row["raw"] * 1e3
            out[(label, "dxserve ms (binary)", None)] = row["dxserve"] * 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--sizes", default="10,1e5,1e6", help="comma-separated n")
    parser.add_argument("--save", default="latency-spread-cpu.md",
                        help="file under bench/results ('' = none)")
    args = parser.parse_args(argv)

    seen: dict[tuple[str, str, float | None], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="dxspread-") as tmp:
        for i in range(args.runs):
            for key, value in ratios(one_run(args.sizes, Path(tmp) / f"{i}.json")).items():
                seen.setdefault(key, []).append(value)
            print(f"  run {i + 1}/{args.runs} done", file=sys.stderr)

    out = Tee()
    out("# Latency targets over repeated runs of `bench/latency.py`")
    out()
    out(f"{machine_line()}; {args.runs} runs, each with its own servers, n = {args.sizes}; "
        "each run's value is that run's median of interleaved rounds.")
    out()
    rows = []
    order = {what: i for i, what in enumerate(
        [f"dxserve/echo ({enc})" for enc in ENCODINGS]
        + ["dxserve/raw (binary)", "raw ms (binary)", "dxserve ms (binary)", "async/sync (binary)"])}
    for (label, what, target), values in sorted(
        seen.items(), key=lambda kv: (float(kv[0][0]), order[kv[0][1]])
    ):
        unit = "" if target is None else "x"
        met = None if target is None else sum(v <= target for v in values)
        rows.append([
            label, what, "–" if target is None else f"{target:g}x",
            f"{min(values):.2f}{unit}", f"{median(values):.2f}{unit}", f"{max(values):.2f}{unit}",
            f"{met} of {len(values)}" if met is not None else "–",
        ])
    out(markdown_table(["n", "ratio", "target", "lowest", "median", "highest", "runs met"], rows))
    out()
    out("dxserve, echo, raw and async are as in `bench/latency.py` (its docstring and "
        "table footnote). A run meets a target when its own median ratio is at most the "
        "target.")
    if args.save:
        print(f"saved {out.save(args.save)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
