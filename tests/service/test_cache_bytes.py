"""Caches of compiled operators bounded by bytes, in process: ``Prep.nbytes`` (what a prep
keeps alive: executables with their constants, a sparse engine's pattern, colouring and
index arrays), ``PrepCache`` and the server's ``PrepHandles`` evicting by bytes,
re-measuring a prep that compiled more, keeping no prep over the whole budget (the
request that made it is still answered), and ``memory.Trimmer``'s trigger and rate."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from dxcontract.errors import BudgetExceededError, UnknownPreparationError
from dxserve.core.footprint import EXECUTABLE_BYTES, constant_bytes, executable_bytes
from dxserve.core.preparation import PrepCache, call, prepare
from dxserve.examples import rosenbrock, softmax
from dxserve.frameworks.jax import sparse as sparse_backend
from dxserve.server.memory import Trimmer, malloc_trim
from dxserve.server.service import PrepHandles, Service
from dxserve.settings import Settings


def _x(n: int) -> np.ndarray:
    return np.linspace(0.1, 1.3, n)


# --- footprints -------------------------------------------------------------------------
def test_executable_footprint_counts_its_constants() -> None:
    table = np.random.default_rng(0).normal(size=(500, 400))  # 1.6 MB baked into the program

    def with_table(x):
        return jnp.sum(jnp.tanh(jnp.asarray(table) @ x))

    def without(x):
        return jnp.sum(jnp.tanh(x))

    big = prepare("gradient", with_table, "jax-reverse", _x(400), None, ())
    small = prepare("gradient", without, "jax-reverse", _x(400), None, ())
    (exe,) = big.executables.values()
    assert constant_bytes(exe.as_text()) >= table.nbytes
    assert executable_bytes(exe) >= EXECUTABLE_BYTES + table.nbytes
    assert big.nbytes() - small.nbytes() >= table.nbytes
    assert EXECUTABLE_BYTES <= small.nbytes() < table.nbytes


def test_sparse_prep_counts_pattern_colouring_and_indices() -> None:
    n = 300  # softmax: a dense n x n pattern
    prep = prepare("sparsity", softmax, {"type": "sparse"}, _x(n), None, ())
    engine = prep.compiler
    nnz = n * n
    # rows and cols (int32 each), the (nnz, 2) int32 device indices, the wire form's
    # column indices: at least 20 bytes per nonzero
    assert engine.held_bytes() >= 20 * nnz
    assert prep.nbytes() >= engine.held_bytes()
    jac = prepare("jacobian", softmax, {"type": "sparse"}, _x(n), None, ())
    assert jac.compiler.coloring is not None
    assert jac.compiler.held_bytes() > engine.held_bytes()  # the colouring's arrays too


def test_sparse_wire_memo_does_not_keep_a_dropped_pattern_alive() -> None:
    prep = prepare("sparsity", softmax, {"type": "sparse"}, _x(200), None, ())
    out = prep.run("sparsity", _x(200), None, ())[0]
    wire = sparse_backend.sparse_wire(out)
    assert wire["shape"] == [200, 200] and len(wire["indices"]) == 200 * 200
    assert wire["indices"] is prep.compiler.wire["indices"]  # made once, at preparation
    alive = weakref.ref(prep.compiler)
    del prep, out, wire
    gc.collect()
    assert alive() is None  # the memo's entry holds no pattern, indices or wire form


# --- the prep cache -------------------------------------------------------------------
def test_prep_cache_evicts_least_recently_used_by_bytes() -> None:
    one = prepare("hessian", rosenbrock, "auto", _x(20), None, ()).nbytes()
    cache = PrepCache(512, max_bytes=int(2.5 * one))
    sizes = list(range(20, 26))
    for n in sizes:
        h = call("hessian", rosenbrock, "auto", _x(n), None, (), cache=cache)
        assert h.shape == (n, n)
        assert cache.nbytes <= cache.max_bytes
    assert len(cache) == 2  # by bytes: far below the count bound
    kept = {key[3] for key in cache._items.keys()}
    latest = {prep.signature for prep in (cache.peek(k) for k in cache._items.keys())}
    assert kept == latest and len(kept) == 2
    hits = cache.hits
    call("hessian", rosenbrock, "auto", _x(sizes[-1]), None, (), cache=cache)  # the newest: kept
    assert cache.hits == hits + 1
    call("hessian", rosenbrock, "auto", _x(sizes[0]), None, (), cache=cache)  # the oldest: gone
    assert cache.misses > 0 and cache.nbytes <= cache.max_bytes


def test_prep_over_the_whole_budget_answers_its_request_and_is_not_kept() -> None:
    evicted: list[int] = []
    cache = PrepCache(512, max_bytes=1024, on_evict=evicted.append)
    g = call("gradient", rosenbrock, "jax-reverse", _x(8), None, (), cache=cache)
    np.testing.assert_allclose(g, np.asarray(rosenbrock_gradient(_x(8))), rtol=1e-12)
    assert len(cache) == 0 and cache.nbytes == 0 and evicted == []


def rosenbrock_gradient(x: np.ndarray) -> np.ndarray:
    """Rosenbrock's gradient, by hand (float64)."""
    a, b = x[:-1], x[1:]
    g = np.zeros_like(x)
    g[:-1] = -400 * a * (b - a**2) - 2 * (1 - a)
    g[1:] += 200 * (b - a**2)
    return g


def test_prep_that_compiles_more_is_measured_again() -> None:
    cache = PrepCache(512, max_bytes=1 << 30)
    x = _x(10)
    call("gradient", rosenbrock, "jax-reverse", x, None, (), cache=cache)
    (key,) = cache._items.keys()
    before = cache.nbytes
    prep = cache.peek(key)
    value, grad = call("value_and_gradient", rosenbrock, "jax-reverse", x, None, (), prep=prep)
    assert len(prep.executables) == 2  # value_and_gradient compiled on the gradient prep
    assert cache.nbytes >= before + EXECUTABLE_BYTES
    assert cache._items.size_of(key) == prep.nbytes() == cache.nbytes
    np.testing.assert_allclose(grad, rosenbrock_gradient(x), rtol=1e-12)


def test_growth_past_the_budget_evicts() -> None:
    x = _x(10)
    probe = PrepCache()
    call("gradient", rosenbrock, "jax-reverse", x, None, (), cache=probe)
    one = probe.nbytes
    cache = PrepCache(512, max_bytes=int(1.5 * one))  # one executable fits, two do not
    call("gradient", rosenbrock, "jax-reverse", x, None, (), cache=cache)
    (key,) = cache._items.keys()
    prep = cache.peek(key)
    call("value_and_gradient", rosenbrock, "jax-reverse", x, None, (), prep=prep)
    assert len(cache) == 0 and cache.nbytes == 0


def test_twins_share_while_cached_and_the_index_holds_no_prep() -> None:
    cache = PrepCache()
    x, t = _x(6), (np.ones(6),)
    first = call("hvp", rosenbrock, "auto", x, t, (), cache=cache)
    second = call(
        "hvp", rosenbrock,
        {"type": "second-order", "outer": "jax-forward", "inner": "jax-reverse"}, x, t, (),
        cache=cache,
    )
    np.testing.assert_allclose(first, second, rtol=1e-12)
    a, b = (cache.peek(k) for k in cache._items.keys())
    assert a.executables is b.executables  # one compiled executable for both spellings
    alive = weakref.ref(a)
    del a, b
    cache.clear()
    gc.collect()
    assert alive() is None and len(cache._resolved) == 0


def test_forget_drops_a_functions_preps_and_twins() -> None:
    cache = PrepCache()

    def f(x):
        return jnp.sum(x ** 3)

    call("gradient", f, "jax-reverse", _x(4), None, (), cache=cache)
    call("gradient", rosenbrock, "jax-reverse", _x(4), None, (), cache=cache)
    cache.forget(f)
    assert [key[0] for key in cache._items.keys()] == [rosenbrock]
    assert all(key[0] is rosenbrock for key in cache._resolved.keys())
    assert cache.nbytes == cache._items.size_of(cache._items.keys()[0])


# --- handles of POST /prepare -----------------------------------------------------------
def test_handles_are_bounded_by_bytes_and_refuse_an_oversized_prep() -> None:
    preps = [prepare("hessian", rosenbrock, "auto", _x(n), None, ()) for n in (10, 11, 12)]
    evicted: list[int] = []
    handles = PrepHandles(1024, max_bytes=int(2.5 * preps[0].nbytes()), on_evict=evicted.append)
    made = [handles.add(p) for p in preps]
    with pytest.raises(UnknownPreparationError):
        handles.get(made[0])  # evicted by bytes: answered 404, made again by the client
    assert handles.get(made[2]) is preps[2] and handles.nbytes <= handles.max_bytes
    assert len(evicted) == 1 and evicted[0] == preps[0].nbytes()
    tiny = PrepHandles(1024, max_bytes=1024)
    with pytest.raises(BudgetExceededError) as caught:
        tiny.add(preps[0])
    assert caught.value.field == "x"
    assert caught.value.extra["limit"] == "max_prepared_bytes"
    assert "DXSERVE_MAX_PREPARED_BYTES" in str(caught.value)


def test_service_budgets_come_from_settings(tmp_path: Path) -> None:
    settings = Settings(
        store=str(tmp_path / "store"), functions=["dxserve.examples"], compilation_cache="",
        cache_bytes=3 << 20, max_prepared_bytes=2 << 20, trim_after_bytes=0,
    )
    service = Service(settings)
    try:
        assert service.cache.max_bytes == 3 << 20 and service.handles.max_bytes == 2 << 20
        assert not service.trimmer.enabled

        async def scenario() -> None:
            x = _x(30)
            for n in range(30, 40):
                out = await service.call("hessian", "rosenbrock", "auto", _x(n))
                assert out["hessian"].shape == (n, n)
            assert 0 < service.cache.nbytes <= 3 << 20 and len(service.cache) < 10
            made = await service.prepare("gradient", "rosenbrock", "jax-reverse", x)
            got = await service.call("gradient", "rosenbrock", "jax-reverse", x, prep=made["prep"])
            np.testing.assert_allclose(got["gradient"], rosenbrock_gradient(x), rtol=1e-12)
            assert 0 < service.handles.nbytes <= 2 << 20

        asyncio.run(scenario())
    finally:
        service.close()


# --- giving memory back -----------------------------------------------------------------
def test_trimmer_trims_once_releases_add_up_at_most_once_per_interval() -> None:
    done = threading.Event()
    calls: list[str] = []

    def trim() -> int:
        calls.append("trim")
        done.set()
        return 1

    trimmer = Trimmer(1000, interval=600.0, trim=trim, clear=lambda: calls.append("clear"))
    try:
        trimmer.released(600)  # below the threshold: no thread, no trim
        assert trimmer._thread is None
        trimmer.released(500, evicted=True)  # 1100 released in all: trim, clearing first
        for _ in range(5):  # a burst: covered by that trim or the next, not five more
            trimmer.released(1000)
        assert done.wait(30)
        trimmer.released(5000)  # within the interval: not yet
        assert trimmer.trims == 1 and calls == ["clear", "trim"]
    finally:
        trimmer.close()
    assert not trimmer._thread.is_alive()


def test_trimmer_off_at_zero_and_malloc_trim_on_glibc() -> None:
    off = Trimmer(0)
    off.released(1 << 40)
    assert not off.enabled and off._thread is None
    import platform

    found = malloc_trim()
    if platform.libc_ver()[0] == "glibc":
        assert found is not None and found() in (0, 1)
    else:
        assert found is None
