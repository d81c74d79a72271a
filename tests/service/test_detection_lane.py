"""Sparsity detection waits in a lane of its own, never on a compile thread.

A dozen concurrent ``/sparsity`` calls on distinct shapes queue their detections in the
detector's lane (one child at a time); a victim's first ``/gradient`` on a new shape is
compiled meanwhile, and answers while detections are still waiting (checked by the
order in which answers arrive, not by a stopwatch). A caller with more detections
waiting than ``DXSERVE_SPARSE_DETECTION_PER_CALLER`` gets 429 naming the limit, and
``/health`` answers probes throughout.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from tests import sparse_functions as sf
from tests.conftest import ServerProcess, start_server, stop_server
from tests.health_probe import HealthProbe
from tests.references import rosenbrock_gradient

FLOOD = 12


def _serve(tmp_path_factory, name: str, per_caller: int) -> ServerProcess:
    env = {"DXSERVE_SPARSE_DETECTION_PER_CALLER": str(per_caller)}
    return start_server(
        tmp_path_factory.mktemp(name), env=env,
        modules=("dxserve.examples", "tests.sparse_functions"),
    )  # fmt: skip


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = _serve(tmp_path_factory, "detection-lane", 2 * FLOOD)
    try:
        yield server
    finally:
        stop_server(server)


def _flood(url: str, sizes: list[int], done: list, lock: threading.Lock) -> list[threading.Thread]:
    def one(n: int) -> None:
        x = sf.example_x(n).tolist()
        try:
            r = httpx.post(
                url + "/sparsity",
                timeout=300,
                json={"function": "sp_tridiagonal", "backend": "sparse", "x": x},
            )
            status, limit = r.status_code, r.json().get("limit")
        except httpx.HTTPError as e:
            status, limit = repr(e), None
        with lock:
            done.append(("sparsity", n, status, limit))

    threads = [threading.Thread(target=one, args=(n,), daemon=True) for n in sizes]
    for t in threads:
        t.start()
    return threads


def _wait_for(url: str, what, tries: int = 3000) -> dict:
    with httpx.Client() as http:
        for _ in range(tries):
            ready = http.get(url + "/ready").json()
            if what(ready):
                return ready
            threading.Event().wait(0.02)
    pytest.fail(f"never seen: {ready}")


def test_a_victims_first_gradient_does_not_wait_for_queued_detections(srv: ServerProcess) -> None:
    probe = HealthProbe(srv.url)
    done: list = []
    lock = threading.Lock()
    try:
        flood = _flood(srv.url, [2000 + 37 * i for i in range(FLOOD)], done, lock)
        # the detections are queued in their lane (one runs, the others wait there)
        _wait_for(srv.url, lambda r: r["detecting"] >= 3)
        x = np.linspace(-1.0, 1.5, 7)  # a shape nobody compiled: a compile thread is needed
        r = httpx.post(
            srv.url + "/gradient", json={"function": "rosenbrock", "x": x.tolist()}, timeout=300
        )
        with lock:
            done.append(("victim", 7, r.status_code))
            finished_before = sum(1 for d in done if d[0] == "sparsity")
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["gradient"], rosenbrock_gradient(x), rtol=1e-10)
        assert finished_before < FLOOD, done  # detections were still waiting when it answered
        for t in flood:
            t.join(300)
        statuses = [d[2] for d in done if d[0] == "sparsity"]
        assert statuses == [200] * FLOOD, statuses
    finally:
        probe.stop()
    assert probe.ok > 0 and not probe.failed, probe.failed


def test_a_caller_past_its_detection_cap_gets_429(tmp_path_factory) -> None:
    server = _serve(tmp_path_factory, "detection-cap", 2)
    done: list = []
    lock = threading.Lock()
    probe = HealthProbe(server.url)
    try:
        flood = _flood(server.url, [1500 + 41 * i for i in range(6)], done, lock)
        for t in flood:
            t.join(300)
        statuses = sorted(d[2] for d in done)
        assert 429 in statuses and 200 in statuses, statuses
        assert set(statuses) <= {200, 429}, statuses
        assert {d[3] for d in done if d[2] == 429} == {"sparse_detection_per_caller"}, done
        r = httpx.post(
            server.url + "/sparsity",
            timeout=300,
            json={
                "function": "sp_tridiagonal",
                "backend": "sparse",
                "x": sf.example_x(1500).tolist(),
            },
        )
        assert r.status_code == 200, r.text  # the cap counts what waits, not what was done
        probe.check()
    finally:
        probe.stop()
        stop_server(server)
