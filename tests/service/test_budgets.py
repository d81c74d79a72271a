"""Budgets: per-request bounds known at preparation, and memory bounded in total.

* An expression whose intermediates grow as n⁴ is refused (422 ``budget-exceeded``,
  naming the limit) when it is compiled, before it runs, while a small gradient on the
  same server keeps answering in well under a second.
* XLA's estimate is read from fresh and from persisted executables, and loops count
  their trip count.
* A server with a small in-flight budget, driven by concurrent large JSON bodies and
  dense Hessians, answers the excess 503 + Retry-After, and its peak RSS stays within
  a bound (``MEMORY_SLACK`` over its baseline plus the budget), returning near its
  baseline afterwards.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dxcontract.errors import BudgetExceededError, OverloadedError
from dxserve.core import preparation
from dxserve.core.limits import ComputeLimits, estimate
from dxserve.frameworks.jax import executable_cache
from dxserve.server.admission import SMALL_BYTES, Budget
from tests.conftest import REQUEST_DEADLINE, memory_of

#: n⁴ intermediates that XLA cannot simplify away (a plain sum of the outer products
#: fuses into one loop with no intermediate, so it is cheap and allowed).
#: The operators each n⁴ at n = 160 or 200 is refused for (the value of ``quartic_sq``
#: fuses into one loop too, so it is cheap and allowed).
QUARTICS = {
    "quartic_sin": (
        "jnp.sum(jnp.sin(jnp.outer(jnp.outer(x, x), jnp.outer(x, x))))",
        ("value", "gradient", "hessian"),
    ),
    "quartic_sq": (
        "jnp.sum(jnp.outer(jnp.outer(x, x), jnp.outer(x, x)) ** 2)", ("gradient", "hessian")
    ),
}




# --- per request: refused at preparation -----------------------------------------
def test_quartic_refused_before_running_while_small_gradient_answers(make_server) -> None:
    srv = make_server()  # the defaults
    for name, (expression, _) in QUARTICS.items():
        r = httpx.post(
            srv.url + "/functions",
            json={"name": name, "expression": expression, "args": ["x"]},
        )
        assert r.status_code in (200, 201), r.text
    small = {"function": "rosenbrock", "backend": "jax-reverse", "x": [1.0, 2.0, 3.0]}
    with httpx.Client(base_url=srv.url) as c:
        assert c.post("/gradient", json=small).json() == {"gradient": [-400.0, 1002.0, -200.0]}
    before = memory_of(srv.proc.pid)
    answered: list[int] = []  # small gradients answered, one entry each
    stop = threading.Event()

    def poll() -> None:
        # a quartic that ran would hold the worker (~25 s) and answer 200, not 422
        with httpx.Client(base_url=srv.url) as c:
            while not stop.is_set():
                r = c.post("/gradient", json=small)
                assert r.status_code == 200 and r.json()["gradient"] == [-400.0, 1002.0, -200.0]
                answered.append(1)
                time.sleep(0.01)

    def answered_past(n: int) -> None:
        """Wait (on the poller's answers, bounded) until it has answered more than ``n``."""
        deadline = time.monotonic() + REQUEST_DEADLINE
        while len(answered) <= n:
            assert poller.is_alive() and time.monotonic() < deadline, "the poller stopped"
            time.sleep(0.01)

    poller_ok = False

    def poll_checked() -> None:
        nonlocal poller_ok
        poll()
        poller_ok = True

    poller = threading.Thread(target=poll_checked)
    poller.start()
    try:
        answered_past(0)
        with httpx.Client(base_url=srv.url) as c:
            for name, (_, ops) in QUARTICS.items():
                for op in ops:
                    for n in (160, 200):
                        r = c.post(f"/{op}", json={"function": name, "x": [0.5] * n})
                        assert r.status_code == 422, (name, op, n, r.text)
                        problem = r.json()
                        assert problem["type"].endswith(":budget-exceeded")
                        assert problem["limit"] in (
                            "max_request_memory_bytes", "max_request_flops", "request_timeout"
                        )
                        assert "DXSERVE_" in problem["detail"] and problem["estimate"] > 0
        answered_past(len(answered))  # and still after the last refusal
    finally:
        stop.set()
        poller.join()
    assert poller_ok  # small gradients answered all along
    # never ran: no multi-gigabyte intermediate was ever allocated
    assert memory_of(srv.proc.pid)["VmHWM"] - before["VmHWM"] < 512 * 2**20


def test_limits_apply_only_when_given() -> None:
    def f(x):
        return jnp.sum(jnp.sin(jnp.outer(jnp.outer(x, x), jnp.outer(x, x))))

    x = np.full(16, 0.5)
    prep = preparation.prepare("gradient", f, "jax-reverse", x, None, ())  # library: unbounded
    assert prep.limits is None
    with pytest.raises(BudgetExceededError) as caught:
        preparation.prepare(
            "gradient", f, "jax-reverse", x, None, (), limits=ComputeLimits(max_memory_bytes=10_000)
        )
    assert caught.value.extra["limit"] == "max_request_memory_bytes"
    with pytest.raises(BudgetExceededError) as caught:
        preparation.prepare(
            "gradient", f, "jax-reverse", x, None, (), limits=ComputeLimits(max_flops=1000)
        )
    assert caught.value.extra["limit"] == "max_request_flops"
    with pytest.raises(BudgetExceededError) as caught:  # cannot finish within the timeout
        preparation.prepare(
            "gradient", f, "jax-reverse", x, None, (),
            limits=ComputeLimits(max_seconds=1.0, flops_per_second=1e3, bytes_per_second=1e3),
        )
    assert caught.value.extra["limit"] == "request_timeout"
    within = ComputeLimits(max_memory_bytes=1 << 30, max_flops=1e9, max_seconds=10)
    prep = preparation.prepare("gradient", f, "jax-reverse", x, None, (), limits=within)
    assert np.isfinite(prep.run("gradient", x, None, ())[0]).all()


def test_estimate_counts_loops_and_reads_persisted_executables(tmp_path: Path) -> None:
    a = np.ones((64, 64))
    once = estimate(jax.jit(lambda a: a @ a).lower(a).compile())
    looped = estimate(
        jax.jit(lambda a: jax.lax.fori_loop(0, 50, lambda i, b: b @ a / 64, a)).lower(a).compile()
    )
    assert once is not None and looped is not None
    assert looped.loop_trips == 50 and looped.flops >= 50 * once.flops
    # an executable loaded from the persistent executable cache has the same analysis
    executable_cache.configure(tmp_path / "executables")
    try:
        key = executable_cache.Key("test-budget", "0" * 64, jax.devices()[0])

        def twice(a):
            return a @ a

        compiled = executable_cache.compile_or_load(key, twice, a)
        loaded = executable_cache.compile_or_load(key, twice, a)
        assert isinstance(loaded, executable_cache._Loaded)
        assert estimate(loaded) == estimate(compiled)
    finally:
        executable_cache.configure(None)


def test_in_flight_budget_admits_within_limit_and_one_oversized() -> None:
    unit = SMALL_BYTES + 1  # smaller bodies and results are not counted
    budget = Budget(limit=10 * unit, large_result_bytes=3 * unit, max_large_results=1)
    a, b = budget.ticket(), budget.ticket()
    a.hold_body(8 * unit)
    with pytest.raises(OverloadedError) as caught:
        b.hold_body(3 * unit)
    assert caught.value.extra["retry_after"] >= 1 and b.held == 0
    a.hold_body(unit)  # shrinks
    b.hold_body(3 * unit)
    a.release()
    b.release()
    b.release()  # again: nothing happens
    assert budget.used == 0
    a.hold_body(50 * unit)  # alone, an oversized request still runs
    a.release()
    small = budget.ticket()
    small.hold_body(SMALL_BYTES)
    assert small.held == 0 and budget.used == 0


def test_results_are_reserved_before_they_run_and_held_until_released() -> None:
    unit = SMALL_BYTES + 1
    budget = Budget(limit=100 * unit, large_result_bytes=10 * unit, max_large_results=1)
    with budget.ticket(encode_factor=3.0) as a:  # JSON: the result, and 3x it in text
        a.reserve_result(12 * unit)
        assert budget.used == 48 * unit and budget.large == 1
        b = budget.ticket()
        with pytest.raises(OverloadedError):  # the one large-result slot is taken
            b.reserve_result(12 * unit)
        assert b.held == 0 and budget.used == 48 * unit
        a.computed()  # the slot is free again; the bytes stay until the answer is written
        assert budget.large == 0 and budget.used == 48 * unit
        b.reserve_result(12 * unit)
        with pytest.raises(OverloadedError):  # the budget is full: refused before running
            budget.ticket().reserve_result(50 * unit)
        b.release()
    assert budget.used == 0 and budget.large == 0


# --- in total: bytes in flight and large results ---------------------------------
#: What the server may hold over its baseline beyond the configured in-flight budget:
#: one large result being computed (a dense Hessian here: ~18 MB) and its JSON text,
#: the allocator's slack, and XLA's buffers for the running job.
MEMORY_SLACK = 384 * 2**20
BUDGET = 256 * 2**20


def test_memory_bounded_under_concurrent_large_bodies_and_hessians(make_server) -> None:
    srv = make_server(env={
        "DXSERVE_MAX_INFLIGHT_BYTES": str(BUDGET),
        "DXSERVE_MAX_JSON_BODY_BYTES": str(16 * 2**20),
        "DXSERVE_LARGE_RESULT_BYTES": str(8 * 2**20),
        "DXSERVE_MAX_LARGE_RESULTS": "1",
    })
    n_body = 600_000  # ~11 MB of JSON, ~180 MB to decode at 16x: one at a time fits
    x = np.linspace(0.1, 1.1, n_body)
    big_json = httpx.Request(
        "POST", "/", json={"function": "rosenbrock", "backend": "jax-reverse", "x": x.tolist()}
    ).read()
    assert 8 * 2**20 < len(big_json) < 16 * 2**20
    hess = {"function": "rosenbrock", "x": np.linspace(0.1, 1.1, 1500).tolist()}  # 18 MB result

    def gradient(c: httpx.Client) -> httpx.Response:
        return c.post("/gradient", content=big_json, headers={"content-type": "application/json"})

    def hessian(c: httpx.Client) -> httpx.Response:
        return c.post("/hessian", json=hess)

    with httpx.Client(base_url=srv.url) as c:  # compile both first
        assert gradient(c).status_code == 200
        assert hessian(c).status_code == 200
    time.sleep(0.5)
    baseline = memory_of(srv.proc.pid)["VmRSS"]
    statuses: list[tuple[str, int, str | None]] = []

    def one(kind: str) -> None:
        with httpx.Client(base_url=srv.url) as c:
            r = (gradient if kind == "gradient" else hessian)(c)
            statuses.append((kind, r.status_code, r.headers.get("retry-after")))

    for _ in range(2):
        with ThreadPoolExecutor(12) as pool:
            list(pool.map(one, ["gradient"] * 8 + ["hessian"] * 4))
    peak = memory_of(srv.proc.pid)["VmHWM"]
    print(f"peak {(peak - baseline) / 2**20:.0f} MiB over baseline {baseline / 2**20:.0f} MiB; "
          f"{len(refused := [s for s in statuses if s[1] == 503])} of {len(statuses)} refused")
    assert {s for _, s, _ in statuses} <= {200, 503}, statuses
    assert refused and all(r[2] is not None for r in refused), statuses
    for kind in ("gradient", "hessian"):
        assert any(k == kind and s == 200 for k, s, _ in statuses), statuses
    assert peak - baseline < BUDGET + MEMORY_SLACK, (peak - baseline) / 2**20
    with httpx.Client(base_url=srv.url) as c:  # and it still answers
        assert c.get("/health").status_code == 200
    time.sleep(1.0)
    after = memory_of(srv.proc.pid)["VmRSS"]
    assert after - baseline < 256 * 2**20, (after - baseline) / 2**20
