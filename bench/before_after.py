"""``latency.py`` on two commits, in one session, alternating: what a change did to latency.

    git worktree add /tmp/dx-before <commit>
    .venv/bin/python bench/before_after.py --before /tmp/dx-before --runs 4

Each run is a whole ``latency.py`` run (its own servers, echo and raw floor) from the
given source tree, with that tree's ``service/`` and ``clients/python/`` first on the
path; runs alternate before, after, before, ... so both see the same phases of a noisy
machine. Prints, per target ``latency.py`` checks, the median ratio over the runs of each
tree, and writes ``results/before-after-cpu.md``.

``--client-only``: two client trees side by side against one server, per call, with the
raw floor (``client_before_after.py``, which takes the other options).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

from _common import PYTHON, Tee, commit_of, machine_line, markdown_table
from latency_spread import ratios

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def one_run(tree: Path, sizes: str, path: Path) -> list[dict]:
    """One ``latency.py`` run of the source tree ``tree``; its medians."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        str(tree / p) for p in ("service", "clients/python", "")
    )}
    subprocess.run(
        [PYTHON, str(tree / "bench" / "latency.py"), "--sizes", sizes, "--save", "", "--json",
         str(path), "--log-level", "warning"],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tree,
    )
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--client-only" in argv:
        import client_before_after

        return client_before_after.main([a for a in argv if a != "--client-only"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="source tree of the old commit")
    parser.add_argument("--after", type=Path, default=ROOT, help="source tree of the new one")
    parser.add_argument("--runs", type=int, default=4, help="runs of each tree")
    parser.add_argument("--sizes", default="10,1e5,1e6")
    parser.add_argument("--save", default="before-after-cpu.md")
    args = parser.parse_args(argv)
    found: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for name in ("before", "after") if i % 2 == 0 else ("after", "before"):
                tree = getattr(args, name)
                print(f"run {i + 1}/{args.runs}: {name}", file=sys.stderr, flush=True)
                found[name].append(ratios(one_run(tree, args.sizes, Path(tmp) / f"{name}{i}.json")))
    out = Tee()
    out("# Latency before and after, one session (bench/before_after.py)")
    out()
    out(f"{machine_line()}; {args.runs} whole `latency.py` runs of each tree, alternating; "
        "cells: median over the runs (lowest-highest)")
    out()
    out(f"- before: `{commit_of(args.before)}`")
    out(f"- after: `{commit_of(args.after)}`")
    out()
    rows = []
    for key in found["after"][0]:
        label, what, target = key
        cells = []
        for name in ("before", "after"):
            values = [run[key] for run in found[name] if key in run]
            cells.append(f"{median(values):.2f} ({min(values):.2f}-{max(values):.2f})" if values else "-")
        after = median(run[key] for run in found["after"])
        verdict = "" if target is None else ("ok" if after <= target else f"over by {after / target - 1:.0%}")
        rows.append([label, what, cells[0], cells[1], "-" if target is None else f"{target}x", verdict])
    out(markdown_table(["n", "ratio", "before", "after", "target", "after meets it"], rows))
    if args.save:
        print(f"saved {out.save(args.save)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
