"""What making computations stoppable costs per request: a worker hand-off vs a child.

    .venv/bin/python bench/abandon_cost.py [--calls 2000]
    PYTHONPATH=/path/to/other/tree/service .venv/bin/python bench/abandon_cost.py   # a baseline

Times, in this process, one trivial job (``lambda: None``) handed to a device worker
thread and back (``worker.Workers.run`` with no key: never inline), the path a job takes
when it may be abandoned at its deadline; and, for comparison, the same trivial job
(an echo of 8 KiB) run in a ``sandbox.Sandbox`` child, the other way to make a
computation stoppable (a process that can be killed), before any compile it would need.
Also the check that refuses uploads with unbounded loops: ``loops.trip_counts`` over a
module's text, paid once per artifact at upload. Prints median and p90 microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from statistics import median, quantiles


def echo(header: dict, payload: bytes) -> tuple[dict, bytes]:
    """A sandbox job: its payload back."""
    return {"n": len(payload)}, payload


async def worker_calls(n: int) -> list[float]:
    from dxserve.server.worker import Workers

    workers = Workers(queue_size=16, timeout=30.0)
    out = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            await workers.run(lambda: None)
            out.append(time.perf_counter() - t)
    finally:
        workers.close()
    return out


def sandbox_calls(n: int) -> list[float]:
    from dxserve.server.sandboxes.sandbox import Limits, Sandbox, _own_paths

    here = os.path.dirname(os.path.abspath(__file__))
    box = Sandbox("abandon_cost:echo", paths=[here, *_own_paths()], name="bench")
    limits = Limits(memory_bytes=256 << 20, seconds=10.0, reply_bytes=1 << 20)
    payload = b"x" * 8192
    box.run({}, payload, limits)  # the fork server starts
    out = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            got = box.run({}, payload, limits)
            out.append(time.perf_counter() - t)
            assert got.status == "ok" and got.payload == payload, got
    finally:
        box.stop()
    return out


def scan_calls(n: int) -> tuple[list[float], int]:
    """``loops.trip_counts`` over the module text of a 4-layer MLP run in a 100-step
    ``lax.scan`` (with its gradient): what the upload check costs, once per artifact."""
    import jax
    import jax.numpy as jnp
    from jax import export, lax

    from dxserve.frameworks.jax.loops import trip_counts

    def f(x):
        def step(c, _):
            for k in range(4):
                c = jnp.tanh(c * (k + 1.5) + jnp.roll(c, k))
            return c, None

        return lax.scan(step, x, None, length=100)[0].sum()

    spec = jax.ShapeDtypeStruct((64,), jnp.float32)
    text = export.export(jax.jit(jax.grad(f)))(spec).mlir_module()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        trip_counts(text)
        out.append(time.perf_counter() - t)
    return out, len(text)


def line(name: str, seconds: list[float]) -> str:
    us = [s * 1e6 for s in seconds]
    return f"| {name} | {len(us)} | {median(us):.1f} | {quantiles(us, n=10)[-1]:.1f} |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--sandbox-calls", type=int, default=100)
    args = parser.parse_args()
    import dxserve

    print(f"dxserve from {os.path.dirname(dxserve.__file__)}; python {sys.version.split()[0]}")
    print("| path | calls | median µs | p90 µs |\n|---|---|---|---|")
    print(line("device worker hand-off (abandonable)", asyncio.run(worker_calls(args.calls))))
    print(line("sandbox child per call (killable)", sandbox_calls(args.sandbox_calls)))
    scans, size = scan_calls(50)
    print(line(f"loop scan at upload, once per artifact ({size:,} chars)", scans))


if __name__ == "__main__":
    main()
