"""Round-trip latency of POST /gradient against a bare FastAPI echo.

    .venv/bin/python bench/latency.py           # n = 10, 1e3, 1e5, 1e6
    .venv/bin/python bench/latency.py --quick   # fewer rounds

Starts two servers on 127.0.0.1 (random free ports) and stops them by PID:
``dxserve serve`` (examples registered, fresh temporary store, no persistent
compilation cache) and ``bench/echo_app.py`` (``POST /echo`` returns the body),
both under uvicorn with the same settings and the same log level.

For each n and encoding (binary, b64, json) it times, interleaved:

* dxserve: ``dxclient.Client(encoding=...).gradient("rosenbrock", JaxReverse(), x)``,
  the whole user-visible call (client encode, HTTP, server, client decode);
* echo: the same ``httpx.Client`` posting the exact request bytes and headers that
  encoding produces to ``/echo`` (transport only: the bytes are encoded once);
* in process: ``dxserve.gradient(rosenbrock, JaxReverse(), x, prep=prep)``, blocked.

Targets: small requests within 1.3x of the echo; n = 10^6 within 1.5x of
(in-process + echo).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx
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
from dxclient import Client, _models
from dxserve import JaxReverse
from dxserve.examples import rosenbrock

ENCODINGS = ("binary", "b64", "json")
SMALL_TARGET = 1.3
LARGE_TARGET = 1.5


def rounds_for(n: int, quick: bool) -> int:
    if n >= 10**6:
        return 5 if quick else 15
    if n >= 10**5:
        return 11 if quick else 41
    return 31 if quick else 151


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,1e3,1e5,1e6", help="comma-separated n")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--log-level", default="info", help="uvicorn log level of both servers")
    parser.add_argument("--save", default="latency-cpu.md", help="file under bench/results ('' = none)")
    args = parser.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",") if s.strip()]

    out = Tee()
    backend = JaxReverse()
    with tempfile.TemporaryDirectory(prefix="dxbench-") as tmp:
        tmpdir = Path(tmp)
        dx_port, echo_port = free_port(), free_port()
        dx = Server(
            [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(dx_port),
             "--store", str(tmpdir / "store"), "--compilation-cache", "", "--log-level", args.log_level],
            dx_port, "/health", tmpdir / "dxserve.log",
        )
        try:
            echo = Server(
                [PYTHON, str(Path(__file__).resolve().parent / "echo_app.py"), "--port", str(echo_port),
                 "--log-level", args.log_level],
                echo_port, "/health", tmpdir / "echo.log",
            )
        except BaseException:
            dx.stop()
            raise
        try:
            rows = run(sizes, args.quick, backend, dx.url, echo.url)
        finally:
            echo.stop()
            dx.stop()

    out("# POST /gradient round trip vs a bare FastAPI echo (Rosenbrock, float64)")
    out()
    out(f"{machine_line()}; loopback, uvicorn log level {args.log_level} on both servers; "
        "medians of interleaved rounds (rounds per n: "
        + ", ".join(f"{n:.0e}: {rounds_for(n, args.quick)}" for n in sizes) + ").")
    out()
    header = ["n", "encoding", "dxserve ms", "echo ms", "dxserve/echo", "in-process ms",
              "dxserve/(in-process+echo)", "bytes (request)"]
    out(markdown_table(header, rows))
    out()
    out(f"Targets: small requests dxserve/echo <= {SMALL_TARGET}x; n = 10^6 "
        f"dxserve/(in-process+echo) <= {LARGE_TARGET}x. dxserve = the whole "
        "`dxclient.Client.gradient` call (client encode + HTTP + server + client decode); "
        "echo = the same httpx.Client posting the same request bytes to `POST /echo` (no "
        "client encoding); in-process = `dxserve.gradient(..., prep=prep)` blocked until ready.")
    if args.save:
        print(f"saved {out.save(args.save)}", file=sys.stderr)
    return 0


def run(sizes: list[int], quick: bool, backend: JaxReverse, dx_url: str, echo_url: str) -> list:
    rows = []
    started = time.perf_counter()
    http = httpx.Client(base_url=dx_url, timeout=600.0)
    # parsed once, as dxclient.Client does for its operator URLs: the echo pays no more
    # URL handling per request than the client does
    echo_target = httpx.URL(echo_url + "/echo")
    clients = {enc: Client(encoding=enc, http=http) for enc in ENCODINGS}
    try:
        for n in sizes:
            x = np.random.default_rng(n).uniform(-1.5, 1.5, n)
            prep = dxserve.prepare_gradient(rosenbrock, backend, x)
            expected = np.asarray(dxserve.gradient(rosenbrock, backend, x, prep=prep))
            candidates = {
                "in-process": lambda p=prep, x=x: jax.block_until_ready(
                    dxserve.gradient(rosenbrock, backend, x, prep=p))
            }
            sizes_by_enc = {}
            for enc in ENCODINGS:
                client = clients[enc]
                got = client.gradient("rosenbrock", backend, x)  # compiles on the server
                np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)
                call = _models.operator_call("gradient", "rosenbrock", backend, x, None, (), None, enc)
                sizes_by_enc[enc] = len(call.body)
                echoed = http.post(echo_url + "/echo", content=call.body, headers=call.headers)
                assert echoed.content == call.body
                candidates[f"dxserve {enc}"] = lambda c=client, x=x: c.gradient("rosenbrock", backend, x)
                candidates[f"echo {enc}"] = lambda c=call: http.post(
                    echo_target, content=c.body, headers=c.headers).content
            times = interleaved(candidates, rounds_for(n, quick), budget_seconds=240)
            inproc = median(times["in-process"])
            for enc in ENCODINGS:
                d, e = median(times[f"dxserve {enc}"]), median(times[f"echo {enc}"])
                small, large = d / e, d / (inproc + e)
                flag_small = (" ok" if small <= SMALL_TARGET else " MISS") if n <= 10**3 else ""
                flag_large = (" ok" if large <= LARGE_TARGET else " MISS") if n >= 10**6 else ""
                rows.append([f"{n:.0e}" if n >= 1000 else str(n), enc, ms(d), ms(e),
                             f"{small:.2f}x{flag_small}", ms(inproc), f"{large:.2f}x{flag_large}",
                             f"{sizes_by_enc[enc]:,}"])
            print(f"  n={n:.0e} done ({len(times['in-process'])} rounds, "
                  f"{time.perf_counter() - started:.0f} s so far)", file=sys.stderr)
    finally:
        http.close()
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
