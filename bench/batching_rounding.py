"""Throughput of opt-in rounding batching vs exact batching vs none, 32 clients.

    .venv/bin/python bench/batching_rounding.py                 # n = 100 and 1e5
    .venv/bin/python bench/batching_rounding.py --sizes 100 --seconds 2 --rounds 3

Three ``dxserve serve`` processes run at once, identical but for batching:
``off`` (``DXSERVE_MAX_BATCH=1``), ``exact`` (the default: merged only where bit-identical)
and ``rounding`` (``DXSERVE_BATCHING=rounding``: merged where equal to rounding). ``wrk``
(``apt-get install wrk``) posts 16 different binary request bodies (Rosenbrock gradient,
16 different x) over 32 connections; rounds are interleaved with the server order
rotated. "merged" is the share of requests answered from a vmapped batch
(``dxserve_batched_requests_total``). Writes ``bench/results/batching-rounding-cpu.md``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import throughput
from _common import PYTHON, Server, Tee, free_port, machine_line, markdown_table

from dxcontract import codec

CONFIGS = {
    "off": {"DXSERVE_MAX_BATCH": "1"},
    "exact": {},
    "rounding": {"DXSERVE_BATCHING": "rounding"},
}
CLIENTS = 32
BODIES = 16


def write_script(folder: Path, n: int) -> Path:
    framing = set()
    for k in range(BODIES):
        x = np.linspace(-1.0, 1.5, n) + 0.01 * k
        body, ctype, headers = codec.encode_body(
            {"function": "rosenbrock", "backend": {"type": "jax-reverse"}, "x": x}, "binary")
        (folder / f"body{k + 1}.bin").write_bytes(body)
        framing.add((ctype, *headers.items()))
    assert len(framing) == 1, "every body must share one header length"
    ctype, (hl_name, hl) = next(iter(framing))
    script = folder / "post.lua"
    script.write_text(throughput.LUA.format(
        folder=folder, count=BODIES, ctype=ctype, hl_name=hl_name, hl=hl))
    return script


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1e5")
    parser.add_argument("--seconds", type=float, default=3.0, help="per wrk run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--save", default="batching-rounding-cpu.md")
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found: apt-get install wrk")
    sizes = [int(float(s)) for s in args.sizes.split(",") if s.strip()]
    rows = []
    with tempfile.TemporaryDirectory(prefix="dxbench-") as tmp:
        tmpdir = Path(tmp)
        servers: dict[str, Server] = {}
        try:
            for name, env in CONFIGS.items():
                port = free_port()
                servers[name] = Server(
                    [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1", "--port",
                     str(port), "--store", str(tmpdir / f"store-{name}"), "--compilation-cache",
                     "", "--log-level", "warning"],
                    port, "/health", tmpdir / f"{name}.log",
                    env={k: v for k, v in os.environ.items() if not k.startswith("DXSERVE_")}
                    | env,
                )
            for n in sizes:
                folder = tmpdir / f"n{n}"
                folder.mkdir()
                script = write_script(folder, n)
                for _ in range(2):  # compile, and earn (or fail) each bucket, before timing
                    for srv in servers.values():
                        throughput._wrk(srv.url, script, CLIENTS, args.seconds)
                runs: dict[str, list] = {name: [] for name in servers}
                names = list(servers)
                for r in range(args.rounds):
                    for name in names[r % len(names):] + names[: r % len(names)]:
                        srv = servers[name]
                        total0, merged0 = throughput._merged(srv.url)
                        rps, p50, errors = throughput._wrk(srv.url, script, CLIENTS, args.seconds)
                        total1, merged1 = throughput._merged(srv.url)
                        share = (merged1 - merged0) / max(1.0, total1 - total0)
                        runs[name].append((rps, p50, share, errors))
                off = float(np.median([r[0] for r in runs["off"]]))
                for name, got in runs.items():
                    rps = float(np.median([r[0] for r in got]))
                    rows.append([
                        f"{n:.0e}" if n >= 1000 else n, name, f"{rps:.0f}", f"{rps / off:.2f}x",
                        f"{np.median([r[1] for r in got]):.2f}",
                        f"{np.median([r[2] for r in got]):.0%}", sum(r[3] for r in got),
                    ])
                print(f"  n={n} done", file=sys.stderr)
        finally:
            for srv in servers.values():
                srv.stop()
    out = Tee()
    out("# Rounding batching (opt-in) vs exact batching vs none: POST /gradient, 32 clients")
    out()
    out(f"{machine_line()}; Rosenbrock, binary encoding, wrk with {CLIENTS} connections "
        f"over {BODIES} different bodies; medians of {args.rounds} interleaved runs of "
        f"{args.seconds:g} s; the three servers run at once (idle ones cost nothing).")
    out()
    out(markdown_table(["n", "batching", "req/s", "vs off", "p50 ms", "merged", "errors"], rows))
    out()
    out("off: `DXSERVE_MAX_BATCH=1`; exact: the default (a bucket is merged only where its "
        "vmapped rows are bit-identical to unbatched runs); rounding: "
        "`DXSERVE_BATCHING=rounding` (merged where rows agree to 256 units of roundoff of "
        "each result's scale, `request_batching.agree_to_rounding`).")
    if args.save:
        print(f"saved {out.save(args.save)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
