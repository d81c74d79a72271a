"""What each cache layer buys: the time of a call with the layer and without it.

In process (the library, as the server's worker runs it):

* **prep cache** (``PrepCache``, keyed by function, operator, backend and signature):
  a repeated call finds its compiled prep instead of tracing and compiling again;
* **resolved twins** (the same cache keyed by the concrete backend): a second spelling
  of a backend that resolves alike (``"auto"`` and ``SecondOrder(JaxForward(),
  JaxReverse())`` for an HVP) shares the first one's executable.

Across a restart (a server process, first request per signature):

* **JAX's persistent compilation cache** alone (``DXSERVE_EXECUTABLE_CACHE_MB=0``):
  skips XLA's compile, still traces and lowers;
* **plus dxserve's executable cache** (the default): skips tracing and lowering too.

    .venv/bin/python bench/cache_layers.py [--save '']
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from _common import Tee, machine_line, markdown_table, median, ms, ratio
from cold_start import CASES, _first_requests, _serve

from dxclient import JaxForward, JaxReverse, SecondOrder
from dxserve.core.preparation import PrepCache, call, prepare

ROUNDS = 7


def rosenbrock(x):
    return jnp.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _prep_cache_row(n: int) -> list[object]:
    x = np.linspace(-1.0, 1.5, n)
    cache = PrepCache()

    def warm() -> None:
        call("gradient", rosenbrock, "jax-reverse", x, None, (), cache=cache)

    def cold() -> None:
        call("gradient", rosenbrock, "jax-reverse", x, None, (), cache=PrepCache())

    warm()
    hit = median([_timed(warm) for _ in range(ROUNDS * 20)])
    miss = median([_timed(cold) for _ in range(ROUNDS)])
    return ["prep cache", f"gradient n={n}", ms(miss), ms(hit), ratio(miss, hit)]


def _twin_row(n: int) -> list[object]:
    x, t = np.linspace(-1.0, 1.5, n), (np.ones(n),)
    backend = SecondOrder(JaxForward(), JaxReverse())
    twin, fresh = [], []
    for _ in range(ROUNDS):
        shared = PrepCache()
        first = prepare("hvp", rosenbrock, "auto", x, t, (), shared)  # noqa: F841 - held: the index is weak
        twin.append(_timed(lambda: prepare("hvp", rosenbrock, backend, x, t, (), shared)))  # noqa: B023
        fresh.append(_timed(lambda: prepare("hvp", rosenbrock, backend, x, t, (), PrepCache())))
    return ["resolved twins", f"hvp n={n}, 2nd spelling", ms(median(fresh)),
            ms(median(twin)), ratio(median(fresh), median(twin))]


def in_process() -> list[list[object]]:
    return [row for n in (10, 1000) for row in (_prep_cache_row(n), _twin_row(n))]


def restarts() -> list[list[object]]:
    """First requests: cold and restarted with JAX's cache alone (its own directory, the
    executable cache off), then cold and restarted with both (the default)."""
    off = {"DXSERVE_EXECUTABLE_CACHE_MB": "0"}
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, env in (("jax-cold", off), ("jax-restart", off), ("cold", None),
                          ("restart", None)):
            cache = tmp / ("jax-cache" if env else "cache")
            with _serve(tmp / f"store-{name}", cache, tmp / f"{name}.log", env) as srv:
                times.append([first for first, _ in _first_requests(srv.url, second=False)])
    rows = []
    for (op, backend, n), jc, jr, c, r in zip(CASES, *times, strict=True):
        name = backend if isinstance(backend, str) else backend.type
        rows.append([f"{op} {name} n={n}", ms(jc), ms(jr), ratio(jr, jc), ms(c), ms(r),
                     ratio(r, c)])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--save", default="cache-layers-cpu.md")
    args = parser.parse_args()
    out = Tee()
    out(machine_line())
    out()
    out("In process: median call time without the layer and with it.")
    out()
    out(markdown_table(["layer", "call", "without ms", "with ms", "without/with"], in_process()))
    out()
    out("Across a restart: the first request per signature, cold and after a restart on the "
        "same cache directory; JAX's cache alone (executable cache off), then both (default).")
    out()
    out(markdown_table(["first request", "cold ms", "JAX cache ms", "JAX/cold", "cold ms",
                        "both ms", "both/cold"], restarts()))
    if args.save:
        out.save(args.save)


if __name__ == "__main__":
    main()
