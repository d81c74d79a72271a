"""Sparse Jacobians through the client: sparse vs dense vs one pushforward, side by side.

For the tridiagonal map and the 2-D 5-point Laplacian (``tests.sparse_functions``) at
n = 10^3 .. 10^6, a real server (subprocess) and the binary client time, interleaved:

* ``sparse``: ``client.jacobian(f, Sparse(JaxForward()), x, prep=...)`` (detection and
  colouring paid once in ``prepare_jacobian``, reported as ``prepare``);
* ``dense``: ``client.jacobian(f, JaxForward(), x, prep=...)`` where m * n fits the
  server's result limit (and at n = 5000 for the 50x target);
* ``pushforward``: one ``client.pushforward(f, "jax-forward", x, (t,), prep=...)``.

Targets: sparse at n = 10^5 within 5x of one pushforward; sparse at least
50x faster than dense at n = 5000. ``python bench/sparse.py [--quick]``; the table is
saved to ``bench/results/sparse-cpu.md``.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.sparse_functions

from _common import (  # noqa: E402
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

from dxclient import Client, JaxForward, Sparse  # noqa: E402
from tests.sparse_functions import example_x  # noqa: E402

LIMIT = 2**27  # the server's default DXSERVE_MAX_RESULT_ELEMENTS


def sizes(name: str, quick: bool) -> list[int]:
    wanted = [10**3, 5000, 10**4, 10**5] + ([] if quick else [10**6])
    if name == "sp_laplacian_2d":  # a k x k grid
        return [round(n**0.5) ** 2 for n in wanted]
    return wanted


def main() -> None:
    quick = "--quick" in sys.argv
    out = Tee()
    out("# Sparse Jacobians through the client (bench/sparse.py)")
    out()
    out(machine_line())
    out()
    rows = []
    store = tempfile.mkdtemp(prefix="dxserve-sparse-bench-")
    port = free_port()
    env = {
        "DXSERVE_SPARSE_DETECTION_SECONDS": "900", "DXSERVE_REQUEST_TIMEOUT": "900",
        "DXSERVE_WARM_UP": "false",
    }
    argv = [PYTHON, "-m", "dxserve.cli", "serve", "--port", str(port), "--functions",
            "tests.sparse_functions", "--store", store, "--compilation-cache", ""]
    with Server(argv, port, "/health", Path(store) / "server.log", env=env) as server:
        client = Client(server.url, timeout=1200)
        for name in ("sp_tridiagonal", "sp_laplacian_2d"):
            for n in sizes(name, quick):
                x = example_x(n)
                t = np.ones(n)
                started = time.perf_counter()
                sprep = client.prepare_jacobian(name, Sparse(JaxForward()), x)
                prepared = time.perf_counter() - started
                pprep = client.prepare_pushforward(name, "jax-forward", x, (t,))
                candidates = {
                    "sparse": lambda name=name, x=x, p=sprep: client.jacobian(
                        name, Sparse(JaxForward()), x, prep=p),
                    "pushforward": lambda name=name, x=x, t=t, p=pprep: client.pushforward(
                        name, "jax-forward", x, (t,), prep=p),
                }
                if n * n + n <= LIMIT:
                    dprep = client.prepare_jacobian(name, JaxForward(), x)
                    candidates["dense"] = lambda name=name, x=x, p=dprep: client.jacobian(
                        name, JaxForward(), x, prep=p)
                times = interleaved(candidates, rounds=5 if n < 10**6 else 3,
                                    min_sample_seconds=0.05, budget_seconds=30)
                sparse_t = median(times["sparse"])
                push_t = median(times["pushforward"])
                dense_t = median(times["dense"]) if "dense" in times else None
                info = sprep.sparsity or {}
                rows.append([
                    name.removeprefix("sp_"), f"{n:,}", f"{info.get('nnz', 0):,}",
                    info.get("colors"), f"{prepared:.2f} s", ms(sparse_t),
                    ms(dense_t) if dense_t else "over the limit", ms(push_t),
                    f"{sparse_t / push_t:.1f}x",
                    f"{dense_t / sparse_t:.0f}x" if dense_t else "-",
                ])
                print(rows[-1], flush=True)
    out(markdown_table(
        ["function", "n", "nnz", "colours", "prepare (detect+colour+compile)", "sparse ms",
         "dense ms", "1 pushforward ms", "sparse / pushforward", "dense / sparse"],
        rows,
    ))
    out()
    out("Targets: sparse within 5x of one pushforward at n = 10^5; dense / sparse >= 50x "
        "at n = 5000. Times are medians of interleaved rounds through the binary client "
        "to a local server.")
    if not quick:
        print(f"saved {out.save('sparse-cpu.md')}")


if __name__ == "__main__":
    main()
