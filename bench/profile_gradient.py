"""Where a served gradient's time goes: each step of POST /gradient timed in process.

    .venv/bin/python bench/profile_gradient.py              # n = 10, 1e3, 1e5, 1e6
    .venv/bin/python bench/profile_gradient.py --cprofile 1e6 b64

Replays the steps the client and ``dxserve.http.app`` take for one request
(client encode -> server decode + validation -> cache lookup -> compute ->
result to numpy -> server encode -> client decode), each timed on its own
(median of interleaved rounds), plus the event-loop -> device-worker thread hop
with an empty job, and the whole request through the ASGI app in process
(``httpx.ASGITransport``: no sockets, no uvicorn). ``--cprofile N ENC`` prints a
cProfile of in-process ASGI requests instead.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import tempfile
from pathlib import Path

import httpx
import jax
import numpy as np
from _common import Tee, interleaved, machine_line, markdown_table, median, ms

from dxclient import AsyncClient, _models
from dxcontract import codec
from dxcontract.encodings.negotiation import response_encoding
from dxcontract.operators import OPERATORS
from dxserve import JaxReverse
from dxserve.core.preparation import PrepCache, call, lookup
from dxserve.http import create_app
from dxserve.pipeline.wire import decode_operator_request
from dxserve.server.service import results_of as result_payload
from dxserve.settings import Settings

ENCODINGS = ("binary", "b64", "json")
STEPS = ["client encode", "server decode+validate", "normalize+signature+cache lookup",
         "compute (prep.run)", "result to numpy", "server encode", "client decode",
         "sum of steps", "thread hop (empty job)", "ASGI in process (whole request)"]


def rounds_for(n: int) -> int:
    return 7 if n >= 10**6 else 21 if n >= 10**5 else 101


def profile(n: int, enc: str, app, loop: asyncio.AbstractEventLoop) -> dict[str, float]:  # noqa: ANN001
    op = OPERATORS["gradient"]
    backend = JaxReverse()
    registry, workers = app.state.service.registry, app.state.service.workers
    entry = registry.get("rosenbrock")
    cache = PrepCache()
    x = np.random.default_rng(n).uniform(-1.5, 1.5, n)
    c = _models.operator_call("gradient", "rosenbrock", backend, x, None, (), None, enc)
    ctype, length = c.headers["content-type"], c.headers.get(codec.HEADER_LENGTH)

    def server_decode():  # as the server does it: a repeated binary header is remembered
        response_encoding(ctype, c.headers.get("accept"), c.body)
        return decode_operator_request(c.body, ctype, length, op)

    server_decode()
    req = server_decode()
    call(op.name, entry.fn, req.backend, req.x, req.tangents, req.contexts, None, cache)  # compile

    def find():
        return lookup(
            op.name, entry.fn, req.backend, req.x, req.tangents, req.contexts, None, cache,
            req.signature,
        ).prep

    prep = find()

    raw = jax.block_until_ready(prep.run("gradient", req.x, req.tangents, req.contexts))
    payload = result_payload(op.results, raw)
    body, media, headers = codec.encode_body(payload, enc)

    client = AsyncClient(encoding=enc, transport=httpx.ASGITransport(app), url="http://asgi")

    candidates = {
        "client encode": lambda: _models.operator_call(
            "gradient", "rosenbrock", backend, x, None, (), None, enc),
        "server decode+validate": server_decode,
        "normalize+signature+cache lookup": find,
        "compute (prep.run)": lambda: jax.block_until_ready(
            prep.run("gradient", req.x, req.tangents, req.contexts)),
        "result to numpy": lambda: result_payload(op.results, raw),
        "server encode": lambda: codec.encode_body(payload, enc),
        "client decode": lambda: _models.operator_result("gradient", headers | {
            "content-type": media}, body),
        "thread hop (empty job)": lambda: loop.run_until_complete(workers.run(lambda: None)),
        "ASGI in process (whole request)": lambda: loop.run_until_complete(
            client.gradient("rosenbrock", backend, x)),
    }
    times = interleaved(candidates, rounds_for(n), min_sample_seconds=0.005, budget_seconds=90)
    out = {name: median(v) for name, v in times.items()}
    out["sum of steps"] = sum(out[s] for s in STEPS[:7])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,1e3,1e5,1e6")
    parser.add_argument("--cprofile", nargs=2, metavar=("N", "ENCODING"))
    parser.add_argument("--save", default="", help="file under bench/results ('' = none)")
    args = parser.parse_args(argv)

    loop = asyncio.new_event_loop()
    with tempfile.TemporaryDirectory(prefix="dxprof-") as tmp:
        app = create_app(Settings(store=Path(tmp) / "store", compilation_cache=""))
        try:
            if args.cprofile:
                return run_cprofile(int(float(args.cprofile[0])), args.cprofile[1], app, loop)
            out = Tee()
            out("# Where POST /gradient spends its time (Rosenbrock, float64, in process)")
            out()
            out(f"{machine_line()}; medians (ms) of interleaved rounds. 'ASGI in process' goes "
                "through httpx.ASGITransport, which adds its own cost (an async HTTP client stack), "
                "so compare it with care.")
            out()
            sizes = [int(float(s)) for s in args.sizes.split(",")]
            for n in sizes:
                cols = {enc: profile(n, enc, app, loop) for enc in ENCODINGS}
                out(f"## n = {n:.0e}" if n >= 1000 else f"## n = {n}")
                out()
                out(markdown_table(["step", *ENCODINGS],
                                   [[s, *(ms(cols[e][s]) for e in ENCODINGS)] for s in STEPS]))
                out()
                print(f"  n={n} done", file=sys.stderr)
            if args.save:
                print(f"saved {out.save(args.save)}", file=sys.stderr)
        finally:
            app.state.service.close()
            loop.close()
    return 0


def run_cprofile(n: int, enc: str, app, loop: asyncio.AbstractEventLoop) -> int:  # noqa: ANN001
    x = np.random.default_rng(n).uniform(-1.5, 1.5, n)
    client = AsyncClient(encoding=enc, transport=httpx.ASGITransport(app), url="http://asgi")
    loop.run_until_complete(client.gradient("rosenbrock", JaxReverse(), x))  # compile
    reps = 3 if n >= 10**6 else 20 if n >= 10**5 else 300
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        loop.run_until_complete(client.gradient("rosenbrock", JaxReverse(), x))
    prof.disable()
    print(f"cProfile of {reps} in-process ASGI POST /gradient, n={n}, {enc} (main thread only; "
          "the device worker's thread is not profiled)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
