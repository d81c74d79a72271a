"""Request batching is invisible: merged calls return the bits each request gets alone.

(a) ``Batcher`` unit: buckets, eligibility, the bit check that earns a batched
executable and the refusal when it fails; (b) ``DeviceWorker``: queued jobs of one
group run as one call, a lone request never waits for company, expired jobs are
dropped; (c) over real HTTP: concurrent clients get bit-identical answers while
the server merges their requests, and no call after the first recompiles.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dxserve
from dxclient import Client
from dxcontract.errors import DeadlineExceededError
from dxserve.core.preparation import prepare
from dxserve.core.request_batching import Batcher, bucket
from dxserve.frameworks.jax.framework import primitives
from dxserve.server.worker import DeviceWorker


def cube_sum(x):
    return jnp.sum(x**3) / 3.0  # gradient x * x: one multiply, no FMA to contract


def rosenbrock(x):
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def branchy(x):
    return jax.lax.cond(x[0] > 0, lambda v: jnp.sum(jnp.sqrt(v)), lambda v: jnp.sum(v), x)


def _same_bits(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _group(n: int, k: int, seed: int = 0) -> list[tuple]:
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=n), None, ()) for _ in range(k)]


# --- (a) the batcher ---------------------------------------------------------------


def test_buckets_are_powers_of_two():
    assert [bucket(k) for k in (1, 2, 3, 4, 5, 8, 9, 31, 32, 33)] == [
        1, 2, 4, 4, 8, 8, 16, 32, 32, 64
    ]


@pytest.mark.parametrize("operator", ["gradient", "value_and_gradient"])
def test_verified_batches_are_bit_identical(operator):
    group = _group(100, 5)
    prep = prepare(operator, cube_sum, "jax-reverse", *group[0])
    batcher = Batcher()
    first = batcher.run_group(prep, operator, group)  # the bit check: answered alone
    assert batcher.batches == 0 and batcher.refused == 0
    assert prep.batch_plans[operator].verified == {(8, None)}
    second = batcher.run_group(prep, operator, group)  # answered by one vmapped call
    assert batcher.batches == 1 and batcher.batched_requests == 5
    for inputs, a, b in zip(group, first, second, strict=True):
        alone = prep.run(operator, *inputs)
        for u, v, w in zip(alone, a, b, strict=True):
            assert _same_bits(u, v) and _same_bits(u, w)
    np.testing.assert_array_equal(np.asarray(second[0][-1]), group[0][0] ** 2)


def test_every_answer_matches_alone_whatever_xla_does():
    """Rosenbrock's vmapped program may or may not keep the bits on this CPU; either way
    the answers must be the unbatched bits, and the batcher must have decided."""
    group = _group(10, 3, seed=1)
    prep = prepare("gradient", rosenbrock, "jax-reverse", *group[0])
    batcher = Batcher()
    for _ in range(3):
        out = batcher.run_group(prep, "gradient", group)
        for inputs, got in zip(group, out, strict=True):
            assert _same_bits(prep.run("gradient", *inputs)[0], got[0])
    plan = prep.batch_plans["gradient"]
    assert plan.verified == {(4, None)} or plan.executables[(4, None)] is None


def test_a_batch_that_changes_bits_is_refused_for_good(monkeypatch):
    group = _group(50, 4, seed=2)
    prep = prepare("gradient", cube_sum, "jax-reverse", *group[0])
    batcher = Batcher()
    real = batcher._run_batched

    def off_by_one_ulp(plan, size, rows, *limits):
        out = real(plan, size, rows, *limits)
        out[1] = (np.nextafter(out[1][0], np.inf),)
        return out

    monkeypatch.setattr(batcher, "_run_batched", off_by_one_ulp)
    for _ in range(3):
        out = batcher.run_group(prep, "gradient", group)
        for inputs, got in zip(group, out, strict=True):
            assert _same_bits(prep.run("gradient", *inputs)[0], got[0])
    assert batcher.refused == 1 and batcher.batches == 0
    assert prep.batch_plans["gradient"].executables[(4, None)] is None


def test_control_flow_is_never_batched():
    group = [(np.abs(x) + 0.1, None, ()) for x, _, _ in _group(8, 4, seed=3)]
    group[1] = (-group[1][0], None, ())  # the other branch: sqrt' would be NaN there
    prep = prepare("gradient", branchy, "jax-reverse", *group[0])
    batcher = Batcher()
    out = batcher.run_group(prep, "gradient", group)
    plan = prep.batch_plans["gradient"]
    assert not plan.eligible and "cond" in plan.why
    for inputs, got in zip(group, out, strict=True):
        assert _same_bits(prep.run("gradient", *inputs)[0], got[0])
    np.testing.assert_array_equal(np.asarray(out[1][0]), np.ones(8))


def test_primitives_finds_nested_jaxprs():
    closed = jax.make_jaxpr(jax.grad(branchy))(np.ones(3))
    found = primitives(closed.jaxpr)
    assert "cond" in found and "sqrt" in found


def test_errors_stay_with_their_request():
    def picky(x):
        return jnp.sum(x**2)

    group = _group(6, 3, seed=4)
    prep = prepare("gradient", picky, "jax-reverse", *group[0])
    wrong = (np.ones(7), None, ())  # a signature the prep was not made for
    out = Batcher().run_group(prep, "gradient", [group[0], wrong, group[2]])
    assert isinstance(out[1], Exception)
    np.testing.assert_array_equal(np.asarray(out[0][0]), 2 * group[0][0])
    np.testing.assert_array_equal(np.asarray(out[2][0]), 2 * group[2][0])


# --- (b) the device worker ---------------------------------------------------------


def _worker(**kwargs: Any) -> DeviceWorker:
    options = {"queue_size": 64, "timeout": 60.0, "pin": False, "max_batch": 8} | kwargs
    return DeviceWorker(jax.devices()[0], **options)


def test_queued_jobs_of_one_group_run_as_one_call():
    worker = _worker()
    gate = threading.Event()
    calls: list[list[int]] = []

    def run_group(items):
        calls.append(list(items))
        return [i * 10 for i in items]

    async def main():
        blocker = asyncio.ensure_future(worker.run(gate.wait))
        await asyncio.sleep(0.05)  # the worker is now busy with the blocker
        jobs = [asyncio.ensure_future(worker.run_grouped("g", i, run_group)) for i in range(5)]
        other = asyncio.ensure_future(worker.run_grouped("h", 99, run_group))
        await asyncio.sleep(0.05)
        gate.set()
        return await blocker, await asyncio.gather(*jobs), await other

    try:
        _, results, other = asyncio.run(main())
    finally:
        worker.close()
    assert results == [0, 10, 20, 30, 40] and other == 990
    assert calls == [[0, 1, 2, 3, 4], [99]]
    assert worker.batches == 1 and worker.pending == 0


def test_groups_are_capped_at_max_batch():
    worker = _worker(max_batch=4)
    gate = threading.Event()
    sizes: list[int] = []

    def run_group(items):
        sizes.append(len(items))
        return list(items)

    async def main():
        blocker = asyncio.ensure_future(worker.run(gate.wait))
        await asyncio.sleep(0.05)
        jobs = [asyncio.ensure_future(worker.run_grouped("g", i, run_group)) for i in range(10)]
        await asyncio.sleep(0.05)
        gate.set()
        await blocker
        return await asyncio.gather(*jobs)

    try:
        assert asyncio.run(main()) == list(range(10))
    finally:
        worker.close()
    assert sizes == [4, 4, 2]


def test_a_lone_request_on_an_idle_worker_never_waits_for_company():
    worker = _worker(batch_wait=30.0)  # a lone job that waited would take 30 s

    async def main():
        return await asyncio.wait_for(worker.run_grouped("g", 7, lambda items: list(items)), 10)

    try:
        assert asyncio.run(main()) == 7
    finally:
        worker.close()


def test_queued_requests_wait_up_to_batch_wait_for_company():
    worker = _worker(batch_wait=0.5)
    gate = threading.Event()
    calls: list[list[int]] = []

    def run_group(items):
        calls.append(list(items))
        return list(items)

    async def main():
        blocker = asyncio.ensure_future(worker.run(gate.wait))
        await asyncio.sleep(0.02)
        first = asyncio.ensure_future(worker.run_grouped("g", 1, run_group))
        await asyncio.sleep(0.02)
        gate.set()  # the worker takes job 1 (queued: it may wait for company)
        await asyncio.sleep(0.1)
        second = asyncio.ensure_future(worker.run_grouped("g", 2, run_group))
        return await blocker, await first, await second

    try:
        assert asyncio.run(main())[1:] == (1, 2)
    finally:
        worker.close()
    assert calls == [[1, 2]]


def test_expired_jobs_are_dropped_before_they_run():
    worker = _worker(timeout=0.2)
    gate = threading.Event()
    ran: list[int] = []

    async def main():
        blocker = asyncio.ensure_future(worker.run(gate.wait, timeout=60.0))
        await asyncio.sleep(0.02)
        late = asyncio.ensure_future(worker.run(lambda: ran.append(1)))
        with pytest.raises(DeadlineExceededError):
            await late  # expired in the queue, behind a job within its own deadline
        gate.set()
        assert await blocker is True

    try:
        asyncio.run(main())
    finally:
        worker.close()
    assert ran == [] and worker.pending == 0 and worker.abandoned == 0


def test_a_job_past_its_deadline_abandons_its_thread_and_the_queue_goes_on():
    worker = _worker(timeout=0.2)
    gate = threading.Event()
    ran: list[int] = []

    async def main():
        blocker = asyncio.ensure_future(worker.run(gate.wait))
        await asyncio.sleep(0.02)
        queued = asyncio.ensure_future(worker.run(lambda: ran.append(1) or 7, timeout=60.0))
        with pytest.raises(DeadlineExceededError):
            await blocker  # 504 at its deadline, still running
        assert await queued == 7  # served by the thread that replaced it
        assert worker.stuck == 1 and worker.abandoned == 1
        gate.set()  # the abandoned thread ends its job, its answer dropped, and exits
        for _ in range(500):
            if worker.stuck == 0:
                break
            await asyncio.sleep(0.01)
        assert await worker.run(lambda: 8) == 8

    try:
        asyncio.run(main())
    finally:
        worker.close()
    assert ran == [1] and worker.stuck == 0 and worker.pending == 0


def test_a_failing_group_fails_each_request_not_the_worker():
    worker = _worker()

    def broken(items):
        raise RuntimeError("boom")

    async def main():
        with pytest.raises(RuntimeError):
            await worker.run_grouped("g", 1, broken)
        return await worker.run(lambda: 42)

    try:
        assert asyncio.run(main()) == 42
    finally:
        worker.close()


# --- (c) over real HTTP --------------------------------------------------------------


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.parametrize("encoding", ["binary", "json"])
def test_concurrent_clients_get_unbatched_bits(make_server: Any, encoding: str) -> None:
    # inline off so every request goes through the worker queue and can be merged
    server = make_server(env={"DXSERVE_INLINE_BELOW": "0", "DXSERVE_MAX_BATCH": "16"})
    rng = np.random.default_rng(5)
    xs = [rng.normal(size=100) for _ in range(48)]
    expected = [dxserve.gradient(rosenbrock, "jax-reverse", x) for x in xs]
    with Client(server.url, encoding=encoding) as warm:
        warm.gradient("rosenbrock", "jax-reverse", xs[0])  # compile once
    with httpx.Client(base_url=server.url) as http:
        before = http.get("/metrics").text

    def one(i: int) -> np.ndarray:
        with Client(server.url, encoding=encoding) as client:
            return np.asarray(client.gradient("rosenbrock", "jax-reverse", xs[i]))

    def round_trip() -> None:
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(one, range(len(xs))))
        for g, e in zip(got, expected, strict=True):
            assert _same_bits(g, e)

    for _ in range(4):  # a few rounds, so verified buckets get used too
        round_trip()
    with httpx.Client(base_url=server.url) as http:
        after = http.get("/metrics").text
    # merged or not, nothing recompiled the operator after the first call, and each
    # batch bucket (2, 4, 8, 16) compiled at most once
    misses = "dxserve_compile_cache_misses_total"
    assert _metric(after, misses) == _metric(before, misses)
    compiles = "dxserve_batch_compiles_total"
    assert _metric(after, compiles) <= 4
    merged = _metric(after, "dxserve_batched_requests_total")
    refused = _metric(after, "dxserve_batching_refused_total")
    assert merged > 0 or refused > 0, "no requests were ever merged"


# --- (d) several devices -----------------------------------------------------------


def test_requests_spread_over_devices_with_their_own_executables(make_server: Any) -> None:
    """Two (forced) CPU devices: a busy device's requests spill to the other, which
    compiles its own copy of the executable; answers are the same bits either way."""
    server = make_server(env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    with httpx.Client(base_url=server.url) as http:
        assert len(http.get("/ready").json()["devices"]) == 2
    rng = np.random.default_rng(6)
    xs = [rng.normal(size=300) for _ in range(64)]
    expected = [dxserve.gradient(rosenbrock, "jax-reverse", x) for x in xs]

    def one(i: int) -> np.ndarray:
        with Client(server.url) as client:
            return np.asarray(client.gradient("rosenbrock", "jax-reverse", xs[i]))

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(len(xs))))
    for g, e in zip(got, expected, strict=True):
        assert _same_bits(g, e)
    with httpx.Client(base_url=server.url) as http:
        text = http.get("/metrics").text
    per_device = [
        float(line.split()[-1]) for line in text.splitlines()
        if line.startswith("dxserve_device_jobs_total{")
    ]
    assert len(per_device) == 2 and all(jobs > 0 for jobs in per_device), per_device
