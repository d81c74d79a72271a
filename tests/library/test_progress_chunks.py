"""Chunked execution of dense Jacobians and Hessians (``dxserve.core.chunking``), in process.

The chunked path against the one-shot path (the same executables the server runs) and
against analytic derivatives; memory-sized chunks from a small budget; progress
reports; cancellation between chunks; refusal of work no chunk can hold.
"""

from __future__ import annotations

import numpy as np
import pytest

from dxcontract.errors import BudgetExceededError
from dxserve.core import preparation
from dxserve.core.chunking import CHUNK_FROM
from dxserve.core.limits import ComputeLimits
from dxserve.core.progress import Job, JobCancelled
from dxserve.examples import rosenbrock, sin_cumsum, tanh_layer
from dxserve.frameworks.jax.precision import float64_scope
from tests.recording_job import Recording
from tests.references import rosenbrock_hessian, sin_cumsum_jacobian

FORWARD_REVERSE_FD = ["jax-forward", "jax-reverse", "finite-differences"]






def _forced(prep: preparation.Prep, operator: str, size: int) -> tuple:
    """``operator`` run in chunks of ``size`` (the planner bypassed), with its job."""
    job = Job()
    x, tangents, contexts = prep._inputs  # type: ignore[attr-defined]
    with float64_scope():  # as Prep.run does
        out = prep.chunker.run(prep, operator, x, tangents, contexts, size, job)
    return out, job




def _prepare(operator: str, f, backend, x, *contexts, limits=None) -> preparation.Prep:
    prep = preparation.prepare(operator, f, backend, x, None, contexts, limits=limits)
    prep._inputs = (x, None, contexts)  # type: ignore[attr-defined]
    return prep


@pytest.mark.parametrize("backend", FORWARD_REVERSE_FD)
@pytest.mark.parametrize("size", [1, 7])
def test_chunked_jacobian_equals_one_shot(backend: str, size: int) -> None:
    x = np.linspace(0.1, 1.3, 40)
    W = np.random.default_rng(0).normal(size=(23, 40))
    prep = _prepare("jacobian", tanh_layer, backend, x, W)
    assert prep.chunker is not None and not prep.chunked("jacobian")  # small: one-shot
    one = prep.run("value_and_jacobian", x, None, (W,))
    (value, jac), job = _forced(prep, "value_and_jacobian", size)
    np.testing.assert_array_equal(value, np.asarray(one[0]))
    # XLA may round a vmapped batch of another width differently: AD results agree to
    # ~1 ulp; a difference quotient's roundoff is eps/h ~ 1e-11 of |f|, so FD to that
    atol = 1e-9 if backend == "finite-differences" else 1e-14
    np.testing.assert_allclose(jac, np.asarray(one[1]), rtol=1e-12, atol=atol)
    assert jac.shape == (23, 40)
    assert (job.done, job.total) == (job.total, 40 if backend != "jax-reverse" else 23)
    assert job.unit == ("rows" if backend == "jax-reverse" else "columns")


@pytest.mark.parametrize("backend", [*FORWARD_REVERSE_FD, {
    "type": "second-order", "outer": "jax-reverse", "inner": "jax-reverse"}])
def test_chunked_hessian_equals_one_shot_and_analytic(backend) -> None:
    x = np.linspace(0.1, 1.3, 60)
    prep = _prepare("hessian", rosenbrock, backend, x)
    one = [np.asarray(v) for v in prep.run("value_gradient_and_hessian", x, None, ())]
    (value, grad, hess), job = _forced(prep, "value_gradient_and_hessian", 9)
    np.testing.assert_array_equal(value, one[0])
    np.testing.assert_allclose(grad, one[1], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(hess, one[2], rtol=1e-12, atol=1e-10)
    tol = 1e-4 if backend == "finite-differences" else 1e-10
    np.testing.assert_allclose(hess, rosenbrock_hessian(x), rtol=tol, atol=tol * 100)
    assert job.done == job.total == 60


def test_planner_chunks_large_bases_and_streams_agree_with_plain() -> None:
    """From ``CHUNK_FROM`` basis vectors on the plan is chunked whoever asks, so a
    caller watching progress gets the plain caller's bits."""
    n = CHUNK_FROM + 26
    x = np.linspace(-1.0, 1.0, n)
    prep = _prepare("jacobian", sin_cumsum, "jax-forward", x)
    assert prep.chunked("jacobian")
    plain = np.asarray(prep.run("jacobian", x, None, ())[0])
    job = Job(streams=True)
    streamed = np.asarray(prep.run("jacobian", x, None, (), job)[0])
    np.testing.assert_array_equal(plain, streamed)
    np.testing.assert_allclose(plain, sin_cumsum_jacobian(x), rtol=1e-12, atol=1e-12)
    assert job.chunked and job.done == job.total == n and job.unit == "columns"


def test_backend_batch_size_sets_the_chunks() -> None:
    x = np.linspace(0.1, 1.3, 50)
    prep = _prepare("hessian", rosenbrock, {"type": "jax-forward", "batch_size": 8}, x)
    assert prep.chunker.size_for("hessian") == 8
    job = Recording()
    hess = prep.run("hessian", x, None, (), job)[0]
    assert job.seen == [8, 16, 24, 32, 40, 48, 50]
    np.testing.assert_allclose(hess, rosenbrock_hessian(x), rtol=1e-10, atol=1e-8)


def test_memory_budget_sizes_the_chunks() -> None:
    """A finite-difference Hessian whose one-shot program needs ~n³ bytes runs in
    chunks that fit a budget, with the analytic answer."""
    n = 120
    x = np.linspace(0.1, 1.3, n)
    budget = 4 * 1024**2
    prep = _prepare(
        "hessian", rosenbrock, "finite-differences", x,
        limits=ComputeLimits(chunk_memory_bytes=budget),
    )
    assert prep.chunker.oversized["hessian"].memory_bytes > budget  # too big for one call
    size = prep.chunker.size_for("hessian")
    assert size is not None and 1 <= size < n
    job = Job()
    hess = prep.run("hessian", x, None, (), job)[0]
    np.testing.assert_allclose(hess, rosenbrock_hessian(x), rtol=1e-4, atol=1e-2)
    assert job.done == job.total == n
    exe = next(iter(prep.chunker._executables.values()))
    assert exe.memory_analysis().temp_size_in_bytes <= budget


def test_nothing_fits_is_refused() -> None:
    x = np.linspace(0.1, 1.3, 400)
    with pytest.raises(BudgetExceededError) as info:
        prep = _prepare(
            "hessian", rosenbrock, "finite-differences", x,
            limits=ComputeLimits(chunk_memory_bytes=64 * 1024),
        )
        prep.run("hessian", x, None, (), Job())
    assert info.value.extra["limit"] == "chunk_memory_bytes"


def test_cancelled_job_stops_at_the_next_chunk() -> None:
    x = np.linspace(0.1, 1.3, 50)
    prep = _prepare("hessian", rosenbrock, {"type": "jax-forward", "batch_size": 5}, x)
    job = Recording(stop_at=15)
    with pytest.raises(JobCancelled):
        prep.run("hessian", x, None, (), job)
    assert job.seen == [5, 10, 15]  # stopped before the fourth chunk


def test_pytrees_and_small_problems_stay_one_shot() -> None:
    from dxserve.examples import least_squares

    params = {"w": np.ones((3, 2)), "b": np.zeros(2)}
    X, Y = np.ones((5, 3)), np.ones((5, 2))
    prep = preparation.prepare("hessian", least_squares, "jax-forward", params, None, (X, Y))
    assert prep.chunker is None
    small = _prepare("hessian", rosenbrock, "jax-forward", np.ones(10))
    assert not small.chunked("hessian")


# --- batches: tangents and points -------------------------------------------------
def _tree_equal(a, b, rtol: float = 1e-12) -> None:
    import jax

    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for u, v in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=1e-13)


#: a budget that holds a few tangents' or points' work but not a batch of 40
SMALL_BUDGET = ComputeLimits(chunk_memory_bytes=48 * 1024)


@pytest.mark.parametrize(("operator", "backend"), [
    ("hvp", "jax-forward"), ("gradient_and_hvp", "jax-forward"),
    ("pushforward", "jax-forward"), ("value_and_pullback", "jax-reverse"),
])
def test_tangent_batches_run_in_chunks(operator: str, backend: str) -> None:
    rng = np.random.default_rng(1)
    n, k = 200, 40
    x = rng.normal(size=n)
    f = rosenbrock if operator in ("hvp", "gradient_and_hvp") else sin_cumsum
    tangents = tuple(rng.normal(size=n) for _ in range(k))
    prep = preparation.prepare(operator, f, backend, x, tangents, (), limits=SMALL_BUDGET)
    assert prep.chunked(operator) and 1 <= prep.chunker.size_for(operator) < k
    job = Job()
    chunked = prep.run(operator, x, tangents, (), job)
    assert (job.unit, job.done, job.total) == ("tangents", k, k)
    with float64_scope():
        one = prep.executable(operator, x, tangents, ())(x, tangents, ())
    _tree_equal(chunked, one)
    batch = [r for r in chunked if isinstance(r, tuple)]
    assert batch and len(batch[0]) == k


def test_batches_of_points_run_in_chunks() -> None:
    points = 40
    x = np.random.default_rng(2).normal(size=(points, 200))
    prep = preparation.prepare("value_and_gradient", rosenbrock, "jax-reverse", x, None, (),
                               limits=SMALL_BUDGET, batch_axis=0)
    assert prep.chunked("value_and_gradient")
    job = Job()
    value, grad = prep.run("value_and_gradient", x, None, (), job)
    assert (job.unit, job.done, job.total) == ("points", points, points)
    with float64_scope():
        one = prep.executable("value_and_gradient", x, None, ())(x, None, ())
    _tree_equal((value, grad), one)
    assert value.shape == (points,) and grad.shape == (points, 200)


def test_chunk_from_zero_chunks_only_past_the_budget() -> None:
    x = np.linspace(-1.0, 1.0, CHUNK_FROM + 26)
    prep = _prepare("jacobian", sin_cumsum, "jax-forward", x,
                    limits=ComputeLimits(chunk_from=0))
    assert prep.chunker is not None and not prep.chunked("jacobian")
