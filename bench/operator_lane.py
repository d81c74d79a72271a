"""Small operator POSTs with the operator lane on (the default) and off, beside the echo.

    .venv/bin/python bench/operator_lane.py            # n = 10 and 1e3
    .venv/bin/python bench/operator_lane.py --quick

Two dxserve servers alike but for ``DXSERVE_OPERATOR_LANE`` (``http/lane.py``: small
operator POSTs served from the HTTP protocol, without uvicorn's ASGI cycle and the
middleware) and ``bench/echo_app.py``, all on 127.0.0.1 with log level warning. For
each n and encoding, ``Client.gradient`` against each server and the echo posting the
same request bytes (as in ``bench/latency.py``) are timed as one shuffled interleaved
group. The server CPU time per call (all threads, from ``/proc``) is read over a run
of calls against each dxserve server in turn.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

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
from latency import ENCODINGS, SMALL_TARGET, Echo

import dxserve
from dxclient import Client, _models
from dxserve import JaxReverse
from dxserve.examples import rosenbrock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,1e3", help="comma-separated n")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--save", default="operator-lane-cpu.md",
                        help="file under bench/results ('' = none)")
    args = parser.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",") if s.strip()]
    rounds = 201 if args.quick else 1001
    cpu_calls = 500 if args.quick else 3000

    out = Tee()
    with tempfile.TemporaryDirectory(prefix="dxbench-") as tmp:
        tmpdir = Path(tmp)
        servers: dict[str, Server] = {}
        try:
            for name, lane in (("lane", "true"), ("asgi", "false")):
                port = free_port()
                servers[name] = Server(
                    [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1",
                     "--port", str(port), "--store", str(tmpdir / name),
                     "--compilation-cache", "", "--log-level", "warning"],
                    port, "/health", tmpdir / f"{name}.log",
                    env={"DXSERVE_OPERATOR_LANE": lane},
                )
            port = free_port()
            servers["echo"] = Server(
                [PYTHON, str(Path(__file__).resolve().parent / "echo_app.py"),
                 "--port", str(port), "--log-level", "warning"],
                port, "/health", tmpdir / "echo.log",
            )
            rows, cpu_rows = run(sizes, rounds, cpu_calls, servers)
        finally:
            for server in servers.values():
                server.stop()

    out("# Small operator POSTs: the operator lane on and off, beside a bare FastAPI echo")
    out()
    out(f"{machine_line()}; loopback, uvicorn log level warning on every server; "
        f"medians of {rounds} shuffled interleaved rounds per row.")
    out()
    out(markdown_table(
        ["n", "encoding", "lane ms", "ASGI ms", "echo ms", "lane/ASGI", "lane/echo",
         "ASGI/echo"],
        rows,
    ))
    out()
    out(f"Target: n = 10 dxserve/echo <= {SMALL_TARGET}x in every encoding. lane = "
        "`DXSERVE_OPERATOR_LANE=true` (the default), ASGI = `false`; both through the "
        "default `Client`. echo = the client's own HTTP stack posting the same request "
        "bytes to `POST /echo`.")
    out()
    out("## Server CPU time per call (binary)")
    out()
    out(markdown_table(["n", "lane µs", "ASGI µs", "lane/ASGI"], cpu_rows))
    out()
    out(f"CPU time of every thread of the server process (schedstat) over {cpu_calls} "
        "calls, one server after the other, divided by the calls.")
    if args.save:
        print(f"saved {out.save(args.save)}", file=sys.stderr)
    return 0


def run(
    sizes: list[int], rounds: int, cpu_calls: int, servers: dict[str, Server]
) -> tuple[list, list]:
    backend = JaxReverse()
    echo = Echo(servers["echo"].url)
    clients = {
        (name, enc): Client(servers[name].url, encoding=enc, timeout=600.0)
        for name in ("lane", "asgi") for enc in ENCODINGS
    }
    rows, cpu_rows = [], []
    try:
        for n in sizes:
            x = np.random.default_rng(n).uniform(-1.5, 1.5, n)
            expected = np.asarray(dxserve.gradient(rosenbrock, backend, x))
            label = f"{n:.0e}" if n >= 1000 else str(n)
            for enc in ENCODINGS:
                call = _models.operator_call("gradient", "rosenbrock", backend, x, None, (), None, enc)
                assert echo.post(call) == call.body
                group = {"echo": lambda c=call: echo.post(c)}
                for name in ("lane", "asgi"):
                    client = clients[name, enc]
                    np.testing.assert_allclose(
                        client.gradient("rosenbrock", backend, x), expected, rtol=1e-12, atol=0
                    )
                    group[name] = lambda c=client, x=x: c.gradient("rosenbrock", backend, x)
                times = {k: median(v) for k, v in interleaved(
                    group, rounds, budget_seconds=120, shuffle=True).items()}
                lane, asgi, e = times["lane"], times["asgi"], times["echo"]
                rows.append([label, enc, ms(lane), ms(asgi), ms(e), f"{lane / asgi:.2f}x",
                             f"{lane / e:.2f}x", f"{asgi / e:.2f}x"])
            per_call = {
                name: _server_cpu(servers[name].proc.pid, lambda c=clients[name, "binary"], x=x:
                                  c.gradient("rosenbrock", backend, x), cpu_calls)
                for name in ("lane", "asgi")
            }
            cpu_rows.append([label, f"{per_call['lane'] * 1e6:.0f}", f"{per_call['asgi'] * 1e6:.0f}",
                             f"{per_call['lane'] / per_call['asgi']:.2f}x"])
            print(f"  n={n:.0e} done", file=sys.stderr)
    finally:
        echo.close()
        for c in clients.values():
            c.close()
    return rows, cpu_rows


def _server_cpu(pid: int, call: object, calls: int) -> float:
    """Seconds of server CPU time (all threads) per ``call()``."""
    for _ in range(100):
        call()  # type: ignore[operator]
    before = _cpu_seconds(pid)
    for _ in range(calls):
        call()  # type: ignore[operator]
    return (_cpu_seconds(pid) - before) / calls


def _cpu_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid`` so far (``/proc/PID/task/*/schedstat``, ns)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
    return total * 1e-9


if __name__ == "__main__":
    raise SystemExit(main())
