"""``/health`` latency while a long computation runs on the same server.

Starts ``dxserve serve``, measures /health when idle, then runs a long
finite-difference Jacobian (the first call traces, compiles and runs; then a few
warm repeats) from a separate client process and probes /health from this one,
with one keep-alive connection, while the Jacobians run. The job has its own
process so that receiving and decoding its result (18 MB at n = 1500) does not
hold this process's GIL while a probe waits. Target: p99 under 10 ms while a long
computation runs.

    .venv/bin/python bench/health_latency.py [--save '']
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from _common import PYTHON, Server, Tee, free_port, machine_line, markdown_table

from dxclient import Client, FiniteDifferences


def _probe(url: str, until: subprocess.Popen | None, count: int) -> list[tuple[float, float]]:
    """``(wall-clock start, seconds)`` per probe, until ``count`` or the process ends."""
    times = []
    with httpx.Client(base_url=url) as http:
        http.get("/health")
        while len(times) < count and (until is None or until.poll() is None):
            at, start = time.time(), time.perf_counter()
            http.get("/health").raise_for_status()
            times.append((at, time.perf_counter() - start))
            time.sleep(0.002)
    return times


def _job(url: str, n: int, repeats: int) -> None:
    """The long computation, in its own process: prints ``[[start, end], ...]``."""
    x = np.linspace(-1.0, 1.0, n)
    spans = []
    with Client(url, timeout=600) as client:
        for _ in range(1 + repeats):
            start = time.time()
            client.jacobian("sin_cumsum", FiniteDifferences(batch_size=1), x)
            spans.append([start, time.time()])
    print(json.dumps(spans))


def _during(probes: list[tuple[float, float]], spans: list[list[float]]) -> list[float]:
    return [t for at, t in probes if any(a <= at and at + t <= b for a, b in spans)]


def _row(label: str, times: list[float]) -> list[object]:
    t = np.array(times) * 1e3
    return [label, len(t), f"{np.median(t):.2f}", f"{np.percentile(t, 99):.2f}", f"{t.max():.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=1500, help="Jacobian size (n x n)")
    parser.add_argument("--repeats", type=int, default=3, help="warm Jacobians after the first")
    parser.add_argument("--save", default="health-latency-cpu.md")
    parser.add_argument("--job", metavar="URL", help=argparse.SUPPRESS)  # the client process
    args = parser.parse_args()
    if args.job:
        _job(args.job, args.n, args.repeats)
        return
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        argv = [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--store", str(Path(tmp) / "store"), "--compilation-cache", "",
                "--log-level", "warning"]
        with Server(argv, port, "/health", Path(tmp) / "server.log") as srv:
            idle = [t for _, t in _probe(srv.url, None, 300)]
            job = subprocess.Popen(
                [sys.executable, __file__, "--job", srv.url, "--n", str(args.n),
                 "--repeats", str(args.repeats)], stdout=subprocess.PIPE, text=True,
            )
            busy = _probe(srv.url, job, 1_000_000)
            stdout = job.communicate()[0]
            if job.returncode:
                raise SystemExit(f"the Jacobian client failed ({job.returncode}); see above")
            spans = json.loads(stdout)
    first, warm = spans[:1], spans[1:]
    took = [b - a for a, b in spans]
    out = Tee()
    out(machine_line())
    out(f"long computation (from its own client process): finite-difference Jacobian of "
        f"sin_cumsum, n = {args.n}, batch_size 1; first call (trace, compile, run, "
        f"{args.n**2 * 8 / 1e6:.0f} MB result) {took[0]:.2f} s"
        + (f", then {len(warm)} warm calls of median {np.median(took[1:]):.2f} s" if warm else ""))
    out()
    rows = [_row("idle", idle), _row("during the first Jacobian", _during(busy, first))]
    if warm:
        rows.append(_row("during the warm Jacobians", _during(busy, warm)))
    rows.append(_row("during all of them", _during(busy, spans)))
    out(markdown_table(["/health", "probes", "median ms", "p99 ms", "max ms"], rows))
    out()
    out("Target: p99 under 10 ms while a long computation runs.")
    if args.save:
        out.save(args.save)


if __name__ == "__main__":
    main()
