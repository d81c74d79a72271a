"""Two commits' servers side by side, timed by one fixed client: what a change did to the server.

    git worktree add /tmp/dx-before <commit>
    .venv/bin/python bench/server_before_after.py --before /tmp/dx-before

``before_after.py`` times each tree's whole ``latency.py`` run, its client included;
here the client is held still. Each tree's ``dxserve serve`` runs at once (its own
``service/``, ``contract/`` and ``clients/python/`` first on the path), and each tree's
own client writes the request it would send for ``gradient("rosenbrock", JaxReverse(),
x)`` (binary), caught by a listening socket. One raw loopback client then sends those
bytes and reads each answer to its last byte (``Content-Length``), on one kept-alive
connection per server, alternating which server goes first in each round. A change
between the trees' clients (their request bytes) still counts as the server's work.
Prints, per n, the median round trip of each (interquartile range) and after/before, and
writes ``results/server-before-after-cpu.md``.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median, quantiles

from _common import PYTHON, Server, Tee, commit_of, free_port, machine_line, markdown_table

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: rounds per n (each round: one call to each server), after 20 unrecorded ones
ROUNDS = {10: 2000, 10**5: 600, 10**6: 120}

_CAPTURE = """
import socket, sys, threading
import numpy as np
from dxclient import Client
from dxserve import JaxReverse

n, out = int(sys.argv[1]), sys.argv[2]
listener = socket.create_server(("127.0.0.1", 0))
got = bytearray()

def take() -> None:
    conn, _ = listener.accept()
    while b"\\r\\n\\r\\n" not in got:
        got.extend(conn.recv(1 << 20))
    head = bytes(got).split(b"\\r\\n\\r\\n", 1)[0]
    length = next(int(line.split(b":")[1]) for line in head.split(b"\\r\\n")
                  if line.lower().startswith(b"content-length:"))
    while len(got) < len(head) + 4 + length:
        got.extend(conn.recv(1 << 20))
    conn.sendall(b"HTTP/1.1 400 Caught\\r\\ncontent-length: 0\\r\\nconnection: close\\r\\n\\r\\n")
    conn.close()
    listener.close()  # a client that tries again is refused at once

thread = threading.Thread(target=take, daemon=True)
thread.start()
url = "http://127.0.0.1:%d" % listener.getsockname()[1]
try:
    Client(url, encoding="binary").gradient("rosenbrock", JaxReverse(), np.linspace(-1, 1, n))
except Exception:
    pass
thread.join(30)
open(out, "wb").write(bytes(got))
"""


def path_of(tree: Path) -> str:
    return os.pathsep.join(
        str(tree / p) for p in ("service", "contract", "clients/python") if (tree / p).is_dir()
    )


def request_of(tree: Path, n: int, tmp: Path) -> bytes:
    """The request ``tree``'s own client sends for the gradient at ``n``."""
    out = tmp / f"request-{tree.name}-{n}"
    subprocess.run(
        [PYTHON, "-c", _CAPTURE, str(n), str(out)], check=True, timeout=300,
        env={**os.environ, "PYTHONPATH": path_of(tree), "JAX_PLATFORMS": "cpu"},
    )
    return out.read_bytes()


class Exchange:
    """One kept-alive connection: send a request's bytes, read its answer to the end."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def __call__(self, request: bytes) -> int:
        self.sock.sendall(request)
        got = bytearray()
        while b"\r\n\r\n" not in got:
            got.extend(self.sock.recv(1 << 16))
        head, rest = bytes(got).split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        length = next(int(h.split(b":")[1]) for h in lines if h.lower().startswith(b"content-length:"))
        body = bytearray(length)
        view, have = memoryview(body), len(rest)
        view[:have] = rest
        while have < length:
            have += self.sock.recv_into(view[have:])
        return int(lines[0].split()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="source tree of the old commit")
    parser.add_argument("--after", type=Path, default=ROOT, help="source tree of the new one")
    parser.add_argument("--sizes", default="10,1e5,1e6")
    parser.add_argument("--scale", type=float, default=1.0, help="rounds times this")
    parser.add_argument("--save", default="server-before-after-cpu.md")
    args = parser.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    sizes = [int(float(s)) for s in args.sizes.split(",") if s.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="dx-server-ba-"))
    servers: dict[str, Server] = {}
    found: dict[tuple[int, str], list[float]] = {}
    try:
        for name, tree in trees.items():
            port = free_port()
            servers[name] = Server(
                [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                 "--store", str(tmp / f"store-{name}"), "--compilation-cache", "",
                 "--log-level", "warning"],
                port, "/health", tmp / f"{name}.log",
                env={"PYTHONPATH": path_of(tree), "JAX_PLATFORMS": "cpu"},
            )
        # every request first: a connection must send its first head soon after it opens
        requests = {(n, name): request_of(tree, n, tmp) for n in sizes for name, tree in trees.items()}
        exchanges = {name: Exchange(s.port) for name, s in servers.items()}
        for n in sizes:
            rounds = max(10, int(ROUNDS.get(n, 300) * args.scale))
            started = time.perf_counter()
            for r in range(20 + rounds):
                for name in (("before", "after") if r % 2 else ("after", "before")):
                    t0 = time.perf_counter()
                    status = exchanges[name](requests[(n, name)])
                    seconds = time.perf_counter() - t0
                    if status != 200:
                        raise SystemExit(f"{name} answered {status} at n = {n}")
                    if r >= 20:
                        found.setdefault((n, name), []).append(seconds)
            print(f"  n={n:.0e}: {rounds} rounds, {time.perf_counter() - started:.0f} s",
                  file=sys.stderr)
    finally:
        for server in servers.values():
            server.stop()
    out = Tee()
    out("# Server latency before and after, one fixed client (bench/server_before_after.py)")
    out()
    out(f"{machine_line()}; POST /gradient of Rosenbrock, float64, binary, each tree's own "
        "request bytes; both servers up at once, one raw loopback client, one kept-alive "
        "connection each, alternating; cells: median ms (interquartile range)")
    out()
    out(f"- before: `{commit_of(trees['before'])}`")
    out(f"- after: `{commit_of(trees['after'])}`")
    out()
    rows = []
    for n in sizes:
        cells = {}
        for name in ("before", "after"):
            times = found[(n, name)]
            q1, _, q3 = quantiles(times, n=4)
            cells[name] = (median(times), f"{median(times) * 1e3:.3f} ({q1 * 1e3:.3f}-{q3 * 1e3:.3f})")
        rows.append([f"{n:.0e}", cells["before"][1], cells["after"][1],
                     f"{cells['after'][0] / cells['before'][0]:.3f}", len(found[(n, "after")])])
    out(markdown_table(["n", "before ms (IQR)", "after ms (IQR)", "after/before", "rounds"], rows))
    if args.save:
        print(f"saved {out.save(args.save)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
