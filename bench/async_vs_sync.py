"""AsyncClient vs Client on POST /gradient (binary), side by side.

    .venv/bin/python bench/async_vs_sync.py                  # n = 10, 1e5, 1e6
    .venv/bin/python bench/async_vs_sync.py --sizes 1e5 --rounds 41

Starts ``dxserve serve`` on 127.0.0.1 and times, interleaved: ``Client.gradient``,
``AsyncClient.gradient`` (its operator calls through ``dxclient.transport.FastPath.asend``)
and, for reference, ``AsyncClient`` over plain httpx (``http=httpx.AsyncClient``, the
path before ``dxclient.transport``). Each async call is driven by
``loop.run_until_complete`` (~15 us of its own). Target: async/sync <= 1.1x.
Writes ``bench/results/async-vs-sync-cpu.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np
from _common import (
    PYTHON,
    Server,
    Tee,
    free_port,
    interleaved,
    machine_line,
    markdown_table,
    median,
    ms,
)

from dxclient import AsyncClient, Client
from dxserve import JaxReverse

TARGET = 1.1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,1e5,1e6")
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--save", default="async-vs-sync-cpu.md")
    args = parser.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",") if s.strip()]
    backend = JaxReverse()
    rows = []
    with tempfile.TemporaryDirectory(prefix="dxbench-") as tmp:
        port = free_port()
        srv = Server(
            [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--store", str(Path(tmp) / "store"), "--compilation-cache", "", "--log-level",
             "warning"],
            port, "/health", Path(tmp) / "dxserve.log",
        )
        loop = asyncio.new_event_loop()
        sync = Client(srv.url, timeout=600.0)
        fast = AsyncClient(srv.url, timeout=600.0)
        plain = AsyncClient(http=httpx.AsyncClient(base_url=srv.url, timeout=600.0))
        try:
            for n in sizes:
                x = np.random.default_rng(n).uniform(-1.5, 1.5, n)
                times = interleaved({
                    "Client": lambda x=x: sync.gradient("rosenbrock", backend, x),
                    "AsyncClient": lambda x=x: loop.run_until_complete(
                        fast.gradient("rosenbrock", backend, x)),
                    "AsyncClient, plain httpx": lambda x=x: loop.run_until_complete(
                        plain.gradient("rosenbrock", backend, x)),
                }, args.rounds if n < 10**6 else max(5, args.rounds // 2), budget_seconds=120)
                m = {k: median(v) for k, v in times.items()}
                ratio = m["AsyncClient"] / m["Client"]
                rows.append([f"{n:.0e}" if n >= 1000 else n, ms(m["Client"]), ms(m["AsyncClient"]),
                             f"{ratio:.2f}x{' ok' if ratio <= TARGET else ' MISS'}",
                             ms(m["AsyncClient, plain httpx"]),
                             f"{m['AsyncClient, plain httpx'] / m['Client']:.2f}x"])
                print(f"  n={n:.0e} done", file=sys.stderr)
        finally:
            sync.close()
            loop.run_until_complete(fast.aclose())
            loop.run_until_complete(plain.aclose())
            loop.close()
            srv.stop()
    out = Tee()
    out("# AsyncClient vs Client: POST /gradient (Rosenbrock, float64, binary)")
    out()
    out(f"{machine_line()}; loopback; medians of interleaved rounds ({args.rounds}; half "
        "at 1e6). AsyncClient calls each driven by `loop.run_until_complete`.")
    out()
    out(markdown_table(["n", "Client ms", "AsyncClient ms", "async/sync",
                        "AsyncClient (plain httpx) ms", "plain/sync"], rows))
    if args.save:
        print(f"saved {out.save(args.save)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
