"""Many points in one request (``batch_axis=0``) against one point and against one
request per point.

    .venv/bin/python bench/batch_points.py           # 1000 points of Rosenbrock at n = 10
    .venv/bin/python bench/batch_points.py --quick   # fewer rounds

Starts ``dxserve serve`` on 127.0.0.1 (random free port, fresh temporary store, no
persistent compilation cache) and stops it by PID. For gradient, hvp and jacobian it
times, interleaved, through ``dxclient.Client`` in its default (binary) encoding:

* single: one request for one point, x of shape (n,);
* batched: one request for B points, x of shape (B, n) with ``batch_axis=0``;
* sequential: B requests, one per point (the same client, one after another);
* in process: ``dxserve.<op>(..., batch_axis=0, prep=prep)`` for the B points, blocked.

Fast calls are repeated within a sample (``min_sample_seconds``) so timer overhead
vanishes; medians over rounds. Target: batched <= 5x single.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
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

import dxserve
from dxclient import Client
from dxserve.examples import rosenbrock

TARGET = 5.0


def _reference(op: str, X: np.ndarray, T: np.ndarray) -> np.ndarray:
    """``jax.vmap`` of JAX's own derivative, in float64."""
    with dxserve.float64_scope():
        if op == "gradient":
            return np.asarray(jax.vmap(jax.grad(rosenbrock))(X))
        if op == "hvp":
            hvp = jax.vmap(lambda x, t: jax.jvp(jax.grad(rosenbrock), (x,), (t,))[1])
            return np.asarray(hvp(X, T))
        return np.asarray(jax.vmap(jax.jacobian(rosenbrock))(X))


def _calls(client: Client, op: str, x: np.ndarray, t: np.ndarray, batch: bool) -> Callable:
    """One client call of ``op`` at ``x`` (``batch``: x holds points on axis 0)."""
    axis = 0 if batch else None
    if op == "hvp":
        return lambda: client.hvp("rosenbrock", "auto", x, (t,), batch_axis=axis)[0]
    return lambda: getattr(client, op)("rosenbrock", "auto", x, batch_axis=axis)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=1000, help="B, points per batch")
    parser.add_argument("--n", type=int, default=10, help="Rosenbrock dimension")
    parser.add_argument("--ops", default="gradient,hvp,jacobian")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level")
    parser.add_argument("--save", default="batch-points-cpu.md", help="file under bench/results ('' = none)")
    args = parser.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    rounds = 5 if args.quick else 11
    B, n = args.points, args.n
    rng = np.random.default_rng(13)
    X, T = rng.uniform(-1.5, 1.5, (B, n)), rng.normal(size=(B, n))

    out = Tee()
    rows = []
    with tempfile.TemporaryDirectory(prefix="dxbench-") as tmp:
        port = free_port()
        server = Server(
            [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--store", str(Path(tmp) / "store"), "--compilation-cache", "",
             "--log-level", args.log_level],
            port, "/health", Path(tmp) / "dxserve.log",
        )
        try:
            with Client(server.url, timeout=600.0) as client:
                assert client.encoding == "binary"
                for op in ops:
                    want = _reference(op, X, T)
                    got = _calls(client, op, X, T, True)()
                    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
                    single = _calls(client, op, X[0], T[0], False)
                    singles = [_calls(client, op, X[i], T[i], False) for i in range(B)]
                    prep = getattr(dxserve, f"prepare_{op}")(
                        rosenbrock, "auto", X, *((T,),) if op == "hvp" else (), batch_axis=0
                    )
                    args_ = (X, (T,)) if op == "hvp" else (X,)
                    fn = getattr(dxserve, op)
                    candidates = {
                        "single": single,
                        "batched": _calls(client, op, X, T, True),
                        "sequential": lambda s=singles: [c() for c in s],
                        "in-process": lambda f=fn, a=args_, p=prep: jax.block_until_ready(
                            f(rosenbrock, "auto", *a, prep=p, batch_axis=0)
                        ),
                    }
                    started = time.perf_counter()
                    times = interleaved(candidates, rounds, min_sample_seconds=0.05, budget_seconds=180)
                    s, b, q, p = (median(times[k]) for k in ("single", "batched", "sequential", "in-process"))
                    flag = "ok" if b / s <= TARGET else "MISS"
                    rows.append([op, ms(s), ms(b), ms(q), f"{b / s:.2f}x {flag}", f"{q / b:.0f}x", ms(p)])
                    print(f"  {op} done ({len(times['single'])} rounds, "
                          f"{time.perf_counter() - started:.0f} s)", file=sys.stderr)
        finally:
            server.stop()

    out(f"# {B} points in one request (batch_axis=0) vs one point vs {B} requests "
        f"(Rosenbrock, n = {n}, float64)")
    out()
    out(f"{machine_line()}; loopback, `dxclient.Client` default (binary) encoding, uvicorn log "
        f"level {args.log_level}; medians of {rounds} interleaved rounds (fast calls repeated "
        "within a sample for at least 50 ms).")
    out()
    header = ["operator", "single point ms", f"{B} points batched ms", f"{B} sequential ms",
              "batched/single", "sequential/batched", "in-process batched ms"]
    out(markdown_table(header, rows))
    out()
    out(f"Target: batched/single <= {TARGET:.0f}x. single = one request for one point; batched = "
        f"one request with x of shape ({B}, {n}) and `batch_axis=0`, computed server-side as one "
        f"vmapped compiled call; sequential = {B} single-point requests one after another "
        "(the client's repeated-call fast path on); in-process = the library's batched call "
        "with a prep. Every batched result equals `jax.vmap` of JAX's derivative at rtol 1e-12.")
    if args.save:
        print(f"saved {out.save(args.save)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
