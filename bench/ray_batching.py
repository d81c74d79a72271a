"""Inside a Ray Serve replica: dxserve's own request batcher or ``@serve.batch``?

One replica, called through its ``DeploymentHandle`` (no HTTP proxy, so only the
replica's batching differs), 32 calls in flight from one asyncio driver: gradient of
rosenbrock at n = 100, every call a different x. Three replicas, deployed side by side and measured interleaved:

* ``dxserve batcher``: ``handle.call`` -> ``Service.call``; the service's batcher merges
  concurrent calls of one function, operator, backend and signature into one vmapped
  call (``DXSERVE_MAX_BATCH=32``, the default);
* ``no batching``: the same with ``DXSERVE_MAX_BATCH=1``;
* ``@serve.batch``: Ray collects up to 32 calls (waiting at most ``--wait`` s), the
  method stacks their x and makes one ``Service.call(..., batch_axis=0)`` (all calls
  here share function and shape; a real one would have to regroup each Ray batch by
  function, operator, backend and signature first), dxserve's batcher off.

    .venv/bin/python bench/ray_batching.py [--seconds 3] [--rounds 3] [--wait 0.002] [--save ray_batching.md]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import numpy as np
from _common import Tee, machine_line, markdown_table

N = 100
INFLIGHT = 32


def _batched_deployment(wait: float):
    from ray import serve

    from dxserve.server.runtime import bootstrap
    from dxserve.server.service import Service
    from dxserve.settings import Settings

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0},
                      max_ongoing_requests=256)
    class ServeBatched:
        def __init__(self, settings: dict) -> None:
            self.settings = Settings(**settings)
            bootstrap(self.settings)
            self.service = Service(self.settings)

        @serve.batch(max_batch_size=INFLIGHT, batch_wait_timeout_s=wait)
        async def call(self, operators, functions, backends, xs):
            stacked = np.stack([np.asarray(x) for x in xs])
            out = await self.service.call(operators[0], functions[0], backends[0], stacked,
                                          batch_axis=0)
            return [{k: v[i] for k, v in out.items()} for i in range(len(xs))]

    return ServeBatched


async def _drive(handle, seconds: float) -> tuple[float, float, float, int]:
    """(calls/s, p50 ms, p99 ms, wrong answers) with INFLIGHT calls in flight."""
    latencies: list[float] = []
    wrong = 0
    stop = time.perf_counter() + seconds
    rng = np.random.default_rng(0)

    async def one_client() -> None:
        nonlocal wrong
        while time.perf_counter() < stop:
            x = rng.normal(size=N)
            start = time.perf_counter()
            out = await handle.call.remote("gradient", "sum_of_squares", "auto", x)
            latencies.append(time.perf_counter() - start)
            wrong += not np.allclose(out["gradient"], 2 * x, rtol=1e-12)

    begun = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(INFLIGHT)))
    elapsed = time.perf_counter() - begun
    lat = sorted(latencies)
    return (len(lat) / elapsed, 1e3 * statistics.median(lat),
            1e3 * lat[int(0.99 * (len(lat) - 1))], wrong)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs per row")
    parser.add_argument("--wait", type=float, default=0.002, help="@serve.batch's wait (s)")
    parser.add_argument("--save", default="ray_batching.md", help="under bench/results ('' skips)")
    args = parser.parse_args()
    import ray
    from ray import serve

    from dxserve import ray_serve

    out = Tee()
    rows = []
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            base = {"store": tmp + "/store", "compilation_cache": tmp + "/jax",
                    "functions": ["dxserve.examples"]}
            variants = {
                "dxserve batcher": lambda: ray_serve.build(replicas=1, num_cpus=0,
                                                           settings=base),
                "no batching": lambda: ray_serve.build(replicas=1, num_cpus=0,
                                                       settings={**base, "max_batch": 1}),
                f"@serve.batch (wait {args.wait * 1e3:g} ms)": lambda: _batched_deployment(
                    args.wait).bind({**base, "max_batch": 1}),
            }
            handles = {}
            for i, (name, build) in enumerate(variants.items()):
                handles[name] = serve.run(build(), name=f"bench{i}", route_prefix=None)
                asyncio.run(_drive(handles[name], 1.0))  # warm: compile the batch sizes seen
            runs: dict[str, list] = {name: [] for name in handles}
            names = list(handles)
            for r in range(args.rounds):  # interleaved, rotating who goes first
                for name in names[r % len(names):] + names[: r % len(names)]:
                    runs[name].append(asyncio.run(_drive(handles[name], args.seconds)))
            for name, got in runs.items():
                rps, p50, p99 = (statistics.median(g[k] for g in got) for k in range(3))
                rows.append([name, f"{rps:.0f}", f"{p50:.2f}", f"{p99:.2f}",
                             sum(g[3] for g in got)])
    finally:
        serve.shutdown()
        ray.shutdown()
    out("# Batching inside a Ray Serve replica")
    out()
    out(machine_line())
    out()
    out(f"gradient of sum_of_squares, n = {N}, through the DeploymentHandle, {INFLIGHT} calls "
        f"in flight; medians of {args.rounds} interleaved runs of {args.seconds:g} s. "
        "Each variant is its own replica (its own process).")
    out()
    out(markdown_table(["replica batching", "calls/s", "p50 ms", "p99 ms", "wrong"], rows))
    if args.save:
        print(f"saved {out.save(args.save)}")


if __name__ == "__main__":
    main()
