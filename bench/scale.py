"""Scaling out: one process, ``--workers 2``, Ray Serve with 1 and with 2 replicas.

POST /gradient of rosenbrock (n = 100, binary encoding, 16 different x) under 32
concurrent connections from ``wrk`` (C, one thread; ``apt-get install wrk``), plus one
connection for the per-request latency. Each row: requests/s and p50/p99 latency at 32
connections (medians over ``--rounds`` wrk runs), p50 at one connection.

* ``1 process`` and ``2 --workers`` run side by side and are measured interleaved
  (round robin), so the ratio is not a drift of the machine; target: 2
  workers >= 1.6x one process on a 2-core machine.
* ``Ray 1 replica`` and ``Ray 2 replicas`` (``dxserve ray``, each replica a full
  server behind Ray Serve's HTTP proxy) run after them, one at a time (Ray's own
  processes would disturb the others). "overhead" is a row's one-connection p50 minus
  the single process's: what Ray's proxy adds per request.

    .venv/bin/python bench/scale.py [--seconds 3] [--rounds 3] [--no-ray] [--save scale.md]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from _common import PYTHON, Server, Tee, free_port, machine_line, markdown_table

from dxcontract import codec

N = 100
BODIES = 16
CLIENTS = 32

LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "{ctype}"
wrk.headers["Accept"] = "{ctype}"
{extra}
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


def _script(folder: Path) -> Path:
    framing = set()  # the binary framing's headers: the same for every body of one shape
    for k in range(BODIES):
        x = np.linspace(-1.0, 1.5, N) + 0.01 * k
        body, ctype, headers = codec.encode_body(
            {"function": "rosenbrock", "backend": {"type": "jax-reverse"}, "x": x}, "binary"
        )
        framing.add((ctype, *headers.items()))
        (folder / f"body{k + 1}.bin").write_bytes(body)
    assert len(framing) == 1, framing
    ctype, *headers = framing.pop()
    extra = "\n".join(f'wrk.headers["{k}"] = "{v}"' for k, v in headers)
    script = folder / "gradient.lua"
    script.write_text(LUA.format(ctype=ctype, count=BODIES, folder=folder, extra=extra))
    return script


def _ms(match: re.Match) -> float:
    return float(match.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[match.group(2)]


def wrk(url: str, script: Path, connections: int, seconds: float) -> dict[str, float]:
    """One wrk run: requests/s, p50 and p99 (ms), errors (non-2xx and socket errors)."""
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency",
         "-s", str(script), url + "/gradient"],
        capture_output=True, text=True, check=True, timeout=seconds + 120,
    ).stdout
    errors = 0
    for pattern in (r"Non-2xx or 3xx responses: (\d+)",
                    r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)"):
        m = re.search(pattern, out)
        if m:
            errors += sum(int(g) for g in m.groups())
    return {
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
        "p50": _ms(re.search(r"50%\s+([\d.]+)(us|ms|s)\b", out)),
        "p99": _ms(re.search(r"99%\s+([\d.]+)(us|ms|s)\b", out)),
        "errors": errors,
    }


def measure(servers: dict[str, str], script: Path, seconds: float, rounds: int) -> dict[str, dict]:
    """Interleaved wrk runs over ``servers`` (name -> url): the medians of each."""
    for url in servers.values():  # warm: every worker/replica compiles its executable
        wrk(url, script, CLIENTS, 2)
    runs: dict[str, list[dict]] = {name: [] for name in servers}
    single: dict[str, list[float]] = {name: [] for name in servers}
    names = list(servers)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            runs[name].append(wrk(servers[name], script, CLIENTS, seconds))
            single[name].append(wrk(servers[name], script, 1, max(1.0, seconds / 2))["p50"])
    return {
        name: {
            "rps": statistics.median(x["rps"] for x in runs[name]),
            "p50": statistics.median(x["p50"] for x in runs[name]),
            "p99": statistics.median(x["p99"] for x in runs[name]),
            "errors": sum(x["errors"] for x in runs[name]),
            "c1": statistics.median(single[name]),
        }
        for name in names
    }


def serve(tmp: Path, name: str, *args: str) -> Server:
    port = free_port()
    argv = [PYTHON, "-m", "dxserve.cli", "serve", "--port", str(port),
            "--store", str(tmp / f"{name}-store"), "--compilation-cache", str(tmp / "jax-cache"),
            *args]
    return Server(argv, port, "/health", tmp / f"{name}.log")


def ray(tmp: Path, replicas: int) -> Server:
    port = free_port()
    argv = [PYTHON, "-m", "dxserve.cli", "ray", "--port", str(port), "--replicas", str(replicas),
            "--num-cpus", "0", "--store", str(tmp / f"ray{replicas}-store"),
            "--compilation-cache", str(tmp / "jax-cache")]
    server = Server(argv, port, "/health", tmp / f"ray{replicas}.log")
    # Ray's proxy answers (404) before the application is deployed: wait for a 200
    deadline = time.monotonic() + 180
    while _status(server.url + "/health") != 200:
        if time.monotonic() > deadline or server.proc.poll() is not None:
            server.stop()
            raise RuntimeError(f"Ray Serve not ready; see {server.log}")
        time.sleep(0.5)
    return server


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0


def wait_workers(url: str, n: int, timeout: float = 120) -> None:
    """Until ``n`` different worker processes have answered /metrics."""
    pids: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(pids) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(pids)} of {n} workers answered")
        text = httpx.get(url + "/metrics", timeout=5).text  # a new connection each time
        pids.update(re.findall(r'^dxserve_worker\{index="\d+",pid="(\d+)"\}', text, re.M))
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per wrk run at 32 clients")
    parser.add_argument("--rounds", type=int, default=3, help="wrk runs per row (median)")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray rows")
    parser.add_argument("--save", default="scale.md", help="file under bench/results ('' skips)")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found: apt-get install wrk")
    out = Tee()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        script = _script(tmp)
        with serve(tmp, "one") as one, serve(tmp, "two", "--workers", "2") as two:
            wait_workers(two.url, 2)
            results.update(measure({"1 process": one.url, "2 --workers": two.url}, script,
                                   args.seconds, args.rounds))
        if not args.no_ray:
            for replicas in (1, 2):
                label = f"Ray {replicas} replica{'s' if replicas > 1 else ''}"
                with ray(tmp, replicas) as server:
                    results.update(measure({label: server.url}, script, args.seconds, args.rounds))
    base = results["1 process"]
    rows = []
    for name, r in results.items():
        rows.append([
            name, f"{r['rps']:.0f}", f"{r['rps'] / base['rps']:.2f}x", f"{r['p50']:.1f}",
            f"{r['p99']:.1f}", f"{r['c1']:.2f}", f"{r['c1'] - base['c1']:+.2f}", r["errors"],
        ])
    out("# Scaling out: processes and Ray Serve replicas")
    out()
    out(machine_line())
    out()
    out(f"POST /gradient, rosenbrock n = {N}, binary encoding, {CLIENTS} wrk connections; "
        f"medians of {args.rounds} runs of {args.seconds:g} s (1 process and 2 --workers "
        "interleaved). c=1 p50: one connection. overhead: c=1 p50 minus the single "
        "process's.")
    out()
    out(markdown_table(
        ["server", "req/s", "vs 1 process", "p50 ms", "p99 ms", "c=1 p50 ms", "overhead ms",
         "errors"], rows))
    out()
    out(f"2 --workers / 1 process: {results['2 --workers']['rps'] / base['rps']:.2f}x "
        "(target >= 1.6x)")
    if "Ray 2 replicas" in results:
        r1, r2 = results["Ray 1 replica"], results["Ray 2 replicas"]
        out(f"Ray 2 replicas / 1 replica: {r2['rps'] / r1['rps']:.2f}x; Ray's per-request "
            f"overhead (c=1 p50): {r1['c1'] - base['c1']:+.2f} ms")
    if args.save:
        print(f"saved {out.save(args.save)}")


if __name__ == "__main__":
    main()
