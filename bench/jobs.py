"""Detached jobs: what a job costs over the plain call, and what resuming one costs.

    .venv/bin/python bench/jobs.py                     # n = 10 and a ~10 s Hessian
    .venv/bin/python bench/jobs.py --n-long 3500       # a ~30 s Hessian (on 2 CPUs)
    .venv/bin/python bench/jobs.py --out jobs-cpu.md

A real ``dxserve serve`` (the examples and ``tests.slow_functions``, SQLite store, one
job runner). Three measurements:

* **small**: ``POST /hessian`` of rosenbrock at n = 10 against a job of it (``POST
  /jobs/hessian``, then ``GET /jobs/{id}/events`` until its result event), both over
  one kept-alive connection; interleaved rounds, medians. The difference is the job's
  fixed cost: storing its body, being claimed, its result stored and read back.
* **long**: the Hessian of ``heavy_sines`` (10 chunks) the same two ways, a few
  interleaved rounds: a job also checkpoints each chunk.
* **resume**: that job, SIGKILLed once half its chunks are done, then the server
  restarted on the same store: the time from the restarted server being up to the
  result against the uninterrupted job's second half, and the chunks taken back. The
  servers keep their compilation caches (the default), so the restarted one loads the
  job's executables from disk rather than compiling them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _common import (
    PYTHON,
    ROOT,
    Server,
    Tee,
    free_port,
    interleaved,
    machine_line,
    markdown_table,
    median,
    ms,
)

LEASE = 2.0


def serve(store: Path, log: Path) -> Server:
    """A server on ``store``, with its compilation caches beside it (as by default), so a
    restarted one loads the job's executables instead of compiling them again."""
    port = free_port()
    argv = [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--store", str(store), "--compilation-cache", str(store.parent / "jax-cache"),
            "--functions", "dxserve.examples,tests.slow_functions"]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "DXSERVE_JOB_LEASE_SECONDS": str(LEASE), "DXSERVE_JOB_POLL_INTERVAL": "0.1",
           "DXSERVE_JOB_RUNNERS": "1"}
    return Server(argv, port, "/health", log, env=env)


def plain(http: httpx.Client, body: dict) -> None:
    r = http.post("/hessian", json=body, headers={"accept": "application/vnd.dxserve.binary"})
    assert r.status_code == 200, r.text


def events(http: httpx.Client, job_id: str, until: int | None = None) -> dict | None:
    """Follow the job's events to its result (None), or to progress ``until`` (its data)."""
    with http.stream("GET", f"/jobs/{job_id}/events") as r:
        assert r.status_code == 200
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                if name == "progress" and until is not None:
                    data = json.loads(line[6:])
                    if data["done"] >= until:
                        return data
                if name in ("result", "error"):
                    assert name == "result", line[:300]
                    return None
    raise RuntimeError("the event stream ended early")


def as_job(http: httpx.Client, body: dict) -> str:
    """Submit, follow to the end, fetch the result as the plain call answers it."""
    r = http.post("/jobs/hessian", json=body)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    events(http, job_id)
    r = http.get(f"/jobs/{job_id}/result", headers={"accept": "application/vnd.dxserve.binary"})
    assert r.status_code == 200
    return job_id


def _plus(seconds: float) -> str:
    return f"{seconds * 1e3:+.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-long", type=int, default=2000, help="heavy_sines Hessian size")
    parser.add_argument("--rounds", type=int, default=40, help="rounds at n = 10")
    parser.add_argument("--long-rounds", type=int, default=3)
    parser.add_argument("--out", default="jobs-cpu.md", help="file under bench/results/")
    args = parser.parse_args()
    out = Tee()
    out("# Detached jobs: overhead over the plain call, and resuming after a kill")
    out()
    out(machine_line())
    out()
    small = {"function": "rosenbrock", "backend": "jax-forward",
             "x": [0.1 * i for i in range(1, 11)]}
    long = {"function": "heavy_sines", "backend": "jax-forward",
            "x": [0.1 + 1.2 * i / (args.n_long - 1) for i in range(args.n_long)]}
    work = Path(tempfile.mkdtemp(prefix="dxserve-bench-jobs-"))
    rows = []
    with serve(work / "store", work / "server.log") as srv, \
            httpx.Client(base_url=srv.url, timeout=600) as http:
        times = interleaved({"plain": lambda: plain(http, small),
                             "job": lambda: as_job(http, small)}, args.rounds)
        p, j = median(times["plain"]), median(times["job"])
        rows.append(["hessian of rosenbrock, n = 10", ms(p), ms(j), _plus(j - p),
                     f"{j / p:.2f}x"])
        start = time.perf_counter()
        plain(http, long)  # its first call: traced and compiled (a fresh process's cost)
        cold = time.perf_counter() - start
        times = interleaved({"plain": lambda: plain(http, long),
                             "job": lambda: as_job(http, long)}, args.long_rounds)
        p_long, j_long = median(times["plain"]), median(times["job"])
        rows.append([f"hessian of heavy_sines, n = {args.n_long} (10 chunks)", ms(p_long),
                     ms(j_long), _plus(j_long - p_long), f"{j_long / p_long:.3f}x"])
        # the resume: half done, killed
        r = http.post("/jobs/hessian", json=long)
        job_id = r.json()["id"]
        half = events(http, job_id, until=args.n_long // 2)
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(30)
        killed_at = time.perf_counter()
    with serve(work / "store", work / "server2.log") as srv, \
            httpx.Client(base_url=srv.url, timeout=600) as http:
        up = time.perf_counter()
        events(http, job_id)
        resumed = time.perf_counter() - up
        doc = http.get(f"/jobs/{job_id}").json()
    out(markdown_table(["case", "plain ms", "job ms", "job - plain", "job / plain"], rows))
    out()
    left = j_long * (args.n_long - half["done"]) / args.n_long
    out(markdown_table(
        ["killed at", "restart to up ms", "up to result ms", "the job's rest, uninterrupted ms",
         "first call's compile ms", "chunks restored", "chunks computed in all", "attempts"],
        [[f"{half['done']} of {args.n_long} columns", ms(up - killed_at), ms(resumed), ms(left),
          ms(cold - p_long), doc["chunks"]["restored"], doc["chunks"]["computed"],
          doc["attempts"]]],
    ))
    out()
    out(f"Medians of {args.rounds} interleaved rounds at n = 10 and {args.long_rounds} for "
        f"the long Hessian; `.venv/bin/python bench/jobs.py --n-long {args.n_long}`. "
        f"Lease {LEASE:g} s (`DXSERVE_JOB_LEASE_SECONDS`), polls every 0.1 s.")
    out()
    out("What a job adds to the plain call: three durable writes to the store (its body at "
        "submission, its claim by a runner, its result), each a commit that SQLite in FULL "
        "mode syncs to disk (a few ms each on this VM's disk), the result written and read "
        "back, and hops between the event loop and the store's thread. A chunked job also "
        "writes each finished chunk; the job-writer thread writes it while the device "
        "computes the next, so on a long Hessian the job costs about what its result's "
        "write and read cost. Resuming after a kill: the restarted process compiles the "
        "chunk program again, as any process's first call of it does (the compile column: "
        "that first call less a warm one), then computes only the chunks not kept; none is "
        "computed twice.")
    out()
    out("The task's 30 s Hessian is scaled down to about 10 s (n = 2000) on this 2-CPU VM, "
        "which other work shared while this ran; `--n-long 3500` runs about 30 s here.")
    path = out.save(args.out)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
