"""What the export gate costs per registration, for three bundle sizes.

Candidates, timed interleaved (round robin) in one process:

* ``direct``: ``load_exported`` in process, what registering an export cost before
  the gate (deserialize, build the MLIR modules, check; no compilation);
* ``gate``: ``export_gate.check`` alone (a forked, resource-limited child
  deserializes, compiles and runs value, JVP, VJP and both second-order maps once);
* ``gated``: ``gate`` then ``direct``, what registering new content costs now.

The fork server's own start (once per server process, on the first upload) is
reported on its own line. Run: ``.venv/bin/python bench/export_gate.py [--rounds 7]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import RESULTS  # noqa: E402

from dxclient.export import export_function  # noqa: E402
from dxserve.frameworks.jax.exported import load_exported  # noqa: E402
from dxserve.server.sandboxes import export_gate  # noqa: E402


def rosenbrock(x):
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def mlp(p, X):
    h = X
    for i in range(4):
        h = jnp.tanh(h @ p[f"w{i}"] + p[f"b{i}"])
    return jnp.sum(h**2)


_A = np.random.default_rng(0).standard_normal((256, 256))


def dense_constants(x):
    # a closed-over 256 x 256 matrix is a constant in every artifact: a ~2.6 MB bundle
    y = x
    for _ in range(3):
        y = jnp.tanh(jnp.asarray(_A) @ y)
    return jnp.sum(y**2)


def cases() -> list[tuple[str, bytes]]:
    params = {f"w{i}": np.zeros((64, 64)) for i in range(4)}
    params |= {f"b{i}": np.zeros(64) for i in range(4)}
    return [
        ("rosenbrock, x: 3", export_function(rosenbrock, np.zeros(3))),
        ("4-layer MLP, x: 16,640 params", export_function(mlp, params, np.ones((32, 64)))),
        ("256x256 constants, x: 256", export_function(dense_constants, np.zeros(256))),
    ]


def direct(bundle: bytes) -> None:
    with jax.enable_x64(True):
        load_exported(bundle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--save", default="export-gate-cpu.md")
    args = parser.parse_args()

    built = cases()
    started = time.perf_counter()
    gate = export_gate.ExportGate()
    gate.check(built[0][1])  # starts the fork server
    cold = time.perf_counter() - started

    rows = []
    for label, bundle in built:
        candidates = {
            "direct": lambda b=bundle: direct(b),
            "gate": lambda b=bundle: gate.check(b),
            "gated": lambda b=bundle: (gate.check(b), direct(b)),
        }
        times: dict[str, list[float]] = {k: [] for k in candidates}
        names = list(candidates)
        for r in range(args.rounds):
            for name in names[r % 3 :] + names[: r % 3]:
                t = time.perf_counter()
                candidates[name]()
                times[name].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append((label, len(bundle), med))

    lines = [
        f"backend: {jax.default_backend()}, jax {jax.__version__}, {os.cpu_count()} cores, "
        f"median of {args.rounds} interleaved rounds; fork server start (once per process, "
        f"first upload): {cold * 1e3:.0f} ms including that upload's check",
        "",
        "| bundle | bytes | direct load (before) ms | gate ms | gated registration ms "
        "| gated / direct |",
        "|---|---|---|---|---|---|",
    ]
    for label, nbytes, med in rows:
        lines.append(
            f"| {label} | {nbytes:,} | {med['direct'] * 1e3:.0f} | {med['gate'] * 1e3:.0f} | "
            f"{med['gated'] * 1e3:.0f} | {med['gated'] / med['direct']:.1f}x |"
        )
    table = "\n".join(lines)
    print(table)
    if args.save:
        (RESULTS / args.save).write_text(table + "\n")
    gate.shutdown()


if __name__ == "__main__":
    main()
