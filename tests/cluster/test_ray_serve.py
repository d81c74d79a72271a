"""dxserve on a real local Ray cluster (``make test-cluster``): two replicas of
``dxserve.ray_serve`` behind Ray Serve's HTTP proxy, their registry in one shared
SQLite store.

* the service's own checks (gradient, hvp, jacobian, registration, errors) answer
  through the proxy exactly as a single ``dxserve serve`` process answers them;
* a function registered through the proxy is served by both replicas (asked through
  the ``DeploymentHandle`` until both have answered);
* SIGKILL of one replica during a steady load of client calls loses no call: with the
  client's retries every call returns the right gradient.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import free_port, start_server, stop_server

pytestmark = [
    pytest.mark.cluster,
    # Ray's own config models use pydantic v1-style Field extras
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning"),
]

if os.environ.get("DXSERVE_REQUIRE_RAY"):  # make test-cluster: a missing ray is a failure
    import ray
else:
    ray = pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")

X = [1.0, 2.0, 3.0]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """A local Ray with dxserve on 2 replicas: ``(url, handle)``."""
    from ray import serve

    from dxserve import ray_serve

    store = tmp_path_factory.mktemp("ray-store")
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}})
    try:
        handle = ray_serve.start(
            port=port, replicas=2, num_cpus=0,
            settings={"store": str(store), "compilation_cache": "", "warm_up": False,
                      "functions": ["dxserve.examples"], "store_sync_interval": 0.25},
        )
        yield f"http://127.0.0.1:{port}", handle
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(tmp_path_factory.mktemp("ray-single"), modules=("dxserve.examples",),
                       env={"DXSERVE_WARM_UP": "false"})
    yield srv.url
    stop_server(srv)


CHECKS = [
    ("POST", "/functions", {"name": "cube", "expression": "jnp.sum(x ** 3)"}),
    ("POST", "/functions", {"name": "cube", "expression": "jnp.sum(x ** 4)"}),  # 409
    ("GET", "/functions/cube", None),
    ("POST", "/gradient", {"function": "cube", "x": X}),
    ("POST", "/gradient", {"function": "rosenbrock", "x": X}),
    ("POST", "/hvp", {"function": "rosenbrock", "x": X, "tangents": [[1.0, 0.0, 0.0]]}),
    ("POST", "/jacobian", {"function": "sin_cumsum", "x": X}),
    ("POST", "/hessian", {"function": "cube", "x": X}),
    ("POST", "/gradient", {"function": "nope", "x": X}),  # 404
    ("POST", "/gradient", {"function": "sin_cumsum", "x": X}),  # 422 not scalar
    ("POST", "/hvp", {"function": "cube", "x": X}),  # 422 no tangents
    ("POST", "/gradient", {"function": "cube", "x": "not an array"}),  # 400/422
    ("DELETE", "/functions/cube", None),
    ("POST", "/gradient", {"function": "cube", "x": X}),  # 404 after deletion
]


def _answer(url: str, method: str, path: str, body: dict | None) -> tuple:
    r = httpx.request(method, url + path, json=body)
    doc = r.json() if r.content else None
    if isinstance(doc, dict):
        doc.pop("created", None)  # the time of registration: its own per store
        doc.pop("instance", None)
    return r.status_code, r.headers.get("content-type"), doc


def test_ray_answers_like_one_process(cluster, single) -> None:
    url, _ = cluster
    for method, path, body in CHECKS:
        expected = _answer(single, method, path, body)
        got = _answer(url, method, path, body)
        assert got == expected, (method, path, body)
        if path == "/functions/cube" and method == "DELETE":
            time.sleep(0.3)  # the other replica's bound (store_sync_interval 0.25)
    grad = _answer(url, "POST", "/gradient", {"function": "rosenbrock", "x": X})[2]["gradient"]
    x = np.array(X)
    want = np.zeros(3)
    want[:-1] += -400 * x[:-1] * (x[1:] - x[:-1] ** 2) - 2 * (1 - x[:-1])
    want[1:] += 200 * (x[1:] - x[:-1] ** 2)
    np.testing.assert_allclose(grad, want, rtol=1e-12)


def _pids_with(handle, name: str, want: int = 2, tries: int = 200) -> dict[int, bool]:
    """Ask through the handle until ``want`` replicas answered: pid -> knows ``name``."""
    seen: dict[int, bool] = {}
    for _ in range(tries):
        pid, has = handle.knows.remote(name).result(timeout_s=60)
        seen[pid] = has
        if len(seen) >= want:
            break
    return seen


def test_registration_through_the_proxy_is_served_by_both_replicas(cluster) -> None:
    url, handle = cluster
    r = httpx.post(url + "/functions", json={"name": "quad", "expression": "jnp.sum(x ** 4)"})
    assert r.status_code == 201, r.text
    seen = _pids_with(handle, "quad")
    assert len(seen) == 2 and all(seen.values()), seen
    for _ in range(10):  # and computed by whichever replica the proxy picks
        r = httpx.post(url + "/gradient", json={"function": "quad", "x": X})
        np.testing.assert_allclose(r.json()["gradient"], 4 * np.array(X) ** 3, rtol=1e-12)
    answer = handle.call.remote("gradient", "quad", "auto", X).result(timeout_s=60)
    np.testing.assert_allclose(answer["gradient"], 4 * np.array(X) ** 3, rtol=1e-12)


def test_killing_a_replica_under_load_loses_no_call(cluster) -> None:
    from dxclient import Client

    url, handle = cluster
    httpx.post(url + "/functions", json={"name": "sq2", "expression": "jnp.sum(x ** 2)"})
    pids = set(_pids_with(handle, "sq2"))
    assert len(pids) == 2
    results: list[bool] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def load(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with Client(url, retries=8, backoff=0.2, encoding="json") as client:
            while not stop.is_set():
                x = rng.normal(size=3)
                try:
                    g = client.gradient("sq2", "auto", x)
                except BaseException as exc:  # every failure is recorded, none hidden
                    errors.append(exc)
                    continue
                results.append(bool(np.allclose(g, 2 * x, rtol=1e-12)))

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    before = len(results)
    os.kill(sorted(pids)[0], signal.SIGKILL)
    time.sleep(8.0)  # load continues while Ray notices and replaces the replica
    stop.set()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[:3]
    assert len(results) > before > 0 and all(results)
