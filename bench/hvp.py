"""HVP cost relative to the gradient, per second-order mode (target: within 3x).

    .venv/bin/python bench/hvp.py            # n = 1e3, 1e5, 1e6
    .venv/bin/python bench/hvp.py --quick    # fewer rounds
    .venv/bin/python bench/hvp.py --sizes 1000,100000

In process, Rosenbrock, float64, one tangent. Every operator is prepared first
(``dxserve.prepare_gradient`` / ``dxserve.prepare_hvp``: tracing and compilation
excluded) and then called through the library with ``prep=`` and blocked on, so
each time includes the library's per-call overhead (input normalization,
signature check) as a user sees it. Candidates are timed interleaved; the table
gives medians. Modes whose inner gradient is forward mode build that gradient
from n JVPs over an n x n identity basis (O(n^2) time and memory), so they are
skipped above ``--max-forward-inner`` (default 10^4).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np
from _common import Tee, interleaved, machine_line, markdown_table, median, ms

import dxserve
from dxserve import Auto, FiniteDifferences, JaxForward, JaxReverse, SecondOrder
from dxserve.examples import rosenbrock

DEFAULT = SecondOrder(JaxForward(), JaxReverse())
MODES = {
    "forward-over-reverse": DEFAULT,
    "reverse-over-reverse": SecondOrder(JaxReverse(), JaxReverse()),
    "reverse-over-forward": SecondOrder(JaxReverse(), JaxForward()),
    "forward-over-forward": SecondOrder(JaxForward(), JaxForward()),
    "finite-differences-over-reverse": SecondOrder(FiniteDifferences(), JaxReverse()),
}
TARGET = 3.0


def parse_sizes(text: str) -> list[int]:
    return [int(float(s)) for s in text.split(",") if s.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e3,1e5,1e6", help="comma-separated n")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 41, quick 11)")
    parser.add_argument("--max-forward-inner", type=float, default=1e4,
                        help="largest n for modes with a forward inner gradient (O(n^2))")
    parser.add_argument("--save", default="hvp-cpu.md", help="file under bench/results ('' = none)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (11 if args.quick else 41)
    sizes = parse_sizes(args.sizes)

    out = Tee()
    resolved_default = dxserve.resolve(Auto(), "hvp", rosenbrock, np.zeros(4))
    out("# HVP cost / gradient cost (Rosenbrock, float64, one tangent, in process, prepared)")
    out()
    out(f"{machine_line()}; {rounds} interleaved rounds, medians; target: default <= {TARGET:g}x.")
    out(f"`Auto()` resolves hvp to `{_describe(resolved_default)}`.")
    out()

    rows = []
    started = time.perf_counter()
    for n in sizes:
        rng = np.random.default_rng(n)
        # Device-resident inputs: the comparison is of compute. (From numpy, every call
        # also copies its inputs to the device, and an HVP has one more input than a
        # gradient: the tangent, 8 MB at n = 10^6.)
        x = jax.device_put(rng.uniform(-1.5, 1.5, n))
        t = jax.device_put(rng.standard_normal(n))
        grad_prep = dxserve.prepare_gradient(rosenbrock, JaxReverse(), x)
        candidates = {
            "gradient": lambda p=grad_prep, x=x: jax.block_until_ready(
                dxserve.gradient(rosenbrock, JaxReverse(), x, prep=p))
        }
        plain = jax.jit(jax.grad(rosenbrock))  # reference: JAX's own gradient, no library
        candidates["jit(grad)"] = lambda g=plain, x=x: g(x).block_until_ready()
        skipped = {}
        for name, backend in MODES.items():
            if isinstance(backend.inner, JaxForward) and n > args.max_forward_inner:
                skipped[name] = f"skipped (n > {args.max_forward_inner:g}: O(n^2) forward inner gradient)"
                continue
            prep = dxserve.prepare_hvp(rosenbrock, backend, x, (t,))
            candidates[name] = lambda p=prep, b=backend, x=x, t=t: jax.block_until_ready(
                dxserve.hvp(rosenbrock, b, x, (t,), prep=p))
        # check every mode agrees with the default before timing it
        ref = np.asarray(candidates["forward-over-reverse"]()[0])
        for name in MODES:
            if name in candidates:
                got = np.asarray(candidates[name]()[0])
                err = np.max(np.abs(got - ref)) / max(1.0, np.max(np.abs(ref)))
                if err > 1e-5:
                    print(f"warning: {name} differs from the default by {err:.2e} at n={n}",
                          file=sys.stderr)
        r = rounds if n < 10**6 else max(5, rounds // 2)
        times = interleaved(candidates, r, min_sample_seconds=0.02, budget_seconds=120)
        g = median(times["gradient"])
        pg = median(times["jit(grad)"])
        for name in MODES:
            mark = " (default)" if MODES[name] == DEFAULT else ""
            if name in skipped:
                rows.append([f"{n:.0e}", name + mark, "-", skipped[name], ms(g), "-", ms(pg)])
                continue
            h = median(times[name])
            verdict = ""
            if MODES[name] == DEFAULT:
                verdict = " ok" if h / g <= TARGET else f" MISSES {TARGET:g}x"
            rows.append([f"{n:.0e}", name + mark, ms(h), f"{h / g:.2f}x{verdict}", ms(g),
                         f"{h / pg:.2f}x", ms(pg)])
        print(f"  n={n:.0e} done ({len(times['gradient'])} rounds, "
              f"{time.perf_counter() - started:.0f} s so far)", file=sys.stderr)

    out(markdown_table(["n", "mode", "HVP ms", "HVP / gradient", "gradient ms",
                        "HVP / jit(grad)", "jit(grad) ms"], rows))
    out()
    out("HVP and gradient times are per call through `dxserve.hvp`/`dxserve.gradient` with "
        "`prep=` (compile excluded), blocked until ready. jit(grad) = "
        "`jax.jit(jax.grad(rosenbrock))` on the same x: JAX alone, for reference. Inputs "
        "are device arrays, so host-to-device copies (one more for an HVP: its tangent) "
        "are not counted.")
    if args.save:
        print(f"saved {out.save(args.save)}", file=sys.stderr)
    return 0


def _describe(backend: object) -> str:
    if isinstance(backend, SecondOrder):
        return f"SecondOrder({type(backend.outer).__name__}(), {type(backend.inner).__name__}())"
    return repr(backend)


if __name__ == "__main__":
    raise SystemExit(main())
