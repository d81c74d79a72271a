"""Where a large served gradient's time goes, wire included: each step of POST /gradient.

    .venv/bin/python bench/profile_wire.py              # n = 1e5 and 1e6, every encoding
    .venv/bin/python bench/profile_wire.py --sizes 1e6 --rounds 5

Starts ``dxserve serve`` and ``bench/echo_app.py`` (for its raw loopback floor) on
127.0.0.1 and times, interleaved, for each encoding:

* client encode: ``dxclient._models.operator_call`` (what ``Client.gradient`` does
  first), in process;
* request on the wire: the raw floor one way (the whole HTTP request's bytes over a
  plain loopback socket, 1 byte back);
* server receive + decode, compute (queue + compute) and server encode: the server's
  own ``Server-Timing`` of real requests (``decode`` runs from the request's headers to
  the service call, so it holds receiving the body); beside it the decode alone, in
  process (``decode_operator_request``), so receive = the difference;
* answer on the wire: the raw floor one way (the whole answer's bytes);
* client decode: ``dxclient._models.operator_result``, in process;
* the whole ``Client.gradient`` call, and what it leaves over the steps above
  (``rest``: both transfers, HTTP parsing on both sides, the server sending the answer).

Writes ``bench/results/profile-wire-cpu.md`` (``--save ''``: print only).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
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
from latency import RawFloor, request_head, response_size

from dxclient import Client, _models
from dxcontract import codec
from dxcontract.operators import OPERATORS
from dxserve import JaxReverse
from dxserve.pipeline.wire import decode_operator_request

ENCODINGS = ("binary", "b64", "json")
STEPS = [
    "client encode", "request on the wire (raw, one way)", "server receive + decode (Server-Timing)",
    "  of which decode (in process)", "compute (Server-Timing queue + compute)",
    "server encode (Server-Timing)", "answer on the wire (raw, one way)", "client decode",
    "whole Client.gradient call", "rest (HTTP both ways, sending the answer)",
]


def server_timing(header: str) -> dict[str, float]:
    """``Server-Timing`` -> {name: seconds}."""
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            out[name] = float(dur) / 1e3
    return out


def profile(n: int, enc: str, url: str, raw: RawFloor, rounds: int) -> dict[str, float]:
    backend = JaxReverse()
    op = OPERATORS["gradient"]
    x = np.random.default_rng(n).uniform(-1.5, 1.5, n)
    client = Client(url, encoding=enc, timeout=600.0)
    try:
        client.gradient("rosenbrock", backend, x)  # compiles
        call = _models.operator_call("gradient", "rosenbrock", backend, x, None, (), None, enc)
        target = client._urls.resolve(client.http, call.path)
        answer = client.http.post(target, content=call.body, headers=call.headers)
        head = request_head(target, call.headers, call.body)
        n_answer = response_size(answer)
        content, headers = bytes(answer.content), answer.headers
        ctype, hlen = call.headers["content-type"], call.headers.get(codec.HEADER_LENGTH)
        timings: list[dict[str, float]] = []

        def served() -> None:
            r = client.http.post(target, content=call.body, headers=call.headers)
            timings.append(server_timing(r.headers["server-timing"]))

        candidates = {
            "client encode": lambda: _models.operator_call(
                "gradient", "rosenbrock", backend, x, None, (), None, enc),
            "request on the wire (raw, one way)": lambda: raw.exchange(head, call.body, 1),
            "  of which decode (in process)": lambda: decode_operator_request(
                call.body, ctype, hlen, op),
            "answer on the wire (raw, one way)": lambda: raw.exchange(b"", b"x", n_answer),
            "client decode": lambda: _models.operator_result("gradient", headers, content),
            "whole Client.gradient call": lambda: client.gradient("rosenbrock", backend, x),
            "served": served,
        }
        times = interleaved(candidates, rounds, budget_seconds=120)
    finally:
        client.close()
    out = {name: median(v) for name, v in times.items() if name != "served"}
    timings = timings[1:]  # the warm-up call
    out["server receive + decode (Server-Timing)"] = median([t.get("decode", 0) for t in timings])
    out["compute (Server-Timing queue + compute)"] = median(
        [t.get("queue", 0) + t.get("compute", 0) for t in timings])
    out["server encode (Server-Timing)"] = median([t.get("encode", 0) for t in timings])
    server_total = median([t.get("total", 0) for t in timings])
    out["rest (HTTP both ways, sending the answer)"] = (
        out["whole Client.gradient call"] - out["client encode"] - server_total
        - out["client decode"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e5,1e6")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--save", default="profile-wire-cpu.md")
    args = parser.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",") if s.strip()]
    out = Tee()
    with tempfile.TemporaryDirectory(prefix="dxbench-") as tmp:
        tmpdir = Path(tmp)
        dx_port, echo_port, raw_port = free_port(), free_port(), free_port()
        dx = Server(
            [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(dx_port),
             "--store", str(tmpdir / "store"), "--compilation-cache", "", "--log-level", "warning"],
            dx_port, "/health", tmpdir / "dxserve.log",
        )
        try:
            echo = Server(
                [PYTHON, str(Path(__file__).resolve().parent / "echo_app.py"), "--port",
                 str(echo_port), "--log-level", "warning", "--raw-port", str(raw_port)],
                echo_port, "/health", tmpdir / "echo.log",
            )
        except BaseException:
            dx.stop()
            raise
        raw = RawFloor(raw_port)
        results = {}
        started = time.perf_counter()
        try:
            for n in sizes:
                for enc in ENCODINGS:
                    results[n, enc] = profile(n, enc, dx.url, raw, args.rounds)
                    print(f"  n={n:.0e} {enc} done ({time.perf_counter() - started:.0f} s)",
                          file=sys.stderr)
        finally:
            raw.close()
            echo.stop()
            dx.stop()
    out("# Where POST /gradient spends its time, wire included (Rosenbrock, float64)")
    out()
    out(f"{machine_line()}; loopback; medians (ms) of {args.rounds} interleaved rounds. Server "
        "steps are the server's own Server-Timing of real requests; 'raw' steps are a plain "
        "loopback socket moving the same bytes one way (`bench/echo_app.py --raw-port`).")
    for n in sizes:
        out()
        out(f"## n = {n:.0e}")
        out()
        rows = [[step, *(ms(results[n, enc][step]) for enc in ENCODINGS)] for step in STEPS]
        out(markdown_table(["step", *ENCODINGS], rows))
    if args.save:
        print(f"saved {out.save(args.save)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
