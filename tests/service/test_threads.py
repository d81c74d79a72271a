"""Compute threads run below the event loop (dxserve.core.threads; Linux per-thread nice)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from dxserve.core import threads
from dxserve.settings import Settings

linux_only = pytest.mark.skipif(
    not threads.per_thread_priorities(), reason="per-thread nice values are Linux-only"
)


def _in_new_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@linux_only
def test_lowers_only_the_calling_thread_and_is_idempotent():
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    steps = min(5, 19 - base)

    def lowered_twice():
        first = threads.lower_priority_of_current_thread(steps)
        second = threads.lower_priority_of_current_thread(steps)
        return first, second, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    first, second, nice = _in_new_thread(lowered_twice)
    assert steps <= 0 or (first, second, nice) == (True, True, base + steps)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # this thread
    assert os.getpriority(os.PRIO_PROCESS, os.getpid()) == base  # the process (main thread)


def test_zero_steps_changes_nothing():
    def unchanged():
        before = threads.thread_priorities().get(threading.get_native_id())
        done = threads.lower_priority_of_current_thread(0)
        return done, before, threads.thread_priorities().get(threading.get_native_id())

    done, before, after = _in_new_thread(unchanged)
    assert done is False
    assert before == after


@linux_only
def test_thread_priorities_lists_this_thread():
    found = threads.thread_priorities()
    assert threading.get_native_id() in found
    name, nice = found[threading.get_native_id()]
    assert nice == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@linux_only
def test_xla_threads_inherit_the_lower_priority():
    """In a fresh process: backend started low, then a worker compiles and runs; every
    thread created from then on (XLA's pools, its compile threads, LLVM's) runs
    lowered, and the main thread (the event loop's) does not."""
    script = textwrap.dedent(
        """
        import json, os, threading
        import jax, jax.numpy as jnp
        from dxserve.core import threads
        before = set(threads.thread_priorities())
        assert threads.start_backend_at_low_priority(7, start=jax.devices)
        ran = []
        def work():
            assert threads.lower_priority_of_current_thread(7)
            f = jax.jit(lambda x: jnp.sin(x) @ jnp.cumsum(x, axis=0))
            ran.append(float(f(jnp.ones((256, 256))).sum()))
        t = threading.Thread(target=work); t.start(); t.join()
        assert ran, "the worker failed"
        now = threads.thread_priorities()
        print(json.dumps({
            "main": now[threading.get_native_id()][1],
            "new": [v for k, v in now.items() if k not in before],
        }))
        """
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    assert found["main"] == base
    assert found["new"], "XLA started no threads?"
    assert {tuple(t) for t in found["new"] if t[1] != min(19, base + 7)} == set()
    assert any(name.startswith("tf_XLA") for name, _ in found["new"])


def test_compute_nice_setting(monkeypatch):
    assert Settings().compute_nice == threads.DEFAULT_STEPS
    monkeypatch.setenv("DXSERVE_COMPUTE_NICE", "0")
    assert Settings().compute_nice == 0
    monkeypatch.setenv("DXSERVE_COMPUTE_NICE", "20")
    with pytest.raises(ValueError):
        Settings()


def test_switch_interval_setting(monkeypatch, tmp_path):
    from dxserve.http import create_app
    from dxserve.server.runtime import bootstrap

    assert Settings().switch_interval == 0.001
    monkeypatch.setenv("DXSERVE_SWITCH_INTERVAL", "0")
    with pytest.raises(ValueError):
        Settings()
    monkeypatch.delenv("DXSERVE_SWITCH_INTERVAL")
    before = sys.getswitchinterval()
    settings = Settings(
        store=tmp_path / "s", compilation_cache="", switch_interval=0.002, warm_up=False
    )
    try:
        app = create_app(settings)  # building the app changes nothing process-wide
        assert sys.getswitchinterval() == before
        app.state.service.close()
        bootstrap(settings)  # the server's start-up does
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        sys.setswitchinterval(before)
