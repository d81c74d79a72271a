"""Opt-in rounding batching (``DXSERVE_BATCHING=rounding``): merged answers agree with
unbatched ones to the documented tolerance (``request_batching.agree_to_rounding``:
256 units of roundoff of each result's scale); the default stays bit-exact."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from dxserve.core.preparation import prepare
from dxserve.core.request_batching import ROUNDING_ULPS, Batcher, agree_to_rounding
from dxserve.settings import Settings


def rosenbrock(x):
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def _group(n: int, k: int, seed: int) -> list[tuple]:
    rng = np.random.default_rng(seed)
    return [(rng.uniform(-1.5, 1.5, n), None, ()) for _ in range(k)]


def _within_tolerance(alone: Any, got: Any) -> None:
    """The documented bound, written out independently of ``agree_to_rounding``."""
    a, b = np.asarray(alone), np.asarray(got)
    assert a.dtype == b.dtype and a.shape == b.shape
    scale = np.abs(a) + np.abs(a).max()
    assert (np.abs(b - a) <= ROUNDING_ULPS * np.finfo(a.dtype).eps * scale).all()


def test_agree_to_rounding_bounds() -> None:
    a = np.array([1.0, -2.0, 1e-300, 0.0, 3.0])
    assert agree_to_rounding(a, a.copy())
    assert agree_to_rounding(a, np.nextafter(a, np.inf))  # one ulp everywhere
    # near zero, the array's scale counts: tiny absolute differences agree
    assert agree_to_rounding(a, a + np.array([0, 0, 1e-16, 1e-16, 0]))
    assert not agree_to_rounding(a, a * (1 + 1e-9))
    assert not agree_to_rounding(a, a.astype(np.float32))  # dtypes must match
    nan = np.array([np.nan, np.inf, 1.0])
    assert agree_to_rounding(nan, nan.copy())
    assert not agree_to_rounding(nan, np.array([np.nan, -np.inf, 1.0]))
    assert not agree_to_rounding(nan, np.array([1.0, np.inf, 1.0]))
    f32 = np.float32([1.0, 2.0])
    assert agree_to_rounding(f32, f32 * np.float32(1 + 1e-6))  # 8 ulps of float32
    assert not agree_to_rounding(f32, f32 * np.float32(1 + 1e-3))
    ints = np.arange(4)
    assert agree_to_rounding(ints, ints.copy()) and not agree_to_rounding(ints, ints + 1)
    assert agree_to_rounding(np.complex128(1 + 1j), np.complex128(1 + 1j))


@pytest.mark.parametrize("n", [10, 1000])
def test_rounding_mode_merges_what_exact_refuses_within_tolerance(n: int) -> None:
    """Rosenbrock's vmapped gradient loses bits on this CPU at these sizes (see
    bench/results/batching-bits-cpu.md) or keeps them; either way rounding mode merges,
    and every merged answer is within the bound of the unbatched one."""
    group = _group(n, 5, seed=n)
    prep = prepare("gradient", rosenbrock, "jax-reverse", *group[0])
    batcher = Batcher("rounding")
    first = batcher.run_group(prep, "gradient", group)  # the check: answered alone
    assert batcher.refused == 0
    assert prep.batch_plans["gradient"].verified == {(8, None)}
    for _ in range(2):
        merged = batcher.run_group(prep, "gradient", group)
        for inputs, a, b in zip(group, first, merged, strict=True):
            alone = prep.run("gradient", *inputs)[0]
            assert a[0].tobytes() == np.asarray(alone).tobytes()  # the check's answers: alone
            _within_tolerance(alone, b[0])
            np.testing.assert_allclose(b[0], alone, rtol=1e-12, atol=1e-12 * np.abs(alone).max())
    assert batcher.batches == 2 and batcher.batched_requests == 10


def test_rounding_mode_still_refuses_what_disagrees(monkeypatch) -> None:
    group = _group(50, 4, seed=2)
    prep = prepare("gradient", rosenbrock, "jax-reverse", *group[0])
    batcher = Batcher("rounding")
    real = batcher._run_batched

    def off_by_a_millionth(plan, size, rows, *limits):
        out = real(plan, size, rows, *limits)
        out[1] = (out[1][0] * (1 + 1e-6),)
        return out

    monkeypatch.setattr(batcher, "_run_batched", off_by_a_millionth)
    for _ in range(3):
        out = batcher.run_group(prep, "gradient", group)
        for inputs, got in zip(group, out, strict=True):
            assert got[0].tobytes() == np.asarray(prep.run("gradient", *inputs)[0]).tobytes()
    assert batcher.refused == 1 and batcher.batches == 0


def test_exact_is_the_default_and_modes_are_checked(monkeypatch) -> None:
    monkeypatch.delenv("DXSERVE_BATCHING", raising=False)
    assert Settings().batching == "exact" and Batcher().mode == "exact"
    monkeypatch.setenv("DXSERVE_BATCHING", "rounding")
    assert Settings().batching == "rounding"
    with pytest.raises(ValueError, match="batching mode"):
        Batcher("approximately")
