"""Large answers a caller keeps are never written over by later ones.

Checked through ``Client`` and ``AsyncClient`` against a real server, on answers large
enough for ``dxclient.transport``'s fast path: results kept across later calls, in
sequence and gathered concurrently, still hold their own values.
"""

from __future__ import annotations

import asyncio

import numpy as np

from dxclient import AsyncClient, Client
from dxserve import JaxReverse

N = 50_000  # a 400 KB answer: past the transport's 64 KiB


def _expected(x: np.ndarray) -> np.ndarray:
    """The Rosenbrock gradient, analytically."""
    g = np.zeros_like(x)
    g[:-1] = -400.0 * x[:-1] * (x[1:] - x[:-1] ** 2) - 2.0 * (1.0 - x[:-1])
    g[1:] += 200.0 * (x[1:] - x[:-1] ** 2)
    return g


def _points(count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    return [rng.uniform(-1.5, 1.5, N) for _ in range(count)]


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
