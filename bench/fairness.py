"""A small ``/gradient``'s latency behind a long chunked Hessian, before and after.

Starts ``dxserve serve`` (this tree; with ``--base DIR`` also a source tree of the
code before, e.g. ``git archive <commit> | tar -x -C DIR``) serving
``tests.slow_functions``. Each round runs one dense Hessian of ``heavy_sines`` at
``--n`` (10 chunks of n/10 columns), streamed from a separate client process; once
its first chunk is done, this process sends warm ``/gradient`` requests one after
another until the Hessian's last chunk is done. Reported: the first gradient's latency
(the wait of a request arriving mid-Hessian), the latencies of all gradients sent
while it computed and how many came back, and the Hessian's time to its last chunk
(what interleaving costs the long request).

    .venv/bin/python bench/fairness.py [--base /tmp/base] [--n 5000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from _common import PYTHON, ROOT, Server, Tee, free_port, machine_line, markdown_table

WARM = {"function": "rosenbrock", "backend": "jax-reverse", "x": [1.0, 2.0, 3.0]}


def _job(url: str, n: int) -> None:
    """In its own process: one streamed Hessian; prints "running" once its first chunk is
    done and ``{"seconds": ...}`` once its last one is (then reads the result)."""
    x = np.linspace(-1.0, 1.0, n)
    start = time.perf_counter()
    told = False
    with httpx.stream(
        "POST", url + "/hessian",
        json={"function": "heavy_sines", "backend": "jax-forward", "x": x.tolist()},
        headers={"accept": "text/event-stream; arrays=b64"}, timeout=3600,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"done":' in line:
                done = json.loads(line[6:])["done"]
                if not told and done > 0:
                    print("running", flush=True)
                    told = True
                if done == n:
                    print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)


def _round(url: str, n: int, http: httpx.Client) -> tuple[list[float], float]:
    """One Hessian and the gradients sent while it ran: (latencies, Hessian seconds)."""
    job = subprocess.Popen(
        [PYTHON, __file__, "--job", url, "--n", str(n)], stdout=subprocess.PIPE, text=True,
        cwd=ROOT,
    )
    assert job.stdout is not None
    line = job.stdout.readline()
    assert line.strip() == "running", line
    ended: list[str] = []
    reader = threading.Thread(target=lambda: ended.append(job.stdout.readline()), daemon=True)
    reader.start()
    latencies = []
    while not ended:  # until its last chunk is done: what came back while it computed
        start = time.perf_counter()
        r = http.post("/gradient", json=WARM)
        elapsed = time.perf_counter() - start
        assert r.json() == {"gradient": [-400.0, 1002.0, -200.0]}, r.text
        latencies.append(elapsed)
    job.wait()
    return latencies, json.loads(ended[0])["seconds"]


def _serve(source: Path | None, tmp: Path, label: str, n: int, rounds: int) -> dict:
    port = free_port()
    paths = [source / "service", source / "clients/python"] if source else [
        ROOT / "service", ROOT / "clients/python"
    ]
    env = {"PYTHONPATH": ":".join(str(p) for p in [*paths, ROOT])}
    argv = [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--store", str(tmp / f"store-{label}"), "--compilation-cache", "",
            "--functions", "dxserve.examples,tests.slow_functions", "--log-level", "warning"]
    server = Server(argv, port, "/health", tmp / f"server-{label}.log", env=env)
    try:
        with httpx.Client(base_url=server.url, timeout=3600) as http:
            idle = []
            for _ in range(50):
                start = time.perf_counter()
                http.post("/gradient", json=WARM).raise_for_status()
                idle.append(time.perf_counter() - start)
            _round(server.url, n, http)  # compiles the Hessian: not counted
            first, during, hessian = [], [], []
            for _ in range(rounds):
                latencies, seconds = _round(server.url, n, http)
                first.append(latencies[0])
                during += latencies
                hessian.append(seconds)
    finally:
        server.stop()
    return {"idle": idle[5:], "first": first, "during": during, "hessian": hessian}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", type=Path, help="source tree of the code before")
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--save", default="fairness-cpu.md")
    parser.add_argument("--job", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        _job(args.job, args.n)
        return
    out = Tee()
    out(f"# A small /gradient behind a long Hessian\n\n{machine_line()}\n")
    out(f"heavy_sines Hessian at n = {args.n} (10 chunks), {args.rounds} rounds; "
        "seconds (medians, max in brackets)\n")
    with tempfile.TemporaryDirectory() as tmp:
        found = {}
        if args.base:
            found["before"] = _serve(args.base, Path(tmp), "before", args.n, args.rounds)
        found["after"] = _serve(None, Path(tmp), "after", args.n, args.rounds)

    def cell(values: list[float]) -> str:
        return f"{np.median(values):.3f} [{max(values):.3f}]"

    rows = [[label, f"{np.median(r['idle']) * 1e3:.2f} ms", cell(r["first"]), cell(r["during"]),
             len(r["during"]), cell(r["hessian"])] for label, r in found.items()]
    out(markdown_table(
        ["server", "gradient idle", "first gradient behind the Hessian",
         "all gradients during it", "gradients answered during", "Hessian"], rows,
    ))
    if "before" in found:
        b, a = found["before"], found["after"]
        out(f"\nfirst gradient behind the Hessian: before / after = "
            f"{np.median(b['first']) / np.median(a['first']):.1f}x; Hessian after / before = "
            f"{np.median(a['hessian']) / np.median(b['hessian']):.2f}x")
    if args.save:
        out(f"\nsaved to {out.save(args.save)}")


if __name__ == "__main__":
    main()
