"""Large answers are read into buffers the client reuses, never into one still in use.

``dxclient._buffers.AnswerBuffers`` hands a kept buffer out again only when nothing
outside the pool refers to it. Checked on the pool itself and through ``Client`` and
``AsyncClient`` against a real server, on answers large enough for the fast path: results
kept across later calls, in sequence and gathered concurrently, still hold their own
values, and a loop that drops them reads every answer into the same memory.
"""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest

from dxclient import AsyncClient, Client, _buffers
from dxclient._buffers import AnswerBuffers
from dxserve import JaxReverse

N = 50_000  # a 400 KB answer: past the pool's minimum


def _expected(x: np.ndarray) -> np.ndarray:
    """The Rosenbrock gradient, analytically."""
    g = np.zeros_like(x)
    g[:-1] = -400.0 * x[:-1] * (x[1:] - x[:-1] ** 2) - 2.0 * (1.0 - x[:-1])
    g[1:] += 200.0 * (x[1:] - x[:-1] ** 2)
    return g


def _points(count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    return [rng.uniform(-1.5, 1.5, N) for _ in range(count)]


def test_a_free_buffer_is_reused_and_a_held_one_never() -> None:
    pool = AnswerBuffers(min_bytes=1024)
    first = pool.take(4096)
    first[:] = b"a" * 4096
    held = pool.take(4096)  # ``first`` is still referred to here: a new buffer
    assert held is not first
    del first
    again = pool.take(4096)
    assert bytes(again) == b"a" * 4096  # the same memory, handed out once it was free
    view = memoryview(again)  # a view (as a decoded array holds) keeps it busy
    del again
    assert bytes(pool.take(4096)) != b"a" * 4096
    del view


def test_views_and_arrays_keep_a_buffer_busy() -> None:
    pool = AnswerBuffers(min_bytes=1024)
    buf = pool.take(8192)
    arr = np.frombuffer(memoryview(buf).toreadonly(), dtype=np.float64)
    buf_id = id(buf)
    del buf
    assert all(id(pool.take(8192)) != buf_id for _ in range(3))
    del arr
    gc.collect()
    assert any(id(pool.take(8192)) == buf_id for _ in range(5))


def test_sizes_outside_the_pool_and_its_limits() -> None:
    pool = AnswerBuffers(min_bytes=1024, max_bytes=10_000, max_count=2)
    assert len(pool.take(100)) == 100  # smaller than the pool's minimum: never kept
    assert pool._kept == []
    pool.take(20_000)  # larger than the whole pool: fresh, never kept
    assert pool._kept == []
    held = [pool.take(3000) for _ in range(4)]  # all busy: the oldest are let go
    assert len(pool._kept) == 2 and pool._kept == held[2:]
    pool.take(6000)  # 3000 + 3000 + 6000 > max_bytes: the oldest go first
    assert sum(map(len, pool._kept)) <= 10_000
    pool.clear()
    assert pool._kept == []


def test_without_reference_counts_every_answer_gets_fresh_memory(monkeypatch) -> None:
    monkeypatch.setattr(_buffers, "_FREE", None)  # as on PyPy or a free-threaded build
    pool = AnswerBuffers(min_bytes=1024)
    first = pool.take(4096)
    first[:] = b"a" * 4096
    del first
    assert bytes(pool.take(4096)) == bytes(4096)  # fresh, zeroed memory
    assert pool._kept == []


def test_kept_results_are_never_written_over_sync(server) -> None:
    backend = JaxReverse()
    points = _points(6)
    with Client(server.url) as c:
        kept = [c.gradient("rosenbrock", backend, x) for x in points]
        for x, g in zip(points, kept, strict=True):
            np.testing.assert_allclose(g, _expected(x), rtol=1e-12, atol=1e-9)
        # and again, dropping every other result: new answers may reuse only those
        kept = kept[::2]
        more = [c.gradient("rosenbrock", backend, x) for x in points[1::2]]
        for x, g in zip(points[::2], kept, strict=True):
            np.testing.assert_allclose(g, _expected(x), rtol=1e-12, atol=1e-9)
        for x, g in zip(points[1::2], more, strict=True):
            np.testing.assert_allclose(g, _expected(x), rtol=1e-12, atol=1e-9)


def test_kept_results_are_never_written_over_async(server) -> None:
    backend = JaxReverse()
    points = _points(4)

    async def run() -> None:
        async with AsyncClient(server.url) as c:
            kept = [await c.gradient("rosenbrock", backend, x) for x in points]
            kept += await asyncio.gather(*(c.gradient("rosenbrock", backend, x) for x in points))
            for x, g in zip(points + points, kept, strict=True):
                np.testing.assert_allclose(g, _expected(x), rtol=1e-12, atol=1e-9)

    asyncio.run(run())


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_loop_that_drops_its_results_reads_into_one_buffer(server, asynchronous: bool) -> None:
    """No garbage collection needed: a buffer is free once the caller's arrays are gone."""
    backend = JaxReverse()
    x = _points(1)[0]
    expected = _expected(x)
    gc.disable()
    try:
        if asynchronous:
            async def run() -> tuple[list[int], int]:
                async with AsyncClient(server.url) as c:
                    seen = []
                    for _ in range(8):
                        g = await c.gradient("rosenbrock", backend, x)
                        np.testing.assert_allclose(g, expected, rtol=1e-12, atol=1e-9)
                        seen.append(id(c._fast.buffers._kept[-1]))
                        del g
                    return seen, len(c._fast.buffers._kept)

            seen, kept = asyncio.run(run())
        else:
            with Client(server.url) as c:
                seen = []
                for _ in range(8):
                    g = c.gradient("rosenbrock", backend, x)
                    np.testing.assert_allclose(g, expected, rtol=1e-12, atol=1e-9)
                    seen.append(id(c._fast.buffers._kept[-1]))
                    del g
                kept = len(c._fast.buffers._kept)
    finally:
        gc.enable()
    assert len(set(seen)) == 1 and kept == 1
