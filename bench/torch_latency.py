"""Torch beside JAX: gradient and HVP latency, in process and over HTTP, what the prep
cache saves, and torch.compile against eager.

    .venv-torch/bin/python bench/torch_latency.py            # n = 10, 1e3, 1e6
    .venv-torch/bin/python bench/torch_latency.py --quick    # fewer rounds

(``make test-torch`` makes ``.venv-torch``: torch is not in ``.venv``.) The same
function, the extended Rosenbrock, in JAX (``dxserve.examples.rosenbrock``) and in torch
(``bench/torch_functions.py``), float64:

* **in process**: ``dxserve.gradient(f, backend, x, prep=prep)`` and ``dxserve.hvp``
  (one tangent) with the framework's reverse mode and ``auto`` (forward over reverse),
  prepared first; beside them each framework alone: ``jax.jit(jax.grad(f))`` and
  ``torch.func.grad(f)`` (eager), on the same numpy x;
* **over HTTP**: ``dxclient.Client.gradient`` / ``.hvp`` (binary encoding) against one
  ``dxserve serve`` that serves both functions;
* **the prep cache**: a call that prepares (probe, resolve, build, the meta run that
  estimates the program) against a call that finds its prep cached, for torch and JAX;
* **torch.compile vs eager**: a torch executable run eagerly (the default) against one
  wrapped in ``torch.compile`` (``DXSERVE_TORCH_COMPILE=1``): seconds to the first answer
  and the time per call after it.

Candidates are timed interleaved, medians reported.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import torch
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
    ratio,
)
from torch_functions import torch_rosenbrock

import dxserve
import dxserve.frameworks.torch.framework as torch_framework
from dxclient import Client
from dxserve.examples import rosenbrock

FRAMEWORKS = {"jax": (rosenbrock, "rosenbrock", "jax-reverse"),
              "torch": (torch_rosenbrock, "torch_rosenbrock", "torch-reverse")}


def inputs(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(n)
    return rng.uniform(-1.5, 1.5, n), rng.standard_normal(n)


def rounds_for(n: int, quick: bool) -> int:
    full = 31 if n <= 1000 else 11
    return max(3, full // 3) if quick else full


def in_process(sizes: list[int], quick: bool) -> list[list]:
    rows = []
    for n in sizes:
        x, t = inputs(n)
        candidates = {}
        for name, (f, _, reverse) in FRAMEWORKS.items():
            g_prep = dxserve.prepare_gradient(f, reverse, x)
            h_prep = dxserve.prepare_hvp(f, "auto", x, (t,))
            candidates[f"{name} gradient"] = _bound(
                lambda f, b, p, x: _block(dxserve.gradient(f, b, x, prep=p)), f, reverse,
                g_prep, x)
            candidates[f"{name} hvp"] = _bound(
                lambda f, p, x, t: _block(dxserve.hvp(f, "auto", x, (t,), prep=p)), f, h_prep,
                x, t)
        candidates["jax alone gradient"] = _bound(
            lambda g, x: jax.block_until_ready(g(x)), jax.jit(jax.grad(rosenbrock)), x)
        candidates["torch alone gradient"] = _bound(
            lambda g, x: g(torch.from_numpy(x)), torch.func.grad(torch_rosenbrock), x)
        with dxserve.float64_scope():
            times = interleaved(candidates, rounds_for(n, quick), min_sample_seconds=0.02,
                                budget_seconds=60)
        med = {k: median(v) for k, v in times.items()}
        for op in ("gradient", "hvp"):
            alone = (ms(med["jax alone gradient"]), ms(med["torch alone gradient"])) \
                if op == "gradient" else ("-", "-")
            rows.append([f"{n:.0e}", op, ms(med[f"jax {op}"]), ms(med[f"torch {op}"]),
                         ratio(med[f"torch {op}"], med[f"jax {op}"]), *alone])
    return rows


def _bound(fn, *args, **kwargs):
    """``fn`` with its arguments bound now (a candidate made in a loop)."""
    return lambda: fn(*args, **kwargs)


def _block(out):
    """``out`` once computed: JAX's arrays waited for (torch's are computed already)."""
    leaves = jax.tree_util.tree_leaves(out)
    if leaves and isinstance(leaves[0], jax.Array):
        jax.block_until_ready(out)
    return out


def over_http(sizes: list[int], quick: bool, eager_url: str, hot_url: str) -> list[list]:
    """Each operator through the client, JAX and torch from the same server: one that keeps
    torch eager, and one that has compiled it (``hot`` with no threshold: compiled after
    the first call, in the background; the warm-up waits for it). Each ratio compares two
    calls to one server, so the two servers' noise never enters it."""
    rows = []
    with Client(eager_url) as eager, Client(hot_url) as hot:
        for n in sizes:
            x, t = inputs(n)
            candidates = {}
            for label, client in (("eager", eager), ("hot", hot)):
                for name, (_, served, reverse) in FRAMEWORKS.items():
                    key = f"{name} {label}"
                    candidates[f"{key} gradient"] = _bound(client.gradient, served, reverse, x)
                    candidates[f"{key} hvp"] = _bound(client.hvp, served, "auto", x, (t,))
            for _ in range(3):  # the first calls queue the compiles; later ones wait for them
                for name, call in candidates.items():
                    if name.startswith("torch hot"):
                        call()
                time.sleep(1)
            times = interleaved(candidates, rounds_for(n, quick), budget_seconds=90)
            med = {k: median(v) for k, v in times.items()}
            for op in ("gradient", "hvp"):
                jax_eager, eager_ms = med[f"jax eager {op}"], med[f"torch eager {op}"]
                jax_hot, hot_ms = med[f"jax hot {op}"], med[f"torch hot {op}"]
                rows.append([f"{n:.0e}", op, ms(jax_eager), ms(eager_ms),
                             ratio(eager_ms, jax_eager), ms(jax_hot), ms(hot_ms),
                             ratio(hot_ms, jax_hot)])
    return rows


def _server(tmp: str, name: str, env: dict[str, str]) -> Server:
    port = free_port()
    return Server(
        [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--store", str(Path(tmp) / name), "--compilation-cache", "",
         "--functions", "dxserve.examples,torch_functions", "--log-level", "warning"],
        port, "/health", Path(tmp) / f"{name}.log", env=env,
    )


def prep_cache(sizes: list[int], repeats: int) -> list[list]:
    """A call that prepares vs one that finds its prep: a fresh cache for the former."""
    rows = []
    for n in sizes:
        x, _ = inputs(n)
        for name, (f, _, reverse) in FRAMEWORKS.items():
            cold, warm = [], []
            for _ in range(repeats):
                cache = dxserve.core.preparation.PrepCache()
                start = time.perf_counter()
                _block(dxserve.core.preparation.call("gradient", f, reverse, x, None, (), cache=cache))
                cold.append(time.perf_counter() - start)
                start = time.perf_counter()
                _block(dxserve.core.preparation.call("gradient", f, reverse, x, None, (), cache=cache))
                warm.append(time.perf_counter() - start)
            rows.append([f"{n:.0e}", name, ms(median(cold)), ms(median(warm)),
                         ratio(median(cold), median(warm))])
    return rows


def compile_vs_eager(sizes: list[int], quick: bool) -> list[list]:
    rows = []
    for n in sizes:
        x, t = inputs(n)
        candidates, first = {}, {}
        for mode in ("eager", "torch.compile"):
            torch_framework.COMPILE = "always" if mode == "torch.compile" else "off"
            torch.compiler.reset()
            for op in ("gradient", "hvp"):
                start = time.perf_counter()
                if op == "gradient":
                    prep = dxserve.prepare_gradient(torch_rosenbrock, "torch-reverse", x)
                    call = _bound(dxserve.gradient, torch_rosenbrock, "torch-reverse", x,
                                  prep=prep)
                else:
                    prep = dxserve.prepare_hvp(torch_rosenbrock, "auto", x, (t,))
                    call = _bound(dxserve.hvp, torch_rosenbrock, "auto", x, (t,), prep=prep)
                call()
                first[(mode, op)] = time.perf_counter() - start
                candidates[(mode, op)] = call
        torch_framework.COMPILE = "off"
        times = interleaved({f"{m} {o}": c for (m, o), c in candidates.items()},
                            rounds_for(n, quick), min_sample_seconds=0.02, budget_seconds=60)
        med = {k: median(v) for k, v in times.items()}
        for op in ("gradient", "hvp"):
            rows.append([
                f"{n:.0e}", op, f"{first[('eager', op)]:.2f}",
                f"{first[('torch.compile', op)]:.1f}", ms(med[f"eager {op}"]),
                ms(med[f"torch.compile {op}"]),
                ratio(med[f"eager {op}"], med[f"torch.compile {op}"]),
            ])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,1e3,1e6", help="comma-separated n")
    parser.add_argument("--compile-sizes", default="10,1e3,1e6",
                        help="n for torch.compile vs eager ('' = skip)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--save", default="torch-cpu.md", help="file under bench/results ('' = none)")
    args = parser.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",") if s.strip()]
    compile_sizes = [int(float(s)) for s in args.compile_sizes.split(",") if s.strip()]

    out = Tee()
    out("# Torch beside JAX: gradient and HVP latency, the prep cache, torch.compile vs eager")
    out()
    out(f"{machine_line()}, torch {torch.__version__} ({torch_framework.DEVICE}, "
        f"{torch.get_num_threads()} threads); extended Rosenbrock in each framework, float64; "
        "medians of interleaved rounds.")
    out()
    started = time.perf_counter()
    rows = in_process(sizes, args.quick)
    out("## In process (prepared; `auto` HVP = forward over reverse)")
    out()
    out(markdown_table(["n", "operator", "JAX ms", "torch ms", "torch/JAX",
                        "jit(grad) alone ms", "torch.func.grad alone ms"], rows))
    out()
    with tempfile.TemporaryDirectory(prefix="dxbench-torch-") as tmp:
        eager = _server(tmp, "eager", {"DXSERVE_TORCH_COMPILE": "off"})
        hot = _server(tmp, "hot", {"DXSERVE_TORCH_COMPILE": "hot",
                                   "DXSERVE_TORCH_COMPILE_AFTER": "0"})
        try:
            rows = over_http(sizes, args.quick, eager.url, hot.url)
        finally:
            eager.stop()
            hot.stop()
    out("## Over HTTP (dxclient, binary encoding)")
    out()
    out("Each ratio compares JAX and torch on one server: eager torch on a server with "
        "`DXSERVE_TORCH_COMPILE=off`, compiled torch on one with `hot` and "
        "`DXSERVE_TORCH_COMPILE_AFTER=0` (each signature compiled in the background after "
        "its first call; by default after 2 s of eager running).")
    out()
    out(markdown_table(["n", "operator", "JAX ms (off)", "torch eager ms", "eager/JAX",
                        "JAX ms (hot)", "torch compiled ms", "compiled/JAX"], rows))
    out()
    out("## The prep cache: a gradient that prepares vs one that finds its prep")
    out()
    out(markdown_table(["n", "framework", "preparing call ms", "cached call ms", "saved"],
                       prep_cache(sizes, 3 if args.quick else 7)))
    out()
    if compile_sizes:
        out("## torch.compile vs eager (torch executables, in process)")
        out()
        out(markdown_table(
            ["n", "operator", "eager: first answer s", "torch.compile: first answer s",
             "eager ms", "torch.compile ms", "eager/compiled"],
            compile_vs_eager(compile_sizes, args.quick)))
        out()
    out(f"Ran in {time.perf_counter() - started:.0f} s. In process: `dxserve.gradient`/`hvp` "
        "with `prep=` (x from numpy each call; torch results are host tensors, JAX's device "
        "arrays, blocked); alone: the framework's own gradient with no library around it. "
        "Over HTTP: the whole `Client` call. The preparing call pays the probe (JAX: "
        "`eval_shape` and XLA's compilation; torch: one call of the function and one run of "
        "the operator's program on meta tensors for its estimate); the cached call only runs. "
        "First answer: prepare and one call, compilation included.")
    if args.save:
        print(f"saved {out.save(args.save)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
