"""Checkpoints of chunked runs (``jobs.Checkpoints``, ``chunking.Chunker.run``), in process.

A detached job's run keeps each finished chunk; a run resumed after a crash takes back
the chunks kept under its own plan instead of computing them, and its result is the
uninterrupted run's bit for bit. A chunk kept under another plan (another chunk size),
or one whose bytes do not fit, is computed again.
"""

from __future__ import annotations

import numpy as np
import pytest

from dxserve.core import preparation
from dxserve.core.progress import Job, JobCancelled
from dxserve.examples import rosenbrock, sin_cumsum
from dxserve.frameworks.jax.precision import float64_scope
from tests.references import rosenbrock_hessian, sin_cumsum_jacobian


class Kept:
    """Checkpoints in a dict: what a store would keep, and what was asked of it."""

    def __init__(self, blocks: dict[str, bytes] | None = None, stop_after: int | None = None):
        self.blocks = dict(blocks or {})
        self.saved: list[str] = []
        self.restored: list[str] = []
        self.stop_after = stop_after

    def restore(self, key: str, shape: tuple, dtype) -> np.ndarray | None:
        data = self.blocks.get(key)
        if data is None:
            return None
        block = np.frombuffer(data, np.dtype(dtype))
        if block.size != int(np.prod(shape)):
            return None
        self.restored.append(key)
        return block.reshape(shape)

    def save(self, key: str, block: np.ndarray, done: int) -> None:
        self.blocks[key] = np.ascontiguousarray(block).tobytes()
        self.saved.append(key)
        if self.stop_after is not None and len(self.saved) >= self.stop_after:
            raise JobCancelled("the process died here")  # as a lost lease stops a run


def _run(prep: preparation.Prep, operator: str, x: np.ndarray, size: int, kept: Kept) -> tuple:
    job = Job()
    job.checkpoints = kept
    with float64_scope():
        return prep.chunker.run(prep, operator, x, None, (), size, job), job


@pytest.mark.parametrize(
    ("operator", "f", "backend", "reference"),
    [("hessian", rosenbrock, "jax-forward", rosenbrock_hessian),
     ("value_and_jacobian", sin_cumsum, "jax-reverse", sin_cumsum_jacobian)],
)
def test_a_resumed_run_takes_back_its_chunks_and_gives_the_same_bits(
    operator, f, backend, reference
) -> None:
    x = np.linspace(0.1, 1.3, 50)
    prep = preparation.prepare(operator, f, backend, x, None, ())
    whole = Kept()
    uninterrupted, _ = _run(prep, operator, x, 7, whole)
    chunks = len(whole.saved)
    assert chunks == 8  # 50 in chunks of 7: seven, and a last one overlapping the sixth
    derivative = uninterrupted[-1]
    np.testing.assert_allclose(derivative, reference(x), rtol=1e-12, atol=1e-12)

    crashed = Kept(stop_after=3)  # a run that died after its third chunk was kept
    with pytest.raises(JobCancelled):
        _run(prep, operator, x, 7, crashed)
    resumed = Kept(crashed.blocks)
    out, job = _run(prep, operator, x, 7, resumed)
    assert sorted(resumed.restored) == sorted(crashed.saved)  # the three, not recomputed
    assert len(resumed.saved) == chunks - 3  # the others, computed once each
    assert set(resumed.saved).isdisjoint(resumed.restored)
    for got, want in zip(out, uninterrupted, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert job.reports[-1] == 50


def test_chunks_of_another_plan_or_size_are_computed_again() -> None:
    x = np.linspace(0.1, 1.3, 40)
    prep = preparation.prepare("hessian", rosenbrock, "jax-forward", x, None, ())
    first = Kept()
    (want,), _ = _run(prep, "hessian", x, 8, first)
    # the same chunks under a plan of another size: none is taken back
    other = Kept(first.blocks)
    (got,), _ = _run(prep, "hessian", x, 5, other)
    assert other.restored == [] and len(other.saved) == 8
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-12)
    # a kept block with the wrong number of bytes is computed again, never trusted
    broken = Kept({key: data[:-8] for key, data in first.blocks.items()})
    (again,), _ = _run(prep, "hessian", x, 8, broken)
    assert broken.restored == [] and len(broken.saved) == 5
    np.testing.assert_array_equal(again, want)
