"""Round-trip latency of POST /gradient against a bare FastAPI echo and the raw loopback floor.

    .venv/bin/python bench/latency.py           # n = 10, 1e3, 1e5, 1e6
    .venv/bin/python bench/latency.py --quick   # fewer rounds

Starts two servers on 127.0.0.1 (random free ports) and stops them by PID:
``dxserve serve`` (examples registered, fresh temporary store, no persistent
compilation cache) and ``bench/echo_app.py`` (``POST /echo`` returns the body),
both under uvicorn with the same settings and the same log level. The echo process
also serves the raw floor (``echo_app.py --raw-port``): a plain socket server.

For each n and encoding (binary, b64, json) it times, interleaved:

* dxserve: ``dxclient.Client(encoding=...).gradient("rosenbrock", JaxReverse(), x)``,
  the whole user-visible call (client encode, HTTP, server, client decode);
* echo: the client's own HTTP stack posting the exact request bytes and headers that
  encoding produces to ``/echo`` (transport only: the bytes are encoded once) through
  ``dxclient.transport.FastPath``, as ``Client`` sends an operator call;
* raw: the same number of bytes each way over a plain loopback socket: the HTTP
  request the client sends (request line, headers, body) written with one ``sendmsg``,
  dxserve's whole answer (status line, headers, body) read with ``recv_into`` into a
  fresh buffer of its size; no HTTP parsing on either side (the floor);
* async: ``dxclient.AsyncClient`` (default encoding, binary), each call awaited and
  timed inside a coroutine (as its user sees it), one ``loop.run_until_complete`` per
  call;
* in process: ``dxserve.gradient(rosenbrock, JaxReverse(), x, prep=prep)``, blocked.

Targets: n = 10 within 1.35x of the echo in every encoding; the default encoding
(binary) within 1.6x of the raw floor at n = 10^6 and 3x at 10^5; the async client
within 1.1x of the sync one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import jax
import numpy as np
from _common import (
    PYTHON,
    SelfTimed,
    Server,
    Tee,
    free_port,
    interleaved,
    machine_line,
    markdown_table,
    median,
    ms,
)
from _floor import RawFloor, request_head, response_size

import dxserve
from dxclient import AsyncClient, Client, _models
from dxclient.transport import FastPath
from dxserve import JaxReverse
from dxserve.examples import rosenbrock

ENCODINGS = ("binary", "b64", "json")
SMALL_TARGET = 1.35
#: dxserve (binary) / raw floor, by n
FLOOR_TARGETS = {10**5: 3.0, 10**6: 1.6}
ASYNC_TARGET = 1.1


class Echo:
    """Posts request bytes to the echo as ``Client`` sends an operator call: through
    ``dxclient.transport.FastPath`` for its httpx client."""

    def __init__(self, url: str) -> None:
        self.target = httpx.URL(url + "/echo")
        self.http = httpx.Client(timeout=600.0)
        self.fast = FastPath()

    def post(self, call: _models.Call) -> bytes:
        answer = self.fast.send(self.http, "POST", self.target, call.headers, (call.body,))
        assert answer is not None
        return answer.content

    def close(self) -> None:
        self.fast.close()
        self.http.close()


def rounds_for(n: int, quick: bool) -> int:
    if n >= 10**6:
        return 5 if quick else 31
    if n >= 10**5:
        return 11 if quick else 101
    return 31 if quick else 151


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,1e3,1e5,1e6", help="comma-separated n")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--log-level", default="info", help="uvicorn log level of both servers")
    parser.add_argument("--save", default="latency-cpu.md", help="file under bench/results ('' = none)")
    parser.add_argument("--json", default="", help="also write the medians (seconds) to this file")
    args = parser.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",") if s.strip()]

    out = Tee()
    backend = JaxReverse()
    with tempfile.TemporaryDirectory(prefix="dxbench-") as tmp:
        tmpdir = Path(tmp)
        dx_port, echo_port, raw_port = free_port(), free_port(), free_port()
        dx = Server(
            [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(dx_port),
             "--store", str(tmpdir / "store"), "--compilation-cache", "", "--log-level", args.log_level],
            dx_port, "/health", tmpdir / "dxserve.log",
        )
        try:
            echo = Server(
                [PYTHON, str(Path(__file__).resolve().parent / "echo_app.py"), "--port", str(echo_port),
                 "--log-level", args.log_level, "--raw-port", str(raw_port)],
                echo_port, "/health", tmpdir / "echo.log",
            )
        except BaseException:
            dx.stop()
            raise
        try:
            rows, async_rows, medians = run(sizes, args.quick, backend, dx.url, echo.url, raw_port)
        finally:
            echo.stop()
            dx.stop()

    out("# POST /gradient round trip vs a bare FastAPI echo and the raw loopback floor "
        "(Rosenbrock, float64)")
    out()
    out(f"{machine_line()}; loopback, uvicorn log level {args.log_level} on both servers; "
        "medians of interleaved rounds (rounds per n: "
        + ", ".join(f"{n:.0e}: {rounds_for(n, args.quick)}" for n in sizes) + ").")
    out()
    header = ["n", "encoding", "dxserve ms", "echo ms", "raw ms", "in-process ms",
              "dxserve/echo", "dxserve/raw", "echo/raw", "bytes (request)", "bytes (answer)"]
    out(markdown_table(header, rows))
    out()
    out("## AsyncClient vs Client (binary)")
    out()
    out(markdown_table(["n", "Client ms", "AsyncClient ms", "async/sync"], async_rows))
    out()
    out(f"Targets: n = 10 dxserve/echo <= {SMALL_TARGET}x in every encoding (larger n: "
        "shown, no target); binary "
        + ", ".join(f"n = {n:.0e} dxserve/raw <= {t}x" for n, t in FLOOR_TARGETS.items())
        + f"; async/sync <= {ASYNC_TARGET}x. dxserve = the whole `dxclient.Client.gradient` "
        "call (client encode + HTTP + server + client decode); echo = the client's own HTTP "
        "stack posting the same request bytes to `POST /echo` (no client encoding), the "
        "way `Client` sends an operator call (`dxclient.transport.FastPath`); raw = the "
        "same byte counts each way (whole HTTP request, whole HTTP answer) over a plain "
        "loopback socket, `sendmsg` out and `recv_into` a fresh buffer in, no HTTP; "
        "in-process = `dxserve.gradient(..., prep=prep)` blocked until ready. AsyncClient "
        "calls are awaited and timed inside a coroutine, as their user sees them.")
    if args.save:
        print(f"saved {out.save(args.save)}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(medians))
    return 0


def run(
    sizes: list[int], quick: bool, backend: JaxReverse, dx_url: str, echo_url: str, raw_port: int
) -> tuple[list, list, list[dict]]:
    """The latency table's rows, the async table's rows, and every row's medians in
    seconds (``{"n", "encoding", "dxserve", "echo", "raw", "in_process"}``, plus
    ``"client"`` and ``"async"`` for binary)."""
    rows, async_rows, medians = [], [], []
    started = time.perf_counter()
    raw = RawFloor(raw_port)
    loop = asyncio.new_event_loop()
    aclient = AsyncClient(dx_url, timeout=600.0)
    http = httpx.Client(base_url=dx_url, timeout=600.0)
    # each encoding its own client (and connection pool), as users would have it
    clients = {enc: Client(dx_url, encoding=enc, timeout=600.0) for enc in ENCODINGS}
    # the echo goes through the client's own HTTP stack: the same on both sides of the
    # ratio (its URL parsed once, as dxclient.Client does for its operator URLs)
    echo = Echo(echo_url)
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
                answer = http.post("/gradient", content=call.body, headers=call.headers)
                head = request_head(httpx.URL(dx_url + "/gradient"), call.headers, call.body)
                sizes_by_enc[enc] = (len(head) + len(call.body), response_size(answer))
                assert echo.post(call) == call.body
                candidates[f"dxserve {enc}"] = lambda c=client, x=x: c.gradient("rosenbrock", backend, x)
                candidates[f"echo {enc}"] = lambda c=call: echo.post(c)
                candidates[f"raw {enc}"] = lambda h=head, c=call, k=sizes_by_enc[enc][1]: (
                    raw.exchange(h, c.body, k))
            # Each encoding's dxserve / echo / raw trio is timed as its own interleaved
            # group (shuffled each round): in one round robin over everything, a call
            # after in-process JAX (XLA's threads still spinning) or after a 2 MB JSON
            # call (memory being freed) pays for its neighbour, not for itself.
            times = interleaved({"in-process": candidates.pop("in-process")},
                                rounds_for(n, quick), budget_seconds=60)
            for enc in ENCODINGS:
                group = {k: candidates[k] for k in (f"dxserve {enc}", f"echo {enc}", f"raw {enc}")}
                times.update(interleaved(group, rounds_for(n, quick), budget_seconds=120,
                                         shuffle=True))
            # Client vs AsyncClient apart, A/B: in the big round robin each would follow
            # a different neighbour (a 2 MB JSON call before one of them costs it ~0.5 ms
            # at 1e5 in freed-memory effects that are no client's own)
            async def awaited(x: np.ndarray = x) -> float:
                start = time.perf_counter()
                await aclient.gradient("rosenbrock", backend, x)
                return time.perf_counter() - start

            pair = {
                "dxserve binary": candidates["dxserve binary"],
                "async binary": SelfTimed(lambda awaited=awaited: loop.run_until_complete(awaited())),
            }
            np.testing.assert_allclose(
                loop.run_until_complete(aclient.gradient("rosenbrock", backend, x)),
                expected, rtol=1e-12, atol=0,
            )
            both = interleaved(pair, rounds_for(n, quick), budget_seconds=120)
            inproc = median(times["in-process"])
            label = f"{n:.0e}" if n >= 1000 else str(n)
            for enc in ENCODINGS:
                d, e = median(times[f"dxserve {enc}"]), median(times[f"echo {enc}"])
                r = median(times[f"raw {enc}"])
                small = d / e
                flag_small = (" ok" if small <= SMALL_TARGET else " MISS") if n <= 10 else ""
                target = FLOOR_TARGETS.get(n) if enc == "binary" else None
                flag_raw = "" if target is None else (" ok" if d / r <= target else " MISS")
                medians.append({"n": n, "encoding": enc, "dxserve": d, "echo": e, "raw": r,
                                "in_process": inproc})
                rows.append([label, enc, ms(d), ms(e), ms(r), ms(inproc),
                             f"{small:.2f}x{flag_small}", f"{d / r:.2f}x{flag_raw}", f"{e / r:.2f}x",
                             f"{sizes_by_enc[enc][0]:,}", f"{sizes_by_enc[enc][1]:,}"])
            s_, a_ = median(both["dxserve binary"]), median(both["async binary"])
            medians.append({"n": n, "encoding": "binary", "client": s_, "async": a_})
            flag = " ok" if a_ / s_ <= ASYNC_TARGET else " MISS"
            async_rows.append([label, ms(s_), ms(a_), f"{a_ / s_:.2f}x{flag}"])
            print(f"  n={n:.0e} done ({len(times['in-process'])} rounds, "
                  f"{time.perf_counter() - started:.0f} s so far)", file=sys.stderr)
    finally:
        http.close()
        echo.close()
        for client in clients.values():
            client.close()
        loop.run_until_complete(aclient.aclose())
        loop.close()
        raw.close()
    return rows, async_rows, medians


if __name__ == "__main__":
    raise SystemExit(main())
