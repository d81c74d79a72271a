"""Throughput under concurrent clients: POST /gradient (Rosenbrock, n = 100).

The load generator is ``wrk`` (C, one thread, so it does not eat the server's
CPU; ``apt-get install wrk``) replaying the request bytes the Python client sends
in its default binary encoding; the same load through ``dxclient.AsyncClient``
follows. Each server configuration runs in its own process:

* ``inline``: warm cheap jobs run on the event loop (the default);
* ``workers``: every job goes to the device worker thread (``DXSERVE_INLINE_BELOW=0``).

Target (issue 6): 32 clients >= 1.8x a single sequential client, zero errors.

    .venv/bin/python bench/throughput.py [--seconds 5] [--save '']
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import PYTHON, Server, Tee, free_port, machine_line, markdown_table

from dxclient import AsyncClient, Client, codec

N = 100
CONCURRENCY = (1, 8, 32, 64)
CONFIGS = {"inline": {}, "workers": {"DXSERVE_INLINE_BELOW": "0"}}

LUA = """
wrk.method = "POST"
local f = io.open("{body}", "rb")
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "{ctype}"
wrk.headers["Accept"] = "{ctype}"
wrk.headers["{hl_name}"] = "{hl}"
"""


def _request_bytes() -> tuple[bytes, str, dict[str, str]]:
    x = np.linspace(-1.0, 1.5, N)
    payload = {"function": "rosenbrock", "backend": {"type": "jax-reverse"}, "x": x}
    return codec.encode_body(payload, "binary")


def _wrk(url: str, script: Path, connections: int, seconds: float) -> tuple[float, float, int]:
    """(requests/s, p50 latency ms, errors) from one wrk run."""
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency", "-s", str(script),
         url + "/gradient"],
        capture_output=True, text=True, check=True, timeout=seconds + 60,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    p50 = re.search(r"50%\s+([\d.]+)(us|ms|s)", out)
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[p50.group(2)]
    errors = 0
    for pattern in (r"Non-2xx or 3xx responses: (\d+)", r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)"):
        m = re.search(pattern, out)
        if m:
            errors += sum(int(g) for g in m.groups())
    return rps, float(p50.group(1)) * scale, errors


def _sequential_client(url: str, seconds: float) -> float:
    x = np.linspace(-1.0, 1.5, N)
    with Client(url) as client:
        client.gradient("rosenbrock", "jax-reverse", x)
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            client.gradient("rosenbrock", "jax-reverse", x)
            count += 1
        return count / (time.perf_counter() - start)


def _async_clients(url: str, concurrency: int, seconds: float) -> tuple[float, int]:
    x = np.linspace(-1.0, 1.5, N)

    async def run() -> tuple[int, int]:
        done = errors = 0
        async with AsyncClient(url) as client:
            await client.gradient("rosenbrock", "jax-reverse", x)
            stop = time.perf_counter() + seconds

            async def one() -> None:
                nonlocal done, errors
                while time.perf_counter() < stop:
                    try:
                        await client.gradient("rosenbrock", "jax-reverse", x)
                        done += 1
                    except Exception:
                        errors += 1

            await asyncio.gather(*(one() for _ in range(concurrency)))
        return done, errors

    start = time.perf_counter()
    done, errors = asyncio.run(run())
    return done / (time.perf_counter() - start), errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--save", default="throughput-cpu.md")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found: apt-get install wrk")
    body, ctype, headers = _request_bytes()
    (hl_name, hl), = headers.items()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "body.bin").write_bytes(body)
        script = tmp / "post.lua"
        script.write_text(LUA.format(body=tmp / "body.bin", ctype=ctype, hl_name=hl_name, hl=hl))
        for config, env in CONFIGS.items():
            port = free_port()
            argv = [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1", "--port",
                    str(port), "--store", str(tmp / f"store-{config}"), "--compilation-cache", "",
                    "--log-level", "warning"]
            os.environ.update(env)
            try:
                with Server(argv, port, "/health", tmp / f"{config}.log") as srv:
                    seq = _sequential_client(srv.url, args.seconds)
                    rows.append([config, "dxclient.Client, sequential", 1, f"{seq:.0f}", "1.00x", "-", 0])
                    for c in CONCURRENCY:
                        rps, p50, errors = _wrk(srv.url, script, c, args.seconds)
                        rows.append([config, "wrk", c, f"{rps:.0f}", f"{rps / seq:.2f}x", f"{p50:.2f}", errors])
                    for c in CONCURRENCY:
                        rps, errors = _async_clients(srv.url, c, args.seconds)
                        rows.append([config, "dxclient.AsyncClient", c, f"{rps:.0f}", f"{rps / seq:.2f}x", "-", errors])
            finally:
                for key in env:
                    os.environ.pop(key, None)
    out = Tee()
    out(machine_line())
    out(f"POST /gradient, rosenbrock n = {N}, binary encoding, {args.seconds:g} s per row; "
        "ratio = requests/s over the sequential dxclient.Client's")
    out()
    out(markdown_table(["server", "load", "clients", "req/s", "vs sequential", "p50 ms", "errors"], rows))
    out()
    out("Target: 32 clients >= 1.8x a single sequential client, zero errors. Request batching "
        "(merging concurrent requests into one vmapped call) is not implemented: see "
        "bench/batching_bits.py for why it cannot be bit-identical on XLA:CPU.")
    if args.save:
        out.save(args.save)


if __name__ == "__main__":
    main()
