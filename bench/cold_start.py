"""Cold start: the first request for a new signature, before and after a restart.

Starts ``dxserve serve`` with a fresh JAX compilation cache directory, times the
first request for several (operator, n) pairs (trace + compile + run), stops the
server, starts it again on the same cache, and times the same first requests.
Also shows a warm (second) request for scale. Target: restart with a warm
compilation cache, first request <= 0.3x the cold first request.

    .venv/bin/python bench/cold_start.py [--save '']
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import PYTHON, Server, Tee, free_port, machine_line, markdown_table, ms, ratio

from dxclient import Client, JaxForward, JaxReverse, SecondOrder

CASES = [
    ("gradient", "jax-reverse", 1000),
    ("hessian", SecondOrder(JaxForward(), JaxReverse()), 200),
    ("jacobian", JaxForward(batch_size=16), 300),
    ("hvp", "auto", 100_000),
]


def _first_requests(url: str, second: bool) -> list[tuple[float, float | None]]:
    out = []
    with Client(url) as client:
        for op, backend, n in CASES:
            x = np.linspace(-1.0, 1.5, n)
            args = (x, (np.ones(n),)) if op == "hvp" else (x,)
            fn = "sin_cumsum" if op == "jacobian" else "rosenbrock"
            start = time.perf_counter()
            getattr(client, op)(fn, backend, *args)
            first = time.perf_counter() - start
            warm = None
            if second:
                start = time.perf_counter()
                getattr(client, op)(fn, backend, *args)
                warm = time.perf_counter() - start
            out.append((first, warm))
    return out


def _serve(store: Path, cache: Path, log: Path, env: dict[str, str] | None = None) -> Server:
    port = free_port()
    argv = [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--store", str(store), "--compilation-cache", str(cache), "--log-level", "warning"]
    return Server(argv, port, "/health", log, env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--save", default="cold-start-cpu.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with _serve(tmp / "store", tmp / "jax-cache", tmp / "a.log") as srv:
            cold = _first_requests(srv.url, second=True)
        with _serve(tmp / "store", tmp / "jax-cache", tmp / "b.log") as srv:
            restarted = _first_requests(srv.url, second=False)
        entries = sum(1 for _ in (tmp / "jax-cache").rglob("*") if _.is_file())
    rows = []
    for (op, backend, n), (c, w), (r, _) in zip(CASES, cold, restarted, strict=True):
        name = backend if isinstance(backend, str) else backend.type
        rows.append([op, name, n, ms(c), ms(r), ratio(r, c), ms(w)])
    out = Tee()
    out(machine_line())
    out(f"compilation cache entries after the cold run: {entries}")
    out()
    out(markdown_table(
        ["operator", "backend", "n", "cold first ms", "first after restart ms",
         "restart/cold", "warm ms"], rows))
    out()
    out("Target: first request after a restart with the compilation cache <= 0.3x the cold one.")
    if args.save:
        out.save(args.save)


if __name__ == "__main__":
    main()
