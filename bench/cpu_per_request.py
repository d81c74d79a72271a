"""Server CPU per request on several source trees, alternating: what a change cost.

    git worktree add --detach /tmp/dx-before <commit>
    .venv/bin/python bench/cpu_per_request.py /tmp/dx-before . --rounds 8

Requests per second on a small shared VM move by 20% from one minute to the next with
whatever else runs; the CPU seconds the server process spends per answered request move
far less, because another process's load delays a request without adding to its cost.
So this compares trees by that cost. Every tree serves from its own process (its own
``service/``, ``contract/`` and ``clients/python/`` first on the path), all up at once;
each round drives every server in turn (order rotated each round) with

* ``wrk``: the bytes of a binary ``POST /gradient`` (Rosenbrock, n = 100), encoded by that
  tree's own codec, 16 different x, at 8, 32 and 64 connections;
* ``AsyncClient``: that tree's ``dxclient.AsyncClient`` with 32 concurrent calls, whose
  own CPU per request is reported too.

Cells are medians over the rounds, p25-p75 beside them; req/s is shown but is the noisy one.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np
from _common import PYTHON, Server, Tee, free_port, machine_line, markdown_table
from throughput import LUA

ENCODE = r"""
import sys, numpy as np
try:
    from dxcontract import codec
except ImportError:  # trees from before the contract package
    from dxclient import codec
for k in range(16):
    x = np.linspace(-1.0, 1.5, 100) + 0.01 * k
    body, ctype, headers = codec.encode_body(
        {"function": "rosenbrock", "backend": {"type": "jax-reverse"}, "x": x}, "binary")
    open(f"{sys.argv[1]}/body{k + 1}.bin", "wb").write(body)
(name, value), = headers.items()
open(f"{sys.argv[1]}/head", "w").write(f"{ctype}\n{name}\n{value}\n")
"""

ASYNC_LOAD = r"""
import asyncio, sys, time, numpy as np
from dxclient import AsyncClient
port, concurrency, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
x = np.linspace(-1.0, 1.5, 100)
async def run():
    done = 0
    async with AsyncClient(f"http://127.0.0.1:{port}") as client:
        for _ in range(20):
            await client.gradient("rosenbrock", "jax-reverse", x)
        cpu0, start = time.process_time(), time.perf_counter()
        async def one():
            nonlocal done
            while time.perf_counter() < start + seconds:
                await client.gradient("rosenbrock", "jax-reverse", x)
                done += 1
        await asyncio.gather(*(one() for _ in range(concurrency)))
        print(done, time.perf_counter() - start, time.process_time() - cpu0)
asyncio.run(run())
"""


LOADS = (("wrk", 8), ("wrk", 32), ("wrk", 64), ("AsyncClient", 32))


def _tree_env(tree: Path) -> dict[str, str]:
    path = os.pathsep.join(str(tree / p) for p in ("service", "clients/python", "contract"))
    return {**os.environ, "PYTHONPATH": path}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of process ``pid``, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class TreeServer:
    """One tree's server and its load scripts, in ``folder``."""

    def __init__(self, tree: Path, folder: Path) -> None:
        self.tree, self.folder, self.env = tree, folder, _tree_env(tree)
        folder.mkdir()
        subprocess.run([PYTHON, "-c", ENCODE, str(folder)], env=self.env, check=True)
        ctype, name, value = (folder / "head").read_text().split("\n")[:3]
        (folder / "post.lua").write_text(
            LUA.format(ctype=ctype, hl_name=name, hl=value, folder=folder, count=16)
        )
        port = free_port()
        self.server = Server(
            [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--store", str(folder / "store"), "--compilation-cache", "", "--log-level", "warning"],
            port, "/health", folder / "log", env={"PYTHONPATH": self.env["PYTHONPATH"]},
        )
        self.port, self.url, self.proc = port, self.server.url, self.server.proc
        self._wrk(8, 1)  # compile and warm

    def _wrk(self, connections: int, seconds: int) -> tuple[int, float]:
        out = subprocess.run(
            ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", str(self.folder / "post.lua"),
             self.url + "/gradient"], capture_output=True, text=True, check=True,
        ).stdout
        if re.search(r"Non-2xx or 3xx responses: (\d+)", out):
            raise RuntimeError(f"{self.tree}: error answers under load:\n{out}")
        return int(re.search(r"(\d+) requests in", out).group(1)), float(
            re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)
        )

    def measure(self, load: str, concurrency: int, seconds: int) -> tuple[float, float, float]:
        """(server CPU us/request, requests/s, client CPU us/request or nan)."""
        before = _cpu_seconds(self.proc.pid)
        if load == "wrk":
            count, rps = self._wrk(concurrency, seconds)
            client = float("nan")
        else:
            out = subprocess.run(
                [PYTHON, "-c", ASYNC_LOAD, str(self.port), str(concurrency), str(seconds)],
                env=self.env, capture_output=True, text=True, check=True,
            ).stdout.split()
            count, rps, client = int(out[0]), int(out[0]) / float(out[1]), float(out[2]) / int(out[0]) * 1e6
        return (_cpu_seconds(self.proc.pid) - before) / count * 1e6, rps, client

    def stop(self) -> None:
        self.server.stop()

def _spread(values: list[float]) -> str:
    return f"{np.median(values):.0f} ({np.percentile(values, 25):.0f}-{np.percentile(values, 75):.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("trees", nargs="+", type=Path, help="source trees; the first is the baseline")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=int, default=2)
    parser.add_argument("--save", default="cpu-per-request-cpu.md")
    args = parser.parse_args()
    trees = [t.resolve() for t in args.trees]
    runs: dict[tuple, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        servers = []
        try:
            for i, tree in enumerate(trees):
                servers.append(TreeServer(tree, Path(tmp) / f"tree{i}"))
            for r in range(args.rounds):
                for load in LOADS:
                    for server in servers[r % len(servers):] + servers[: r % len(servers)]:
                        runs.setdefault((load, server.tree), []).append(
                            server.measure(*load, args.seconds)
                        )
        finally:
            for server in servers:
                server.stop()
    rows = []
    for load in LOADS:
        base = np.median([m[0] for m in runs[load, trees[0]]])
        for tree in trees:
            got = runs[load, tree]
            cpu = [m[0] for m in got]
            client = [m[2] for m in got]
            rows.append([
                f"{load[0]} c={load[1]}", _describe(tree), _spread(cpu), f"{np.median(cpu) / base:.2f}x",
                _spread([m[1] for m in got]),
                "-" if np.isnan(client[0]) else _spread(client),
            ])
    out = Tee()
    out(machine_line())
    out(f"POST /gradient, rosenbrock n = 100, binary; {args.rounds} rounds of {args.seconds} s per "
        "load and tree, the trees' order rotated each round; median (p25-p75)")
    out()
    out(markdown_table(["load", "tree", "server CPU us/request", "vs first", "req/s",
                        "client CPU us/request"], rows))
    if args.save:
        out.save(args.save)


def _describe(tree: Path) -> str:
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return f"`{commit}`" + (" + changes" if dirty else "")


if __name__ == "__main__":
    main()
