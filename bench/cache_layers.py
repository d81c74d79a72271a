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
from _common import PYTHON, Server, Tee, free_port, machine_line, markdown_table, median, ms, ratio

from dxclient import Client, JaxForward, JaxReverse, SecondOrder
from dxserve.preparation import PrepCache, call, prepare

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
        prepare("hvp", rosenbrock, "auto", x, t, (), shared)
        twin.append(_timed(lambda: prepare("hvp", rosenbrock, backend, x, t, (), shared)))  # noqa: B023
        fresh.append(_timed(lambda: prepare("hvp", rosenbrock, backend, x, t, (), PrepCache())))
    return ["resolved twins", f"hvp n={n}, 2nd spelling", ms(median(fresh)),
            ms(median(twin)), ratio(median(fresh), median(twin))]


def in_process() -> list[list[object]]:
    return [row for n in (10, 1000) for row in (_prep_cache_row(n), _twin_row(n))]


CASES = [("gradient", "jax-reverse", 1000), ("hvp", "auto", 1000),
         ("jacobian", JaxForward(batch_size=16), 300)]


def _first(url: str) -> list[float]:
    out = []
    with Client(url) as client:
        for op, backend, n in CASES:
            x = np.linspace(-1.0, 1.5, n)
            args = (x, (np.ones(n),)) if op == "hvp" else (x,)
            fn = "sin_cumsum" if op == "jacobian" else "rosenbrock"
            out.append(_timed(lambda op=op, fn=fn, backend=backend, args=args: getattr(
                client, op)(fn, backend, *args)))
    return out


def _serve(tmp: Path, cache: Path, name: str, env: dict[str, str] | None = None) -> Server:
    port = free_port()
    argv = [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--store", str(tmp / f"store-{name}"), "--compilation-cache", str(cache),
            "--log-level", "warning"]
    return Server(argv, port, "/health", tmp / f"{name}.log", env)


def restarts() -> list[list[object]]:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with _serve(tmp, tmp / "cache", "cold") as srv:
            cold = _first(srv.url)
        with _serve(tmp, tmp / "cache", "jax", {"DXSERVE_EXECUTABLE_CACHE_MB": "0"}) as srv:
            jax_only = _first(srv.url)
        with _serve(tmp, tmp / "cache", "both") as srv:
            both = _first(srv.url)
    rows = []
    for (op, backend, n), c, j, b in zip(CASES, cold, jax_only, both, strict=True):
        name = backend if isinstance(backend, str) else backend.type
        rows.append([f"{op} {name} n={n}", ms(c), ms(j), ms(b), ratio(j, c), ratio(b, c)])
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
    out("Across a restart: the first request per signature, cold, then restarted on the same "
        "cache directory with JAX's cache only and with both caches.")
    out()
    out(markdown_table(["first request", "cold ms", "JAX cache ms", "both ms", "JAX/cold",
                        "both/cold"], restarts()))
    if args.save:
        out.save(args.save)


if __name__ == "__main__":
    main()
