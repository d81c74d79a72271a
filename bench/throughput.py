"""Throughput under concurrent clients: POST /gradient (Rosenbrock, n = 100).

The load generator is ``wrk`` (C, one thread, so it does not eat the server's
CPU; ``apt-get install wrk``) replaying the request bytes the Python client sends
in its default binary encoding; the same load through ``dxclient.AsyncClient``
follows. Each server configuration runs in its own process:

* ``inline``: warm cheap jobs run on the event loop when the worker is idle (the default);
* ``workers``: every job goes to the device worker thread (``DXSERVE_INLINE_BELOW=0``);

each with request batching on (the default, ``DXSERVE_MAX_BATCH=32``) and off
(``DXSERVE_MAX_BATCH=1``), plus a twin of each ``off`` in a second process: two
processes of one configuration differ by several percent on a small VM, and a twin's
"vs off" shows by how much. wrk cycles through 16 different request bodies (16
different x), so merged batches hold different inputs. "merged" is the share of
requests answered from a vmapped batch (``dxserve_batched_requests_total``).

Target: 32 clients >= 1.8x a single sequential client, zero errors;
batching on never slower than off.

    .venv/bin/python bench/throughput.py [--seconds 2] [--rounds 5] [--n 100] [--save '']
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

from dxclient import AsyncClient, Client
from dxcontract import codec

N = 100
CONCURRENCY = (1, 8, 32, 64)
CONFIGS = {
    ("inline", "on"): {},
    ("inline", "off"): {"DXSERVE_MAX_BATCH": "1"},
    ("workers", "on"): {"DXSERVE_INLINE_BELOW": "0"},
    ("workers", "off"): {"DXSERVE_INLINE_BELOW": "0", "DXSERVE_MAX_BATCH": "1"},
    # a second process of the same configuration: its "vs off" is the process-to-process
    # noise of this machine, the band inside which on/off differences mean nothing
    ("inline", "off-twin"): {"DXSERVE_MAX_BATCH": "1"},
    ("workers", "off-twin"): {"DXSERVE_INLINE_BELOW": "0", "DXSERVE_MAX_BATCH": "1"},
}
BODIES = 16

LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "{ctype}"
wrk.headers["Accept"] = "{ctype}"
wrk.headers["{hl_name}"] = "{hl}"
local bodies = {{}}
for i = 1, {count} do
  local f = io.open("{folder}/body" .. i .. ".bin", "rb")
  bodies[i] = f:read("*a")
  f:close()
end
local i = 0
request = function()
  i = i % {count} + 1
  return wrk.format(nil, nil, nil, bodies[i])
end
"""


def _request_bytes(k: int) -> tuple[bytes, str, dict[str, str]]:
    x = np.linspace(-1.0, 1.5, N) + 0.01 * k
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


def _merged(url: str) -> tuple[float, float]:
    """(requests answered, requests answered from a merged batch) so far."""
    import httpx

    text = httpx.get(url + "/metrics").text
    total = merged = 0.0
    for line in text.splitlines():
        if line.startswith('dxserve_requests_total{route="/gradient",status="200"}'):
            total = float(line.split()[-1])
        elif line.startswith("dxserve_batched_requests_total "):
            merged = float(line.split()[-1])
    return total, merged


def _measure(servers: dict, script: Path, seconds: float, rounds: int) -> list[list]:
    seq = {cfg: _sequential_client(srv.url, seconds) for cfg, srv in servers.items()}
    runs: dict[tuple, list] = {}
    configs = list(servers)
    for r in range(rounds):
        for c in CONCURRENCY:
            # each round starts with another server: none always runs right after a given one
            for cfg in configs[r % len(configs):] + configs[: r % len(configs)]:
                srv = servers[cfg]
                total0, merged0 = _merged(srv.url)
                rps, p50, errors = _wrk(srv.url, script, c, seconds)
                total1, merged1 = _merged(srv.url)
                share = (merged1 - merged0) / max(1.0, total1 - total0)
                runs.setdefault((cfg, c), []).append((rps, p50, share, errors))
    med = {k: float(np.median([r[0] for r in v])) for k, v in runs.items()}
    rows = []
    for cfg, srv in servers.items():
        mode, batching = cfg
        rows.append([mode, batching, "dxclient.Client, sequential", 1, f"{seq[cfg]:.0f}",
                     "1.00x", "-", "-", "-", "-", 0])
        for c in CONCURRENCY:
            got = runs[cfg, c]
            rps = med[cfg, c]
            off = med[(mode, "off"), c]
            rows.append([
                mode, batching, "wrk", c, f"{rps:.0f}", f"{rps / seq[cfg]:.2f}x",
                f"{rps / med[cfg, 1]:.2f}x", f"{rps / off:.2f}x",
                f"{np.median([r[1] for r in got]):.2f}", f"{np.median([r[2] for r in got]):.0%}",
                sum(r[3] for r in got),
            ])
        for c in CONCURRENCY:
            rps, errors = _async_clients(srv.url, c, seconds)
            rows.append([mode, batching, "dxclient.AsyncClient", c, f"{rps:.0f}",
                         f"{rps / seq[cfg]:.2f}x", "-", "-", "-", "-", errors])
    return rows


def main() -> None:
    global N
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=2.0, help="per wrk run")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved wrk runs per row")
    parser.add_argument("--n", type=int, default=N, help="size of x (default %(default)s)")
    parser.add_argument("--save", default="throughput-cpu.md")
    args = parser.parse_args()
    N = args.n
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found: apt-get install wrk")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        framing = set()
        for k in range(BODIES):
            body, ctype, headers = _request_bytes(k)
            (tmp / f"body{k + 1}.bin").write_bytes(body)
            framing.add((ctype, *headers.items()))
        assert len(framing) == 1, "every body must share one header length"
        ctype, (hl_name, hl) = next(iter(framing))
        script = tmp / "post.lua"
        script.write_text(
            LUA.format(folder=tmp, count=BODIES, ctype=ctype, hl_name=hl_name, hl=hl)
        )
        servers = {}
        try:
            for (mode, batching), env in CONFIGS.items():  # all up at once: idle ones cost nothing
                port = free_port()
                argv = [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1", "--port",
                        str(port), "--store", str(tmp / f"store-{mode}-{batching}"),
                        "--compilation-cache", "", "--log-level", "warning"]
                os.environ.update(env)
                try:
                    servers[mode, batching] = Server(
                        argv, port, "/health", tmp / f"{mode}-{batching}.log"
                    )
                finally:
                    for key in env:
                        os.environ.pop(key, None)
            rows = _measure(servers, script, args.seconds, args.rounds)
        finally:
            for srv in servers.values():
                srv.stop()
    out = Tee()
    out(machine_line())
    out(f"POST /gradient, rosenbrock n = {N}, binary encoding; wrk rows: median of "
        f"{args.rounds} runs of {args.seconds:g} s, interleaved across the six servers (all "
        "running at once, the order rotated each round); 'vs sequential' = req/s over the "
        "sequential dxclient.Client's on "
        "the same server; 'vs wrk c=1' = over wrk with one connection; 'vs off' = over the "
        "same row with batching off (for off-twin: over its twin, the noise band)")
    out()
    out(markdown_table(
        ["server", "batching", "load", "clients", "req/s", "vs sequential", "vs wrk c=1",
         "vs off", "p50 ms", "merged", "errors"], rows))
    out()
    out("Target: 32 clients >= 1.8x a single sequential client, zero errors; batching on "
        "never slower than off.")
    if args.save:
        out.save(args.save)


if __name__ == "__main__":
    main()
