"""Prepared operators against hand-written ``jax.jit`` of the same maths.

    .venv/bin/python bench/operators_vs_jit.py              # in process, HLO and HTTP
    .venv/bin/python bench/operators_vs_jit.py --quick      # fewer rounds
    .venv/bin/python bench/operators_vs_jit.py --modes hlo  # only compare the programs
    .venv/bin/python bench/operators_vs_jit.py --only hvp   # rows whose label has "hvp"

In process (``time``): every operator × JAX backend × small, mid and large inputs and
pytrees is prepared once (``dxserve.prepare_<op>``), then called through the library
with ``prep=`` from numpy inputs and blocked on; the reference is ``jax.jit`` of the same
maths written with JAX's transformations (the backend's modes: ``jvp`` of ``grad`` for
forward-over-reverse, ``jacfwd`` for forward Jacobians, ...), also called on numpy inputs
and blocked on. Both are timed interleaved; per round the difference and the ratio are
taken, and the table gives their medians. Target: at most 15 µs more, or at most 1.1x
where the maths dominates (reference above 1 ms).

Programs (``hlo``): each operator's program lowered (``Prep.lowered``) against the
reference's, op by op: the StableHLO ``jax.jit(...).lower(...)`` gives and the HLO XLA
compiled from it. Equal counts of every op mean the same program.

Over HTTP (``http``): a real server (uvicorn, 127.0.0.1, a free port) serves the same
functions; each is prepared (``POST /prepare/{op}``) and posted with its handle, and the
``compute`` part of ``Server-Timing`` is set against the same prepared call in process.
Target: within 1.1x (or 15 µs).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from _common import PYTHON, Server, Tee, free_port, machine_line, markdown_table
from jit_functions import ODE_PARAMS, mlp_loss, ode_loss, ode_state, scalar_curve

import dxserve
from dxcontract.backends import Backend, SecondOrder
from dxserve import JaxForward, JaxReverse
from dxserve.examples import rosenbrock, sin_cumsum, softmax

jax.config.update("jax_enable_x64", True)

OVERHEAD_US = 15.0
RATIO = 1.1
COMPUTE_BOUND_S = 1e-3
FWD, REV = JaxForward(), JaxReverse()
FOR = SecondOrder(FWD, REV)  # forward over reverse: auto's second order
ROR = SecondOrder(REV, REV)
FOF = SecondOrder(FWD, FWD)


@dataclass
class Case:
    """One row: ``operator`` of ``f`` with ``backend`` at ``x`` (size label ``size``)."""

    operator: str
    backend: Backend
    f: Callable
    function: str  # its name on the server
    size: str
    x: object
    tangent: object = None
    contexts: tuple = ()

    @property
    def label(self) -> str:
        return f"{self.operator} {self.function} {self.size} ({_name(self.backend)})"

    def args(self) -> tuple:
        """The reference's positional arguments (numpy)."""
        t = () if self.tangent is None else (self.tangent,)
        return (self.x, *t, *self.contexts)


def _name(b: Backend) -> str:
    if isinstance(b, SecondOrder):
        return f"{_name(b.outer)[4:]}-over-{_name(b.inner)[4:]}"
    return b.to_json()["type"]


# --- the hand-written maths ----------------------------------------------------------
def _forward(b: Backend) -> bool:
    return isinstance(b, JaxForward)


def _grad(b: Backend, g: Callable) -> Callable:
    """The gradient of scalar ``g`` in ``b``'s mode."""
    return jax.jacfwd(g) if _forward(b) else jax.grad(g)


def _jac(b: Backend, g: Callable) -> Callable:
    return jax.jacfwd(g) if _forward(b) else jax.jacrev(g)


def _push(b: Backend, g: Callable, x, t):
    if _forward(b):
        return jax.jvp(g, (x,), (t,))[1]
    y, vjp = jax.vjp(g, x)
    return jax.linear_transpose(lambda c: vjp(c)[0], y)(t)[0]


def _pull(b: Backend, g: Callable, x, c):
    if not _forward(b):
        return jax.vjp(g, x)[1](c)[0]
    _, lin = jax.linearize(g, x)
    return jax.linear_transpose(lin, x)(c)[0]


def reference(case: Case) -> Callable:
    """``jax.jit`` of the case's maths in the backend's modes, called like ``case.args()``."""
    f, op, b = case.f, case.operator, case.backend
    k = 0 if case.tangent is None else 1

    def maths(x, *rest):
        t, contexts = (rest[0] if k else None), rest[k:]

        def g(u):
            return f(u, *contexts)

        if op == "value":
            return g(x)
        if op == "gradient":
            return _grad(b, g)(x)
        if op == "value_and_gradient":
            return (g(x), _grad(b, g)(x)) if _forward(b) else jax.value_and_grad(g)(x)
        if op in ("jacobian", "derivative"):
            return _jac(b, g)(x)
        if op == "pushforward":
            return _push(b, g, x, t)
        if op == "pullback":
            return _pull(b, g, x, t)
        if op == "hessian":
            return _jac(b.outer, _grad(b.inner, g))(x)
        if op in ("hvp", "gradient_and_hvp"):
            grad = _grad(b.inner, g)
            if op == "gradient_and_hvp" and _forward(b.outer):  # both from one JVP
                return jax.jvp(grad, (x,), (t,))
            # H is symmetric: a reverse outer mode takes the VJP of the gradient
            hv = _push(b.outer, grad, x, t) if _forward(b.outer) else _pull(b.outer, grad, x, t)
            return (grad(x), hv) if op == "gradient_and_hvp" else hv
        if op == "second_derivative":
            return _jac(b.outer, _jac(b.inner, g))(x)
        raise ValueError(op)

    return jax.jit(maths)


def library(case: Case) -> tuple[Callable, object]:
    """The prepared library call (numpy in), as a user makes it, and its prep."""
    op = getattr(dxserve, case.operator)
    prepare = getattr(dxserve, f"prepare_{case.operator}")
    if case.tangent is None:
        prep = prepare(case.f, case.backend, case.x, *case.contexts)
        return (lambda: op(case.f, case.backend, case.x, *case.contexts, prep=prep)), prep
    tangents = (case.tangent,)
    prep = prepare(case.f, case.backend, case.x, tangents, *case.contexts)
    return (lambda: op(case.f, case.backend, case.x, tangents, *case.contexts, prep=prep)), prep


# --- the cases ---------------------------------------------------------------------
def cases(sizes: dict[str, int], dense: dict[str, int]) -> list[Case]:
    out: list[Case] = []
    rng = np.random.default_rng(0)
    for size, n in sizes.items():
        x = rng.uniform(-1.5, 1.5, n)
        t = rng.standard_normal(n)
        for b in (REV, FWD) if n <= 1000 else (REV,):  # forward gradients cost n JVPs
            out += [
                Case("gradient", b, rosenbrock, "rosenbrock", size, x),
                Case("value_and_gradient", b, rosenbrock, "rosenbrock", size, x),
            ]
        for b in (FWD, REV):
            out += [
                Case("pushforward", b, sin_cumsum, "sin_cumsum", size, x, t),
                Case("pullback", b, sin_cumsum, "sin_cumsum", size, x, t),
            ]
        for b in (FOR, ROR):
            out += [Case("hvp", b, rosenbrock, "rosenbrock", size, x, t)]
        out += [Case("gradient_and_hvp", FOR, rosenbrock, "rosenbrock", size, x, t)]
    for size, n in dense.items():  # dense n x n results
        x = rng.uniform(-1.5, 1.5, n)
        for b in (FWD, REV):
            out += [Case("jacobian", b, softmax, "softmax", size, x)]
        for b in (FOR, ROR):
            out += [Case("hessian", b, rosenbrock, "rosenbrock", size, x)]
    s = np.float64(0.7)
    out += [
        Case("value", FWD, scalar_curve, "scalar_curve", "scalar", s),
        Case("derivative", FWD, scalar_curve, "scalar_curve", "scalar", s),
        Case("derivative", REV, scalar_curve, "scalar_curve", "scalar", s),
        Case("second_derivative", FOF, scalar_curve, "scalar_curve", "scalar", s),
        Case("second_derivative", FOR, scalar_curve, "scalar_curve", "scalar", s),
    ]
    params = {
        "w1": rng.standard_normal((16, 64)) / 4,
        "b1": np.zeros(64),
        "w2": rng.standard_normal((64, 4)) / 8,
        "b2": np.zeros(4),
    }
    X = rng.standard_normal((256, 16))
    tp = jax.tree_util.tree_map(lambda a: rng.standard_normal(a.shape), params)
    out += [
        Case("gradient", REV, mlp_loss, "mlp_loss", "pytree", params, contexts=(X,)),
        Case("value_and_gradient", REV, mlp_loss, "mlp_loss", "pytree", params, contexts=(X,)),
        Case("pushforward", FWD, mlp_loss, "mlp_loss", "pytree", params, tp, contexts=(X,)),
        Case("hvp", FOR, mlp_loss, "mlp_loss", "pytree", params, tp, contexts=(X,)),
    ]
    d = ODE_PARAMS
    out += [  # a while_loop: forward mode only (what auto picks)
        Case("hvp", FOF, ode_loss, "ode_loss", "ode", d, rng.standard_normal(d.shape)),
        Case("hessian", FOF, ode_loss, "ode_loss", "ode", d),
        Case("jacobian", FWD, ode_state, "ode_state", "ode", d),
    ]
    return out


# --- in process ----------------------------------------------------------------------
def paired(candidates: dict[str, Callable], rounds: int, budget: float) -> dict[str, list[float]]:
    """Seconds per call of each candidate, round robin (order rotated each round); fast
    calls are repeated within a sample so one sample lasts at least 20 ms. ``"<name> cpu"``:
    the calling thread's CPU seconds per call, which other processes' load does not
    inflate as it does wall time (XLA runs small programs on the calling thread)."""
    names = list(candidates)
    inner = {}
    for name, fn in candidates.items():
        jax.block_until_ready(fn())
        start = time.perf_counter()
        jax.block_until_ready(fn())
        inner[name] = max(1, int(0.02 / max(time.perf_counter() - start, 1e-7)))
    times: dict[str, list[float]] = {name: [] for name in names}
    times.update({f"{name} cpu": [] for name in names})
    started = time.perf_counter()
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, n = candidates[name], inner[name]
            start, cpu = time.perf_counter(), time.thread_time()
            for _ in range(n):
                jax.block_until_ready(fn())
            times[name].append((time.perf_counter() - start) / n)
            times[f"{name} cpu"].append((time.thread_time() - cpu) / n)
        if r >= 4 and time.perf_counter() - started > budget:
            break
    return times


def _leaves(out) -> list[np.ndarray]:
    return [np.asarray(v) for v in jax.tree_util.tree_leaves(out)]


def in_process(all_cases: list[Case], rounds: int, out: Tee) -> dict[str, float]:
    """Times each case against its reference; returns the library's median per label."""
    rows, lib_times = [], {}
    for case in all_cases:
        lib, _ = library(case)
        ref = reference(case)
        args = case.args()
        got, want = _leaves(lib()), _leaves(ref(*args))
        assert len(got) == len(want), case.label
        for a, w in zip(got, want, strict=True):  # the same maths, or the row means nothing
            np.testing.assert_allclose(a, w, rtol=1e-9, atol=1e-12, err_msg=case.label)
        times = paired(
            {"dxserve": lib, "jit": lambda ref=ref, args=args: ref(*args)}, rounds, budget=6.0
        )
        d, j = times["dxserve"], times["jit"]
        over = statistics.median(a - b for a, b in zip(d, j, strict=True)) * 1e6
        ratio = statistics.median(a / b for a, b in zip(d, j, strict=True))
        md, mj = statistics.median(d), statistics.median(j)
        cpu = statistics.median(
            a - b for a, b in zip(times["dxserve cpu"], times["jit cpu"], strict=True)
        )
        lib_times[case.label] = md
        ok = over <= OVERHEAD_US or (mj >= COMPUTE_BOUND_S and ratio <= RATIO)
        rows.append(
            [
                case.label,
                f"{md * 1e3:.4f}",
                f"{mj * 1e3:.4f}",
                f"{over:+.1f}",
                f"{ratio:.2f}x",
                f"{cpu * 1e6:+.1f}",
                "yes" if ok else "**no**",
            ]
        )
        print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    out(
        markdown_table(
            [
                "case",
                "dxserve ms",
                "jax.jit ms",
                "overhead µs (median of pairs)",
                "ratio (median of pairs)",
                "thread CPU µs over jit",
                "within",
            ],
            rows,
        )
    )
    return lib_times


# --- the programs --------------------------------------------------------------------
_STABLEHLO_OP = re.compile(r"\b(?:stablehlo|chlo|mhlo)\.([a-z_]+)")
_HLO_OP = re.compile(r"^\s*(?:ROOT\s+)?\S+\s*=\s*(?:\([^=]*?\)|\S+)\s+([a-z][a-z0-9\-]*)\(", re.M)
#: ops that move no numbers (XLA lays them out, or they name what a call passes)
_FREE = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant"}


def stablehlo_ops(text: str) -> Counter:
    return Counter(_STABLEHLO_OP.findall(text))


def hlo_ops(text: str) -> Counter:
    return Counter(op for op in _HLO_OP.findall(text) if op not in _FREE)


def _diff(a: Counter, b: Counter) -> str:
    keys = sorted(set(a) | set(b))
    parts = [f"{k} {a[k]}/{b[k]}" for k in keys if a[k] != b[k]]
    return ", ".join(parts) if parts else "—"


def programs(all_cases: list[Case], out: Tee) -> None:
    """Op counts of each operator's program against the hand-written one's."""
    rows = []
    seen = set()
    for case in all_cases:
        key = (case.operator, _name(case.backend), case.function, case.size)
        if key in seen:
            continue
        seen.add(key)
        _, prep = library(case)
        tangents = None if case.tangent is None else (case.tangent,)
        lowered = prep.lowered(case.operator, case.x, tangents, case.contexts)
        ref = reference(case).lower(*case.args())
        a, b = stablehlo_ops(lowered.as_text()), stablehlo_ops(ref.as_text())
        ca, cb = hlo_ops(lowered.compile().as_text()), hlo_ops(ref.compile().as_text())
        rows.append(
            [
                case.label,
                f"{sum(a.values())}/{sum(b.values())}",
                "yes" if a == b else "no",
                _diff(a, b),
                f"{sum(ca.values())}/{sum(cb.values())}",
                "yes" if ca == cb else "no",
                _diff(ca, cb),
            ]
        )
        print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    out(
        markdown_table(
            [
                "case",
                "StableHLO ops dxserve/jit",
                "same",
                "differing ops (dxserve/jit)",
                "compiled HLO ops",
                "same",
                "differing ops (dxserve/jit)",
            ],
            rows,
        )
    )


# --- over HTTP -----------------------------------------------------------------------
HTTP_CASES = {
    ("hvp", "rosenbrock"),
    ("hessian", "rosenbrock"),
    ("jacobian", "softmax"),
    ("gradient", "rosenbrock"),
    ("hvp", "ode_loss"),
    ("hessian", "ode_loss"),
    ("jacobian", "ode_state"),
}


def over_http(all_cases: list[Case], rounds: int, out: Tee, argv: list[str]) -> None:
    """Server-Timing compute of prepared calls against the same prepared call in process.

    The calls in process are timed first, with no server running: a server's idle XLA
    threads spin for a while after each request and would slow the process beside it.
    They are timed twice: back to back (as the in-process table does), and between
    requests in a child process configured as a server is (``--as-served``), which is
    the like-for-like reference the target is judged against."""
    import httpx

    served = [
        c for c in all_cases if (c.operator, c.function) in HTTP_CASES and not isinstance(c.x, dict)
    ]
    local = {}
    for case in served:
        lib, _ = library(case)
        local[case.label] = statistics.median(paired({"lib": lib}, rounds, budget=4.0)["lib"])
    as_served = json.loads(subprocess.run(
        [PYTHON, __file__, "--as-served", *argv], check=True, capture_output=True, text=True,
    ).stdout.splitlines()[-1])  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        port = free_port()
        server = Server(
            [PYTHON, "-m", "dxserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--store", str(tmpdir / "store"), "--compilation-cache", "",
             "--functions", "dxserve.examples", "--functions", "jit_functions",
             "--log-level", "warning"],
            port, "/health", tmpdir / "dxserve.log",
            # the machine is shared: at the default nice 10 the device thread would
            # measure its neighbours' load, not the server's work
            env={"DXSERVE_COMPUTE_NICE": "0"},
        )  # fmt: skip
        try:
            with httpx.Client(base_url=server.url, timeout=600.0) as http:
                for case in served:
                    body = _request(case)
                    r = http.post(f"/prepare/{case.operator}", json=body)
                    r.raise_for_status()
                    body["prep"] = r.json()["prep"]
                    for _ in range(2):  # warm up
                        _compute_seconds(http, case.operator, body)
                    many = max(rounds, min(200, int(0.5 / max(local[case.label], 1e-6))))
                    c = statistics.median(
                        _compute_seconds(http, case.operator, body) for _ in range(many)
                    )
                    d, s = local[case.label], as_served[case.label]
                    ok = c <= s * RATIO or (c - s) * 1e6 <= OVERHEAD_US
                    rows.append([case.label, f"{c * 1e3:.4f}", f"{s * 1e3:.4f}",
                                 f"{c / s:.2f}x", f"{d * 1e3:.4f}", f"{c / d:.2f}x",
                                 "yes" if ok else "**no**"])  # fmt: skip
                    print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
        finally:
            server.stop()
    out(
        markdown_table(
            [
                "case",
                "Server-Timing compute ms",
                "in process, between requests ms",
                "ratio",
                "in process, back to back ms",
                "ratio",
                "within",
            ],
            rows,
        )
    )


def between_requests(call: Callable, body: dict, calls: int = 300) -> float:
    """Median seconds of ``call()`` (blocked on) made as a server makes it: between two
    calls, a request's wire work, its JSON body decoded and its answer encoded with the
    server's own codec (``dxcontract.codec``). Back to back, a call finds XLA's threads
    awake and the caches warm; between requests, on this VM, it pays tens of µs to
    wake them, in process as in the server: the like-for-like reference for its compute."""
    from dxcontract.codec import decode_body, encode_body

    raw = json.dumps(body).encode()
    times = []
    for _ in range(calls):
        decode_body(raw, "application/json", arrays=("x", "tangents"))
        start = time.perf_counter()
        result = jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
        encode_body({"result": jax.tree_util.tree_map(np.asarray, result)}, "json")
    return statistics.median(times[calls // 5 :])


def _request(case: Case) -> dict:
    body = {
        "function": case.function,
        "backend": case.backend.to_json(),
        "x": np.asarray(case.x).tolist(),
    }
    if case.tangent is not None:
        body["tangents"] = [np.asarray(case.tangent).tolist()]
    return body


def _compute_seconds(http, operator: str, body: dict) -> float:
    """One request's ``Server-Timing`` compute, in seconds."""
    response = http.post(f"/{operator}", json=body)
    response.raise_for_status()
    for part in response.headers["server-timing"].split(","):
        name, _, dur = part.strip().partition(";dur=")
        if name == "compute":
            return float(dur) / 1e3
    raise AssertionError(f"no compute in {response.headers['server-timing']}")


def as_served(all_cases: list[Case]) -> int:
    """``--as-served``: the served cases' calls in process, timed ``between_requests`` in
    this process configured as ``dxserve serve`` configures a server process (before JAX
    starts a backend: synchronous dispatch, XLA's threads; caches off, as the bench's
    server has them); prints ``{label: seconds}`` as JSON on its last line."""
    from dxserve.frameworks.jax import runtime
    from dxserve.settings import Settings

    runtime.configure(Settings(compilation_cache="", compute_nice=0, warm_up=False))
    medians = {}
    for case in all_cases:
        if (case.operator, case.function) in HTTP_CASES and not isinstance(case.x, dict):
            lib, _ = library(case)
            medians[case.label] = between_requests(lib, _request(case))
    print(json.dumps(medians))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    child = "--as-served" in argv
    argv = [a for a in argv if a != "--as-served"]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--modes", default="time,hlo,http", help="of time, hlo, http")
    parser.add_argument("--sizes", default="small=10,mid=1000,large=100000")
    parser.add_argument(
        "--dense",
        default="small=10,n=50,mid=400",
        help="sizes of the dense Jacobian and Hessian rows",
    )
    parser.add_argument("--only", default="", help="rows whose label contains this")
    parser.add_argument(
        "--save", default="operators_vs_jit.md", help="file under bench/results ('' = none)"
    )
    args = parser.parse_args(argv)
    rounds = 9 if args.quick else 21
    sizes = {k: int(float(v)) for k, v in (p.split("=") for p in args.sizes.split(","))}
    dense = {k: int(float(v)) for k, v in (p.split("=") for p in args.dense.split(","))}
    modes = set(args.modes.split(","))
    all_cases = [c for c in cases(sizes, dense) if args.only in c.label]
    if child:
        return as_served(all_cases)

    out = Tee()
    out("# Prepared operators vs hand-written `jax.jit` (float64, numpy in, one tangent)")
    out()
    out(f"{machine_line()}; up to {rounds} interleaved rounds.")
    out()
    if "time" in modes:
        out("## In process")
        out()
        out(
            f"Target: at most {OVERHEAD_US:g} µs over `jax.jit`, or at most {RATIO}x where "
            f"the reference takes over {COMPUTE_BOUND_S * 1e3:g} ms."
        )
        out()
        in_process(all_cases, rounds, out)
        out()
    if "hlo" in modes:
        out("## Programs: ops of each operator's program vs the hand-written one's")
        out()
        out(
            "Counts are dxserve/jit; compiled HLO leaves out parameter, constant, tuple, "
            "get-tuple-element and bitcast."
        )
        out()
        programs(all_cases, out)
        out()
    if "http" in modes:
        out("## Server-Timing compute of prepared calls vs the same call in process")
        out()
        over_http(all_cases, rounds, out, argv)
        out()
    if args.save:
        print(f"saved to {Tee.save(out, args.save)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
