"""A server's memory after large requests: caches bounded by bytes, and freed memory given back.

    .venv/bin/python bench/cache_memory.py
    .venv/bin/python bench/cache_memory.py --before-tree /tmp/base   # a checkout to compare

Two tables, from the server's VmRSS and VmHWM (/proc):

1. ``POST /sparsity`` of softmax (a dense n x n pattern) at n = 1200, 1250, ... (8
   distinct sizes, 1.4-2.4 million nonzeros): RSS over the level after one small sparse
   call (asdex and numba loaded), after all of them, and the prep cache's bytes from
   /metrics. "unbounded" is ``DXSERVE_CACHE_BYTES=0`` with ``DXSERVE_TRIM_AFTER_BYTES=0``
   (the count bound only, as before); "64 MiB" the byte bound with the trim on.
2. ``POST /hessian`` (JSON) of a dense-Hessian expression at n = 2000 and 3000: RSS just
   before, and retained 2 s after the answer, with the trim off
   (``DXSERVE_TRIM_AFTER_BYTES=0``) and on (the default, 64 MiB), and on with glibc's
   trim threshold pinned (``GLIBC_TUNABLES``, ``TUNABLES`` below: other threads' heaps
   give their top back at 8 MiB instead of up to 64 MiB).

``--before-tree DIR`` adds a row per table for the servers of another checkout (its
``service``, ``clients/python`` and root on PYTHONPATH), e.g. the commit before these
changes. One server per row, one row at a time.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from _common import PYTHON, Server, Tee, free_port, machine_line, markdown_table

MiB = 2**20
SPARSITY_SIZES = tuple(range(1200, 1600, 50))
TUNABLES = "glibc.malloc.trim_threshold=8388608:glibc.malloc.mmap_threshold=33554432"
DENSE = {"name": "dense_h", "expression": "jnp.sum(jnp.tanh(x)) ** 2 + jnp.sum(x ** 2)",
         "args": ["x"]}


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _metric(c: httpx.Client, name: str, scale: float = 1.0) -> str:
    found = re.search(rf"^{name} (\S+)$", c.get("/metrics").text, re.M)
    return f"{float(found.group(1)) / scale:.0f}" if found else "n/a"


def _server(tmp: Path, env: dict[str, str], tree: Path | None) -> Server:
    port = free_port()
    argv = [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--store", str(tmp / "store"), "--compilation-cache", "", "--log-level", "warning",
            "--functions", "dxserve.examples"]
    if tree is not None:
        env = {**env, "PYTHONPATH": f"{tree / 'service'}:{tree / 'clients/python'}:{tree}"}
    return Server(argv, port, "/health", tmp / "server.log", env)


def sparsity_row(label: str, env: dict[str, str], tree: Path | None) -> list[object]:
    with tempfile.TemporaryDirectory() as tmp, _server(Path(tmp), env, tree) as srv, \
            httpx.Client(base_url=srv.url, timeout=600) as c:
        c.post("/sparsity", json={"function": "softmax", "x": [0.1] * 50}).raise_for_status()
        time.sleep(0.5)
        base = _status(srv.proc.pid)["VmRSS"]
        for n in SPARSITY_SIZES:
            body = {"function": "softmax", "x": np.linspace(0, 1, n).tolist()}
            c.post("/sparsity", json=body).raise_for_status()
        time.sleep(2.0)
        after = _status(srv.proc.pid)
        return [label, f"{base / MiB:.0f}", f"{after['VmRSS'] / MiB:.0f}",
                f"{(after['VmRSS'] - base) / MiB:.0f}", f"{after['VmHWM'] / MiB:.0f}",
                _metric(c, "dxserve_prep_cache_bytes", MiB),
                _metric(c, "dxserve_compile_cache_entries")]


def hessian_row(label: str, n: int, env: dict[str, str], tree: Path | None) -> list[object]:
    x = np.linspace(0.1, 1.0, n).tolist()
    with tempfile.TemporaryDirectory() as tmp, _server(Path(tmp), env, tree) as srv, \
            httpx.Client(base_url=srv.url, timeout=600) as c:
        c.post("/functions", json=DENSE).raise_for_status()
        c.post("/hessian", json={"function": "dense_h", "x": [0.1, 0.2]}).raise_for_status()
        time.sleep(0.5)
        before = _status(srv.proc.pid)["VmRSS"]
        r = c.post("/hessian", json={"function": "dense_h", "x": x})
        r.raise_for_status()
        size = len(r.content)
        del r
        time.sleep(2.0)
        after = _status(srv.proc.pid)
        return [label, n, f"{size / MiB:.0f}", f"{before / MiB:.0f}",
                f"{after['VmRSS'] / MiB:.0f}", f"{(after['VmRSS'] - before) / MiB:.0f}",
                f"{after['VmHWM'] / MiB:.0f}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-tree", type=Path, default=None,
                        help="another checkout whose servers make a 'before' row")
    parser.add_argument("--sizes", default="2000,3000", help="n of the dense Hessians")
    parser.add_argument("--save", default="cache-memory-cpu.md", help="file under results/")
    args = parser.parse_args()
    out = Tee()
    out("# Server memory: caches bounded by bytes, memory given back")
    out()
    out(machine_line())
    out()
    off = {"DXSERVE_CACHE_BYTES": "0", "DXSERVE_TRIM_AFTER_BYTES": "0"}
    rows = []
    if args.before_tree is not None:
        rows.append(sparsity_row("before (other tree)", {}, args.before_tree))
    rows.append(sparsity_row("unbounded, no trim", off, None))
    rows.append(sparsity_row("64 MiB, trim", {"DXSERVE_CACHE_BYTES": str(64 * MiB)}, None))
    out(f"## {len(SPARSITY_SIZES)} `/sparsity` calls of softmax, n = "
        f"{SPARSITY_SIZES[0]}..{SPARSITY_SIZES[-1]} (MiB)")
    out()
    out(markdown_table(["server", "RSS before", "RSS after", "grown", "peak",
                        "cache bytes (metric)", "preps kept"], rows))
    out()
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        if args.before_tree is not None:
            rows.append(hessian_row("before (other tree)", n, {}, args.before_tree))
        rows.append(hessian_row("trim off", n, {"DXSERVE_TRIM_AFTER_BYTES": "0"}, None))
        rows.append(hessian_row("trim on", n, {}, None))
        rows.append(hessian_row("trim on, GLIBC_TUNABLES", n, {"GLIBC_TUNABLES": TUNABLES}, None))
    out("## Retained RSS after one dense `/hessian` (JSON), MiB")
    out()
    out(markdown_table(["server", "n", "answer", "RSS before", "RSS 2 s after", "retained",
                        "peak"], rows))
    if args.save:
        out()
        print(f"saved to {out.save(args.save)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
