"""Two client trees side by side in one run: ``Client.gradient`` latency before and after.

    git worktree add --detach /tmp/dx-before <commit>
    .venv/bin/python bench/client_before_after.py --before /tmp/dx-before [--quick]
    .venv/bin/python bench/before_after.py --client-only --before /tmp/dx-before   # the same

One ``dxserve serve`` (the after tree's service, examples registered, fresh store) and
one ``echo_app.py --raw-port`` (the raw loopback floor, ``_floor.RawFloor``) run on
127.0.0.1. Each tree's client runs in its own worker process, the tree's
``clients/python`` and ``contract`` first on its path, and times
``Client(url).gradient("rosenbrock", JaxReverse(), x)`` (binary encoding, the default)
and the same call awaited on ``AsyncClient`` (timed inside the coroutine). The raw floor
moves the same byte counts each way as the binary call (whole HTTP request and answer),
no HTTP. ``--servers each`` gives each tree its own server instead (a whole-tree
comparison).

Candidates are timed one call per sample, round robin over every candidate, the
starting one rotating each round, so both trees see the same phases of a noisy machine.
Prints per n and client: median ms and interquartile range of each tree, after/before,
and at 10^6 after/raw; writes ``results/client-before-after-cpu.md``. Targets: no row
slower than before by more than 5%; 10^6 (sync) within 1.25x of the raw floor.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SLOWER_TARGET = 1.05
FLOOR_TARGET = 1.25
CLIENTS = ("sync", "async")


# --- the worker: one tree's client, timed on request -------------------------------
def worker(url: str) -> int:
    """Serve timing requests on stdin (one JSON line each), answers on stdout.

    ``{"n": n, "kind": "sync"|"async"}``: the seconds of one call;
    ``{"check": n}``: the gradient's values (a list) and the client's module path."""
    import asyncio

    import numpy as np

    import dxclient
    from dxclient import AsyncClient, Client, JaxReverse

    client = Client(url, timeout=600.0)
    aclient = AsyncClient(url, timeout=600.0)
    loop = asyncio.new_event_loop()
    backend, xs = JaxReverse(), {}

    async def awaited(x: np.ndarray) -> float:
        start = time.perf_counter()
        await aclient.gradient("rosenbrock", backend, x)
        return time.perf_counter() - start

    for line in sys.stdin:
        ask = json.loads(line)
        if "check" in ask:
            n = ask["check"]
            xs[n] = x = np.random.default_rng(n).uniform(-1.5, 1.5, n)
            got = np.asarray(client.gradient("rosenbrock", backend, x))
            again = np.asarray(loop.run_until_complete(aclient.gradient("rosenbrock", backend, x)))
            answer = {
                "values": got.tolist(),
                "same": bool(np.array_equal(got, again)),
                "module": dxclient.__file__,
            }
        elif ask["kind"] == "sync":
            x = xs[ask["n"]]
            start = time.perf_counter()
            client.gradient("rosenbrock", backend, x)
            answer = {"seconds": time.perf_counter() - start}
        else:
            answer = {"seconds": loop.run_until_complete(awaited(xs[ask["n"]]))}
        print(json.dumps(answer), flush=True)
    client.close()
    loop.run_until_complete(aclient.aclose())
    loop.close()
    return 0


class Worker:
    """A worker process for the client of source tree ``tree``, calling ``url``."""

    def __init__(self, python: str, tree: Path, url: str) -> None:
        paths = [str(tree / "clients" / "python"), str(tree / "contract"), str(HERE)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--worker", url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
        )

    def ask(self, **request: object) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited ({self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


# --- the parent -----------------------------------------------------------------------
def rounds_for(n: int, quick: bool) -> int:
    if n >= 10**6:
        return 11 if quick else 121
    if n >= 10**5:
        return 31 if quick else 121
    return 61 if quick else 301


def quartiles(values: list[float]) -> tuple[float, float, float]:
    import statistics

    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def start_servers(trees: dict[str, Path], each: bool, tmp: Path) -> tuple[dict, object, int]:
    """``({tree name: dxserve server}, echo server, raw port)``."""
    from _common import PYTHON, Server, free_port

    servers: dict[str, Server] = {}
    started: list[Server] = []
    try:
        for name in ("before", "after") if each else ("after",):
            tree, port = trees[name], free_port()
            paths = [str(tree / "service"), str(tree / "contract")]
            server = Server(
                [
                    PYTHON,
                    "-m",
                    "dxserve.cli",
                    "serve",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--store",
                    str(tmp / f"store-{name}"),
                    "--compilation-cache",
                    "",
                    "--log-level",
                    "warning",
                ],
                port,
                "/health",
                tmp / f"dxserve-{name}.log",
                env={"PYTHONPATH": os.pathsep.join(paths)},
            )
            started.append(server)
            servers[name] = server
        if not each:
            servers["before"] = servers["after"]
        echo_port, raw_port = free_port(), free_port()
        echo = Server(
            [
                PYTHON,
                str(HERE / "echo_app.py"),
                "--port",
                str(echo_port),
                "--log-level",
                "warning",
                "--raw-port",
                str(raw_port),
            ],
            echo_port,
            "/health",
            tmp / "echo.log",
        )
    except BaseException:
        for server in started:
            server.stop()
        raise
    return servers, echo, raw_port


def raw_exchange(url: str, n: int, raw: object) -> object:
    """The raw floor's exchange for the binary gradient call at ``n``: a callable."""
    import httpx
    import numpy as np
    from _floor import request_head, response_size

    from dxclient import JaxReverse, _models

    x = np.random.default_rng(n).uniform(-1.5, 1.5, n)
    call = _models.operator_call(
        "gradient", "rosenbrock", JaxReverse(), x, None, (), None, "binary"
    )
    body = bytes(call.body)
    with httpx.Client(base_url=url, timeout=600.0) as http:
        answer = http.post("/gradient", content=body, headers=call.headers)
    head = request_head(httpx.URL(url + "/gradient"), call.headers, body)
    size = response_size(answer)
    return lambda: raw.exchange(head, body, size)


def run(args: argparse.Namespace, trees: dict[str, Path], sizes: list[int]) -> dict:
    """Seconds per call, ``{(n, candidate): [...]}``; candidates ``before sync``, ...,
    ``raw``."""
    import numpy as np
    from _common import PYTHON
    from _floor import RawFloor

    found: dict[tuple[int, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="dxab-") as tmp:
        servers, echo, raw_port = start_servers(trees, args.servers == "each", Path(tmp))
        workers: dict[str, Worker] = {}
        raw = None
        try:
            workers = {
                name: Worker(PYTHON, trees[name], servers[name].url) for name in ("before", "after")
            }
            raw = RawFloor(raw_port)
            for n in sizes:
                checks = {name: w.ask(check=n) for name, w in workers.items()}
                for name, check in checks.items():
                    print(f"  {name}: {check['module']}", file=sys.stderr)
                    assert check["same"], f"{name}: AsyncClient and Client disagree"
                np.testing.assert_array_equal(checks["before"]["values"], checks["after"]["values"])
                floor = raw_exchange(servers["after"].url, n, raw)
                candidates = {
                    f"{name} {kind}": (w, kind) for name, w in workers.items() for kind in CLIENTS
                }
                names = [*candidates, "raw"]
                for name in names:  # warm up
                    floor() if name == "raw" else candidates[name][0].ask(
                        n=n, kind=candidates[name][1]
                    )
                started = time.perf_counter()
                for r in range(rounds_for(n, args.quick)):
                    for name in names[r % len(names) :] + names[: r % len(names)]:
                        if name == "raw":
                            t0 = time.perf_counter()
                            floor()
                            seconds = time.perf_counter() - t0
                        else:
                            w, kind = candidates[name]
                            seconds = w.ask(n=n, kind=kind)["seconds"]
                        found.setdefault((n, name), []).append(seconds)
                print(
                    f"  n={n:.0e}: {r + 1} rounds, {time.perf_counter() - started:.0f} s",
                    file=sys.stderr,
                )
        finally:
            if raw is not None:
                raw.close()
            for w in workers.values():
                w.close()
            echo.stop()
            for server in {id(s): s for s in servers.values()}.values():
                server.stop()
    return found


def table(found: dict, sizes: list[int]) -> tuple[list[str], list[list[str]]]:
    def cell(values: list[float]) -> str:
        q1, q2, q3 = quartiles(values)
        return f"{q2 * 1e3:.3f} ({q1 * 1e3:.3f}-{q3 * 1e3:.3f})"

    rows = []
    for n in sizes:
        label = f"{n:.0e}" if n >= 1000 else str(n)
        raw = quartiles(found[(n, "raw")])[1]
        for kind in CLIENTS:
            before, after = found[(n, f"before {kind}")], found[(n, f"after {kind}")]
            b, a = quartiles(before)[1], quartiles(after)[1]
            verdict = "ok" if a / b <= SLOWER_TARGET else f"slower by {a / b - 1:.0%}"
            floor = f"{b / raw:.2f}x / {a / raw:.2f}x"
            if n >= 10**6 and kind == "sync":
                floor += " ok" if a / raw <= FLOOR_TARGET else " MISS"
            rows.append([label, kind, cell(before), cell(after), f"{a / b:.3f}", verdict, floor])
        rows.append([label, "raw floor", cell(found[(n, "raw")]), "", "", "", ""])
    header = [
        "n",
        "client",
        "before ms (IQR)",
        "after ms (IQR)",
        "after/before",
        f"<= {SLOWER_TARGET}x",
        "before/raw, after/raw",
    ]
    return header, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--before", type=Path, help="source tree of the old client")
    parser.add_argument("--after", type=Path, default=ROOT, help="source tree of the new one")
    parser.add_argument(
        "--servers",
        choices=("one", "each"),
        default="one",
        help="one server (the after tree's) for both, or each tree its own",
    )
    parser.add_argument("--sizes", default="10,1e5,1e6")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument(
        "--save", default="client-before-after-cpu.md", help="file under bench/results ('' = none)"
    )
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if args.before is None:
        parser.error("--before is required")
    from _common import Tee, commit_of, machine_line, markdown_table

    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    sizes = [int(float(s)) for s in args.sizes.split(",") if s.strip()]
    found = run(args, trees, sizes)
    out = Tee()
    out("# Client latency before and after, one run (bench/client_before_after.py)")
    out()
    out(
        f"{machine_line()}; `Client.gradient` / `AsyncClient.gradient` on Rosenbrock, float64, "
        f"binary; {'one server (after tree)' if args.servers == 'one' else 'each tree its server'}; "
        "one call per sample, round robin; cells: median ms (interquartile range); rounds: "
        + ", ".join(f"{n:.0e}: {len(found[(n, 'raw')])}" for n in sizes)
    )
    out()
    out(f"- before: `{commit_of(trees['before'], 'clients')}`")
    out(f"- after: `{commit_of(trees['after'], 'clients')}`")
    out()
    header, rows = table(found, sizes)
    out(markdown_table(header, rows))
    out()
    out(
        f"Targets: after/before <= {SLOWER_TARGET} in every row; n = 10^6 sync after/raw <= "
        f"{FLOOR_TARGET}x. raw floor = the binary call's byte counts each way over a plain "
        "loopback socket (`_floor.RawFloor`), no HTTP."
    )
    if args.save:
        print(f"saved {out.save(args.save)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
