"""Prepared operators against hand-written ``jax.jit`` of the same maths.

    .venv/bin/python bench/operators_vs_jit.py            # in process and over HTTP
    .venv/bin/python bench/operators_vs_jit.py --quick    # fewer rounds
    .venv/bin/python bench/operators_vs_jit.py --no-http  # in process only

In process: every operator is prepared once (``dxserve.prepare_<op>``), then called
through the library with ``prep=`` from numpy inputs and blocked on; the reference is
``jax.jit`` of JAX's own transformation of the same function, also called on numpy
inputs and blocked on. Candidates are timed interleaved; the table gives medians,
the fixed overhead (difference, µs) and the ratio. Targets: at most 15 µs more, or
at most 1.1x where the maths dominates (reference above 1 ms).

Over HTTP: the same prepared operators posted to a server on 127.0.0.1 (binary
encoding); the compute part of ``Server-Timing`` (queue + compute) against the same
call in process. Target: within 1.1x.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from _common import (
    Server,
    Tee,
    free_port,
    interleaved,
    machine_line,
    markdown_table,
    median,
)

import dxserve
from dxserve import Auto, JaxForward, JaxReverse
from dxserve.examples import rosenbrock, sin_cumsum, softmax

jax.config.update("jax_enable_x64", True)

PYTHON = sys.executable
OVERHEAD_US = 15.0
RATIO = 1.1
COMPUTE_BOUND_S = 1e-3


def mlp_loss(params, X):
    h = jnp.tanh(X @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"]) ** 2)


def scalar_curve(t):
    return jnp.sin(3.0 * t) * jnp.exp(-0.1 * t * t)


@dataclass
class Case:
    """One row: ``operator`` of ``f`` with ``backend`` on inputs of size ``size``."""

    operator: str
    backend: object
    f: Callable
    function: str  # its name on the example server
    size: str
    x: object
    tangent: object = None
    contexts: tuple = ()

    @property
    def label(self) -> str:
        name = self.backend if isinstance(self.backend, str) else self.backend.to_json()["type"]
        return f"{self.operator} {self.function} {self.size} ({name})"


def reference(case: Case) -> Callable:
    """The hand-written ``jax.jit`` of the case's maths, called like the library."""
    f, op = case.f, case.operator
    fwd = isinstance(case.backend, JaxForward)
    if op == "gradient":
        jitted = jax.jit(jax.grad(f))
        return lambda: jitted(case.x, *case.contexts)
    if op == "value_and_gradient":
        jitted = jax.jit(jax.value_and_grad(f))
        return lambda: jitted(case.x, *case.contexts)
    if op == "jacobian":
        jitted = jax.jit(jax.jacfwd(f) if fwd else jax.jacrev(f))
        return lambda: jitted(case.x, *case.contexts)
    if op == "pushforward":
        jitted = jax.jit(lambda x, t: jax.jvp(f, (x,), (t,))[1])
        return lambda: jitted(case.x, case.tangent)
    if op == "pullback":
        jitted = jax.jit(lambda x, t: jax.vjp(f, x)[1](t)[0])
        return lambda: jitted(case.x, case.tangent)
    if op == "hvp":
        def hvp(x, t, *c):
            return jax.jvp(lambda y: jax.grad(f)(y, *c), (x,), (t,))[1]
        jitted = jax.jit(hvp)
        return lambda: jitted(case.x, case.tangent, *case.contexts)
    if op == "hessian":
        jitted = jax.jit(jax.hessian(f))
        return lambda: jitted(case.x, *case.contexts)
    if op == "derivative":
        jitted = jax.jit(jax.jacfwd(f))
        return lambda: jitted(case.x)
    if op == "second_derivative":
        jitted = jax.jit(jax.jacfwd(jax.jacfwd(f)))
        return lambda: jitted(case.x)
    raise ValueError(op)


def library(case: Case) -> Callable:
    """The prepared library call (numpy in), as a user makes it."""
    op = getattr(dxserve, case.operator)
    prepare = getattr(dxserve, f"prepare_{case.operator}")
    if case.tangent is None:
        prep = prepare(case.f, case.backend, case.x, *case.contexts)
        return lambda: op(case.f, case.backend, case.x, *case.contexts, prep=prep)
    tangents = (case.tangent,)
    prep = prepare(case.f, case.backend, case.x, tangents, *case.contexts)
    return lambda: op(case.f, case.backend, case.x, tangents, *case.contexts, prep=prep)


def cases(sizes: dict[str, int]) -> list[Case]:
    out: list[Case] = []
    rng = np.random.default_rng(0)
    fwd, rev, auto = JaxForward(), JaxReverse(), Auto()
    for size, n in sizes.items():
        x = rng.uniform(-1.5, 1.5, n)
        t = rng.standard_normal(n)
        out += [
            Case("gradient", rev, rosenbrock, "rosenbrock", size, x),
            Case("value_and_gradient", rev, rosenbrock, "rosenbrock", size, x),
            Case("hvp", auto, rosenbrock, "rosenbrock", size, x, t),
            Case("pushforward", fwd, sin_cumsum, "sin_cumsum", size, x, t),
            Case("pullback", rev, sin_cumsum, "sin_cumsum", size, x, t),
        ]
        if n <= 1000:  # dense n x n results
            out += [
                Case("jacobian", fwd, softmax, "softmax", size, x),
                Case("jacobian", rev, softmax, "softmax", size, x),
                Case("hessian", auto, rosenbrock, "rosenbrock", size, x),
            ]
    s = np.float64(0.7)
    out += [
        Case("derivative", fwd, scalar_curve, "scalar_curve", "scalar", s),
        Case("second_derivative", auto, scalar_curve, "scalar_curve", "scalar", s),
    ]
    params = {
        "w1": rng.standard_normal((16, 64)) / 4, "b1": np.zeros(64),
        "w2": rng.standard_normal((64, 4)) / 8, "b2": np.zeros(4),
    }
    X = rng.standard_normal((256, 16))
    tp = jax.tree_util.tree_map(lambda a: rng.standard_normal(a.shape), params)
    out += [
        Case("gradient", rev, mlp_loss, "mlp_loss", "pytree", params, contexts=(X,)),
        Case("hvp", auto, mlp_loss, "mlp_loss", "pytree", params, tp, contexts=(X,)),
    ]
    return out


def in_process(rows_out: list, all_cases: list[Case], rounds: int) -> dict[str, float]:
    """Times each case against its reference; returns the library's median per label."""
    lib_times = {}
    for case in all_cases:
        lib, ref = library(case), reference(case)
        np.testing.assert_allclose(  # the same maths, or the row means nothing
            np.asarray(jax.tree_util.tree_leaves(_first(lib()))[0]),
            np.asarray(jax.tree_util.tree_leaves(_first(ref()))[0]), rtol=1e-9, atol=1e-12,
        )
        times = interleaved(
            {"dxserve": lambda lib=lib: jax.block_until_ready(lib()),
             "jit": lambda ref=ref: jax.block_until_ready(ref())},
            rounds, min_sample_seconds=0.02, budget_seconds=20,
        )
        d, j = median(times["dxserve"]), median(times["jit"])
        lib_times[case.label] = d
        over = (d - j) * 1e6
        ok = over <= OVERHEAD_US or (j >= COMPUTE_BOUND_S and d / j <= RATIO)
        rows_out.append([case.label, f"{d * 1e3:.4f}", f"{j * 1e3:.4f}", f"{over:+.1f}",
                         f"{d / j:.2f}x", "yes" if ok else "**no**"])
    return lib_times


def _first(out):
    """The operator's main result (a single tangent's, for the tangent operators)."""
    if isinstance(out, tuple) and len(out) == 1:
        return out[0]
    return out


def over_http(all_cases: list[Case], lib_times: dict[str, float], rounds: int) -> list:
    """Server-Timing compute of each case (served by name) against in process."""
    import httpx

    served = [c for c in all_cases if c.function in {"rosenbrock", "sin_cumsum", "softmax"}]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        port = free_port()
        server = Server(
            [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--store", str(tmpdir / "store"), "--compilation-cache", "",
             "--log-level", "warning"],
            port, "/health", tmpdir / "dxserve.log",
        )
        try:
            with httpx.Client(base_url=server.url, timeout=600.0) as http:
                for case in served:
                    body = _request(case)
                    _compute_seconds(http, case.operator, body)  # compiles
                    c = median([_compute_seconds(http, case.operator, body)
                                for _ in range(rounds)])
                    d = lib_times[case.label]
                    ok = c <= d * RATIO or (c - d) * 1e6 <= OVERHEAD_US
                    rows.append([case.label, f"{c * 1e3:.4f}", f"{d * 1e3:.4f}",
                                 f"{c / d:.2f}x", "yes" if ok else "**no**"])
        finally:
            server.stop()
    return rows


def _request(case: Case) -> dict:
    backend = case.backend if isinstance(case.backend, str) else case.backend.to_json()
    body = {"function": case.function, "backend": backend, "x": np.asarray(case.x).tolist()}
    if case.tangent is not None:
        body["tangents"] = [np.asarray(case.tangent).tolist()]
    return body


def _compute_seconds(http, operator: str, body: dict) -> float:
    """One request's ``Server-Timing`` compute (queue + compute), in seconds."""
    response = http.post(f"/{operator}", json=body)
    response.raise_for_status()
    timing = {}
    for part in response.headers["server-timing"].split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            timing[name] = float(dur) / 1e3
    return timing.get("queue", 0.0) + timing.get("compute", 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--no-http", action="store_true", help="in process only")
    parser.add_argument("--sizes", default="small=10,mid=1000,large=100000")
    parser.add_argument("--save", default="operators-vs-jit-cpu.md",
                        help="file under bench/results ('' = none)")
    args = parser.parse_args(argv)
    rounds = 7 if args.quick else 21
    sizes = {k: int(float(v)) for k, v in (p.split("=") for p in args.sizes.split(","))}

    out = Tee()
    out("# Prepared operators vs hand-written `jax.jit` (float64, numpy in, one tangent)")
    out()
    out(f"{machine_line()}; {rounds} interleaved rounds, medians.")
    out(f"Target: at most {OVERHEAD_US:g} µs over `jax.jit`, or at most {RATIO}x where the "
        f"reference takes over {COMPUTE_BOUND_S * 1e3:g} ms.")
    out()
    all_cases = cases(sizes)
    rows: list = []
    lib_times = in_process(rows, all_cases, rounds)
    out(markdown_table(["case", "dxserve ms", "jax.jit ms", "overhead µs", "ratio", "within"],
                       rows))
    if not args.no_http:
        out()
        out("## Server compute (`Server-Timing` queue + compute) vs the same call in process")
        out()
        http_rows = over_http(all_cases, lib_times, rounds)
        out(markdown_table(["case", "server compute ms", "in process ms", "ratio", "within"],
                           http_rows))
    if args.save:
        out()
        print(f"saved to {out.save(args.save)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
