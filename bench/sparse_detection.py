"""What detecting a pattern in a bounded child costs, against detecting it in process.

For the tridiagonal map and the 2-D 5-point Laplacian (``tests.sparse_functions``) at
n = 10^2 (the fixed cost), 10^4 and 10^5, one analysis (asdex's detection and greedy
colouring, as ``SparseEngine.prepare`` asks for it) is timed, taking turns:

Each call is for a new size (as each prep is for a new signature), so both sides pay
JAX's per-shape compilations (asdex's patterns build device arrays):

* ``in process``: ``InProcessDetector`` (the library's: asdex in this thread);
* ``child``: ``ChildDetector`` (the server's: a sandboxed child rebuilds the function by
  its module and name, detects and colours under its limits, and sends the arrays
  back), the child's fork server already started (its start is reported apart).

Then what a prep holds per nonzero: the RSS a sparse Jacobian prep adds to this
process (pattern given, so no detection garbage is counted), over its nonzeros, beside
``SparseEngine.nbytes`` (what ``DXSERVE_MAX_NNZ``'s default is sized by).

    .venv/bin/python bench/sparse_detection.py [--quick] [--save '']
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.sparse_functions

from _common import Tee, interleaved, machine_line, markdown_table, median, ms  # noqa: E402

from dxserve import Sparse, SparsePattern  # noqa: E402
from dxserve.core.limits import ComputeLimits  # noqa: E402
from dxserve.core.preparation import prepare  # noqa: E402
from dxserve.frameworks.jax.precision import float64_scope  # noqa: E402
from dxserve.frameworks.jax.sparse_detection import DetectionBudget, InProcessDetector, PatternJob  # noqa: E402
from dxserve.server.origins import module_origin  # noqa: E402
from dxserve.server.sandboxes.sparsity import ChildDetector  # noqa: E402
from tests import sparse_functions as sf  # noqa: E402


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _sizes(name: str, wanted: list[int]) -> list[int]:
    if name == "sp_laplacian_2d":  # a k x k grid
        return [round(n**0.5) ** 2 for n in wanted]
    return wanted


def _family(name: str, n: int) -> Iterator[int]:
    """Sizes near ``n``, each new: n + 1, n + 2, ... (squares for the Laplacian)."""
    k = round(n**0.5)
    for i in range(1, 10**6):
        yield (k + i) ** 2 if name == "sp_laplacian_2d" else n + i


def detection_table(out: Tee, wanted: list[int], rounds: int) -> None:
    budget = DetectionBudget(seconds=600.0)
    here = InProcessDetector(budget)
    child = ChildDetector(budget, 8 << 30, module_origin, lambda origin: None)
    try:
        job0 = PatternJob("jacobian", (4, 4), "column")
        started = time.perf_counter()
        child.analyse(job0, sf.sp_tridiagonal, np.zeros(4), ())
        out(f"child's fork server start and first job: {time.perf_counter() - started:.1f} s")
        out()
        rows = []
        for name in ("sp_tridiagonal", "sp_laplacian_2d"):
            f = getattr(sf, name)
            for n in _sizes(name, wanted):
                # A new signature every call (what a prep is): n, n + 1, ... for the
                # tridiagonal, k x k, (k + 1) x (k + 1), ... grids for the Laplacian,
                # so neither side finds JAX's per-shape compilations cached.
                sizes = iter(_family(name, n))

                def one(detector: object, sizes=sizes, f=f) -> None:
                    m = next(sizes)
                    job = PatternJob("jacobian", (m, m), "column")
                    detector.analyse(job, f, sf.example_x(m), ())

                found = here.analyse(PatternJob("jacobian", (n, n), "column"), f,
                                     sf.example_x(n), ())
                with float64_scope():
                    times = interleaved({"in process": lambda one=one: one(here),
                                         "child": lambda one=one: one(child)}, rounds)
                a, b = median(times["in process"]), median(times["child"])
                rows.append([name, f"{n:,}", f"{found.pattern.nnz:,}",
                             found.coloring.num_colors, ms(a), ms(b), f"{b / a:.2f}x",
                             ms(b - a)])
                gc.collect()
        out(markdown_table(["function", "n", "nnz", "colours", "in process", "child",
                            "child / in process", "child - in process"], rows))
    finally:
        child.close()


def bytes_table(out: Tee, n: int) -> None:
    """RSS a prep adds per nonzero (pattern given: tridiagonal band), colouring in a
    child so only what the prep keeps stays in this process."""
    child = ChildDetector(DetectionBudget(seconds=600.0), 8 << 30, module_origin,
                          lambda origin: None)
    try:
        i = np.arange(n)
        band = SparsePattern(np.concatenate([i[1:], i, i[:-1]]),
                             np.concatenate([i[:-1], i, i[1:]]), (n, n))
        x = sf.example_x(n)
        limits = ComputeLimits(sparsity=child)
        # compile and start everything once, on a small one
        prepare("jacobian", sf.sp_tridiagonal, Sparse(sparsity=np.eye(8)), sf.example_x(8),
                None, (), limits=limits)
        gc.collect()
        before = _rss()
        prep = prepare("jacobian", sf.sp_tridiagonal, Sparse(sparsity=band), x, None, (),
                       limits=limits)
        gc.collect()
        grown = _rss() - before
        nnz = prep.report["sparsity"]["nnz"]
        out(markdown_table(
            ["n", "nnz", "RSS added by the prep", "per nonzero", "engine.nbytes (its estimate) per nonzero"],
            [[f"{n:,}", f"{nnz:,}", f"{grown / 2**20:.0f} MiB", f"{grown / nnz:.0f} B",
              f"{prep.compiler.nbytes / nnz:.0f} B"]],
        ))
    finally:
        child.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n = 10^2 and 10^4 only")
    parser.add_argument("--save", default="sparse-detection-cpu.md")
    args = parser.parse_args()
    wanted = [100, 10**4] + ([] if args.quick else [10**5])
    out = Tee()
    out("# Sparsity detection in process vs in the bounded child (bench/sparse_detection.py)")
    out()
    out(machine_line())
    out()
    out("One analysis (detection + column colouring), median of the rounds, taking turns.")
    out()
    detection_table(out, wanted, rounds=3 if args.quick else 5)
    out()
    out("What a sparse Jacobian prep holds per nonzero (tridiagonal, pattern given):")
    out()
    bytes_table(out, 10**5 if args.quick else 10**6)
    if args.save:
        print(f"saved to {out.save(args.save)}")


if __name__ == "__main__":
    main()
