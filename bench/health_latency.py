"""``/health`` latency while a long computation runs on the same server.

Starts ``dxserve serve``, measures /health when idle, then starts a multi-second
finite-difference Jacobian in a thread and probes /health as fast as it can while
the Jacobian runs. Target (issue 6): p99 under 10 ms while a long computation runs.

    .venv/bin/python bench/health_latency.py [--save '']
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from _common import PYTHON, Server, Tee, free_port, machine_line, markdown_table

from dxclient import Client, FiniteDifferences


def _probe(url: str, until: threading.Event | None, count: int) -> list[float]:
    times = []
    with httpx.Client(base_url=url) as http:
        http.get("/health")
        while len(times) < count and (until is None or not until.is_set()):
            start = time.perf_counter()
            http.get("/health").raise_for_status()
            times.append(time.perf_counter() - start)
            time.sleep(0.002)
    return times


def _row(label: str, times: list[float]) -> list[object]:
    t = np.array(times) * 1e3
    return [label, len(t), f"{np.median(t):.2f}", f"{np.percentile(t, 99):.2f}", f"{t.max():.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=1500, help="Jacobian size (n x n)")
    parser.add_argument("--save", default="health-latency-cpu.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        argv = [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--store", str(Path(tmp) / "store"), "--compilation-cache", "",
                "--log-level", "warning"]
        with Server(argv, port, "/health", Path(tmp) / "server.log") as srv:
            idle = _probe(srv.url, None, 300)
            done = threading.Event()
            took: list[float] = []

            def long_jacobian() -> None:
                x = np.linspace(-1.0, 1.0, args.n)
                start = time.perf_counter()
                with Client(srv.url, timeout=600) as client:
                    client.jacobian("sin_cumsum", FiniteDifferences(batch_size=1), x)
                took.append(time.perf_counter() - start)
                done.set()

            worker = threading.Thread(target=long_jacobian)
            worker.start()
            time.sleep(0.2)
            busy = _probe(srv.url, done, 100_000)
            worker.join()
    out = Tee()
    out(machine_line())
    out(f"long computation: finite-difference Jacobian of sin_cumsum, n = {args.n}, "
        f"batch_size 1: {took[0]:.1f} s")
    out()
    out(markdown_table(["/health", "probes", "median ms", "p99 ms", "max ms"],
                       [_row("idle", idle), _row("during the Jacobian", busy)]))
    out()
    out("Target: p99 under 10 ms while a long computation runs.")
    if args.save:
        out.save(args.save)


if __name__ == "__main__":
    main()
