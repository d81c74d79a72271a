"""An uploaded loop that never ends never holds the server, and SIGTERM still stops it.

The upload's ``lax.while_loop`` runs on data: it exits at once on the export gate's
example input (0.5), so the gate passes it, and spins for ever on ``x[0] > 1``. By
default such uploads are refused (422 naming ``export``). With
``DXSERVE_EXPORT_UNBOUNDED_LOOPS=allow`` the spinning call is answered 504 at its
deadline, the worker thread running it is abandoned and replaced, 100 Rosenbrock
gradients are answered right afterwards, a second spin waits (503) while the first
holds its core (``DXSERVE_MAX_STUCK_COMPUTATIONS=1``), and SIGTERM ends the process,
also while a spin is still in flight. ``/health`` is probed all along with a 1 s timeout; every probe
must answer. (A spinning thread holds one core until the server exits.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from dxclient import Client
from dxclient.errors import DxError
from dxclient.export import ReverseModeWarning
from dxcontract.errors import DeadlineExceededError
from tests.conftest import start_server, stop_server
from tests.health_probe import HealthProbe
from tests.references import rosenbrock_gradient

#: uvicorn stops gracefully, then raises the signal it caught again: killed by SIGTERM
STOPPED = (0, -signal.SIGTERM)
EXIT_WAIT = 90.0  # seconds a SIGTERMed server may take before the test fails (bounded wait)


def spin(x):
    """Σ c, c = 1.5 c + 1 while c[0] > 1: never ends when x[0] > 1 (c grows to inf, and
    inf > 1). Its tangent depends on the loop too, so no derivative skips it."""
    return jnp.sum(lax.while_loop(lambda c: c[0] > 1.0, lambda c: 1.5 * c + 1.0, x))


def fori_static(x):
    """A loop with a static trip count (lowered to a while loop too): allowed."""
    return jnp.sum(lax.fori_loop(0, 5, lambda i, c: jnp.sin(c), x))


def register(client: Client, fn, name: str) -> None:
    with pytest.warns(ReverseModeWarning):
        client.register(fn, np.ones(3), name=name)


def wait_exit(proc: subprocess.Popen) -> int:
    """SIGTERM ``proc`` and wait (bounded) for it to exit; its exit status."""
    os.kill(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=EXIT_WAIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        pytest.fail(f"the server did not exit within {EXIT_WAIT} s of SIGTERM")


def test_unbounded_loops_are_refused_at_upload_by_default(tmp_path):
    srv = start_server(tmp_path / "refuse", modules=("dxserve.examples",))
    probe = HealthProbe(srv.url)
    try:
        with Client(srv.url) as client:
            with pytest.raises(DxError) as e:
                register(client, spin, "spin")
            assert e.value.status == 422
            assert e.value.problem.get("field") == "export"
            assert "DXSERVE_EXPORT_UNBOUNDED_LOOPS" in e.value.problem["detail"]
            # a loop of static trip count passes, and computes
            client.register(fori_static, np.ones(3), name="fori_static")
            x = np.array([0.3, 0.7, 1.1])
            got = client.gradient("fori_static", "auto", x)
            ref = np.ones(3)
            c = x
            for _ in range(5):
                ref, c = ref * np.cos(c), np.sin(c)
            np.testing.assert_allclose(got, ref, rtol=1e-10)
        probe.check()
    finally:
        probe.stop()
        stop_server(srv)


def test_a_spinning_upload_is_abandoned_and_the_server_goes_on(tmp_path):
    env = {
        "DXSERVE_EXPORT_UNBOUNDED_LOOPS": "allow",
        "DXSERVE_REQUEST_TIMEOUT": "4",
        "DXSERVE_MAX_STUCK_COMPUTATIONS": "1",
    }
    srv = start_server(tmp_path / "allow", env=env, modules=("dxserve.examples",))
    probe = HealthProbe(srv.url)
    try:
        with Client(srv.url) as client, httpx.Client(base_url=srv.url) as http:
            register(client, spin, "spin")
            # it exits at once on small inputs: warm, and cheap (it must still not run inline).
            # On a busy machine its compilation may outlast the 4 s limit: that 504 says
            # the compilation goes on and its executable is kept, so the next call finds it.
            warm = 0
            for _ in range(30):
                try:
                    got = client.gradient("spin", "auto", np.array([0.5, 0.2, 0.1]))
                except DeadlineExceededError:
                    continue
                assert got.shape == (3,)
                warm += 1
                if warm == 3:
                    break
            assert warm == 3
            r = http.post("/gradient", json={"function": "spin", "x": [2.0, 0.0, 0.0]})
            assert r.status_code == 504, r.text
            rng = np.random.default_rng(0)
            for _ in range(100):
                x = rng.normal(size=5)
                got = client.gradient("rosenbrock", "auto", x)
                np.testing.assert_allclose(got, rosenbrock_gradient(x), rtol=1e-10)
            assert http.get("/ready").json()["stuck"] == 1  # abandoned, still spinning
            # no second core for it: functions with unbounded loops wait for that one
            r = http.post("/gradient", json={"function": "spin", "x": [3.0, 0.0, 0.0]})
            assert r.status_code == 503 and "DXSERVE_MAX_STUCK_COMPUTATIONS" in r.text, r.text
        probe.stop()
        assert probe.ok > 0 and not probe.failed, probe.failed
        assert wait_exit(srv.proc) in STOPPED, srv.output()[-3000:]
    finally:
        probe.stop()
        stop_server(srv)


def test_sigterm_stops_the_server_with_a_spin_in_flight(tmp_path):
    env = {
        "DXSERVE_EXPORT_UNBOUNDED_LOOPS": "allow",
        "DXSERVE_REQUEST_TIMEOUT": "600",
        "DXSERVE_SHUTDOWN_TIMEOUT": "1",  # the spin never ends: no need to wait 10 s for it
    }
    srv = start_server(tmp_path / "sigterm", env=env, modules=("dxserve.examples",))
    try:
        with Client(srv.url) as client, httpx.Client(base_url=srv.url) as http:
            register(client, spin, "spin")
            client.gradient("spin", "auto", np.array([0.5, 0.2, 0.1]))  # compiled
            answers: list = []

            def call() -> None:
                try:
                    with httpx.Client(timeout=EXIT_WAIT) as h:
                        answers.append(
                            h.post(
                                srv.url + "/gradient",
                                json={"function": "spin", "x": [2.0, 0.0, 0.0]},
                            )
                        )
                except httpx.HTTPError as e:
                    answers.append(e)

            caller = threading.Thread(target=call, daemon=True)
            caller.start()
            deadline_probes = 0
            while http.get("/ready").json()["queued"] < 1:  # the spin is running
                deadline_probes += 1
                assert deadline_probes < 600 and caller.is_alive(), answers
                threading.Event().wait(0.1)
            assert wait_exit(srv.proc) in STOPPED, srv.output()[-3000:]
            caller.join(10)
    finally:
        stop_server(srv)
