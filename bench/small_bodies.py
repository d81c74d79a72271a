"""Small requests through httpx's own transport (the default) or urllib3's.

    .venv/bin/python bench/small_bodies.py            # n = 10 and 1e3
    .venv/bin/python bench/small_bodies.py --quick

``dxclient.transport.LargeBodies`` sends bodies from ``LARGE_MIN_BYTES`` (64 KiB) up
through urllib3 and leaves smaller ones to httpx's transport (httpcore and h11). This
benchmark asks what urllib3 would do for small bodies too
(``LargeBodies(min_bytes=0)``), on both sides of the latency table's ratio:

* Client: ``dxclient.Client(encoding=...).gradient("rosenbrock", JaxReverse(), x)``,
  with the default transport, and with ``transport=LargeBodies(min_bytes=0)``;
* echo: an ``httpx.Client`` posting the same request bytes to ``bench/echo_app.py``
  through ``LargeBodies()`` (as in ``bench/latency.py``) and through
  ``LargeBodies(min_bytes=0)``;
* AsyncClient (binary): the default transport (``AsyncFast``), and httpx's own
  (``httpx.AsyncHTTPTransport``), each call driven by ``loop.run_until_complete``.

Every encoding's six candidates are timed as one shuffled interleaved group against
the same two servers (dxserve and the echo, on 127.0.0.1, stopped by PID).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import httpx
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
from dxclient import AsyncClient, Client, _models
from dxclient.transport import LargeBodies
from dxserve import JaxReverse
from dxserve.examples import rosenbrock

ENCODINGS = ("binary", "b64", "json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,1e3", help="comma-separated n (small bodies)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--save", default="small-bodies-cpu.md",
                        help="file under bench/results ('' = none)")
    args = parser.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",") if s.strip()]
    rounds = 41 if args.quick else 201

    out = Tee()
    with tempfile.TemporaryDirectory(prefix="dxbench-") as tmp:
        tmpdir = Path(tmp)
        dx_port, echo_port = free_port(), free_port()
        dx = Server(
            [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(dx_port),
             "--store", str(tmpdir / "store"), "--compilation-cache", "",
             "--log-level", "warning"],
            dx_port, "/health", tmpdir / "dxserve.log",
        )
        try:
            echo = Server(
                [PYTHON, str(Path(__file__).resolve().parent / "echo_app.py"),
                 "--port", str(echo_port), "--log-level", "warning"],
                echo_port, "/health", tmpdir / "echo.log",
            )
        except BaseException:
            dx.stop()
            raise
        try:
            rows, async_rows = run(sizes, rounds, dx.url, echo.url)
        finally:
            echo.stop()
            dx.stop()

    out("# Small requests: httpx's transport (default) vs urllib3 for every body (\"fast path\")")
    out()
    out(f"{machine_line()}; loopback, uvicorn log level warning on both servers; "
        f"medians of {rounds} shuffled interleaved rounds per encoding.")
    out()
    out(markdown_table(
        ["n", "encoding", "Client ms (default)", "Client ms (fast path)", "fast/default",
         "echo ms (default)", "echo ms (fast path)", "dxserve/echo (default)",
         "dxserve/echo (fast path)"],
        rows,
    ))
    out()
    out("## AsyncClient (binary)")
    out()
    out(markdown_table(
        ["n", "AsyncClient ms (default)", "AsyncClient ms (fast path)", "fast/default",
         "async/sync (default)", "async/sync (fast path)"],
        async_rows,
    ))
    out()
    out("default = the transports as shipped (bodies under 64 KiB go through httpx's own "
        "transport; AsyncClient's through h11, `AsyncFast`); fast path = "
        "`LargeBodies(min_bytes=0)`, every body through urllib3, and for AsyncClient "
        "httpx's own `AsyncHTTPTransport`. "
        "The echo posts the request bytes that encoding produces, with no client encoding; "
        "each dxserve/echo ratio compares calls made through the same transport.")
    if args.save:
        print(f"saved {out.save(args.save)}", file=sys.stderr)
    return 0


def run(sizes: list[int], rounds: int, dx_url: str, echo_url: str) -> tuple[list, list]:
    backend = JaxReverse()
    loop = asyncio.new_event_loop()
    echo_target = httpx.URL(echo_url + "/echo")
    echoes = {
        # the client's own httpx client (cookies read only when an answer sets one)
        "default": httpx.Client(timeout=600.0, transport=LargeBodies()),
        "fast": httpx.Client(timeout=600.0, transport=LargeBodies(min_bytes=0)),
    }
    clients = {
        (enc, kind): Client(dx_url, encoding=enc, timeout=600.0, transport=transport)
        for enc in ENCODINGS
        for kind, transport in (("default", None), ("fast", LargeBodies(min_bytes=0)))
    }
    aclients = {
        "default": AsyncClient(dx_url, timeout=600.0),
        "fast": AsyncClient(dx_url, timeout=600.0, transport=httpx.AsyncHTTPTransport()),
    }
    rows, async_rows = [], []
    try:
        for n in sizes:
            x = np.random.default_rng(n).uniform(-1.5, 1.5, n)
            expected = np.asarray(dxserve.gradient(rosenbrock, backend, x))
            label = f"{n:.0e}" if n >= 1000 else str(n)
            sync_binary = {}
            for enc in ENCODINGS:
                call = _models.operator_call(
                    "gradient", "rosenbrock", backend, x, None, (), None, enc
                )
                group = {}
                for kind in ("default", "fast"):
                    client, echo_http = clients[enc, kind], echoes[kind]
                    np.testing.assert_allclose(
                        client.gradient("rosenbrock", backend, x), expected, rtol=1e-12, atol=0
                    )
                    assert echo_http.post(
                        echo_target, content=call.body, headers=call.headers
                    ).content == call.body
                    group[f"client {kind}"] = lambda c=client, x=x: c.gradient("rosenbrock", backend, x)
                    group[f"echo {kind}"] = lambda h=echo_http, c=call: h.post(
                        echo_target, content=c.body, headers=c.headers).content
                    if enc == "binary":
                        aclient = aclients[kind]
                        np.testing.assert_allclose(
                            loop.run_until_complete(aclient.gradient("rosenbrock", backend, x)),
                            expected, rtol=1e-12, atol=0,
                        )
                        group[f"async {kind}"] = lambda a=aclient, x=x: (
                            loop.run_until_complete(a.gradient("rosenbrock", backend, x)))
                times = {k: median(v) for k, v in interleaved(
                    group, rounds, budget_seconds=120, shuffle=True).items()}
                cd, cf = times["client default"], times["client fast"]
                ed, ef = times["echo default"], times["echo fast"]
                rows.append([label, enc, ms(cd), ms(cf), f"{cf / cd:.2f}x", ms(ed), ms(ef),
                             f"{cd / ed:.2f}x", f"{cf / ef:.2f}x"])
                if enc == "binary":
                    sync_binary = times
            ad, af = sync_binary["async default"], sync_binary["async fast"]
            async_rows.append([label, ms(ad), ms(af), f"{af / ad:.2f}x",
                               f"{ad / sync_binary['client default']:.2f}x",
                               f"{af / sync_binary['client fast']:.2f}x"])
            print(f"  n={n:.0e} done", file=sys.stderr)
    finally:
        for c in (*echoes.values(), *clients.values()):
            c.close()
        for a in aclients.values():
            loop.run_until_complete(a.aclose())
        loop.close()
    return rows, async_rows


if __name__ == "__main__":
    raise SystemExit(main())
