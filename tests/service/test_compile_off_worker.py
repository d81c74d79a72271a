"""Compilation runs on compile threads, off the device workers (``compiling``).

A real server over real sockets. A legal request that compiles slowly (a gradient
whose x is a dict of 4,000 leaves, under ``DXSERVE_MAX_LEAVES``) is streamed with a
0.5 s deadline (``DXSERVE_STREAM_TIMEOUT``): while it compiles, warm gradients answer
correctly and the device worker holds nothing (``/ready``: ``compiling`` 1,
``queued`` 0); the slow request gets its 504 while its compilation still runs (its
deadline, not the compiler's end), and the executable is kept, so the same request
afterwards answers without compiling again. With one compile thread and a queue of
one, a third compilation is refused 503 + Retry-After. Identical first requests
compile once. ``/health`` answers throughout.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from tests.conftest import LIVENESS_TIMEOUT

SLOW_LEAVES = 4000  # with the two contexts, under the default DXSERVE_MAX_LEAVES (4096)
X = [[1.0, 2.0], [3.0, 4.0], [0.5, -1.0]]
Y = [[1.0], [2.0], [0.0]]
W, B = [[0.3], [-0.2]], [0.1]


def params(extra: int) -> dict:
    p: dict = {"w": W, "b": B}
    p.update({f"u{i}": [float(i)] for i in range(extra)})
    return p


def check_gradient(g: dict, extra: int) -> None:
    x, y = np.array(X), np.array(Y)
    residual = x @ np.array(W) + np.array(B) - y
    np.testing.assert_allclose(g["w"], x.T @ residual / 3, rtol=1e-12)
    np.testing.assert_allclose(g["b"], residual.sum(0) / 3, rtol=1e-12)
    assert len(g) == extra + 2 and all(g[f"u{i}"] == [0.0] for i in range(extra))


def slow_body(extra: int = SLOW_LEAVES) -> dict:
    return {"function": "least_squares", "x": params(extra), "contexts": [X, Y]}


def compiles(srv, what: str) -> int:
    return srv.log.read_text(errors="replace").count(f"compiled {what} ")


class HealthWatch:
    """Polls /health from a thread until stopped: every answer must be 200 ok."""

    def __init__(self, url: str) -> None:
        self.url, self.answers, self.failures = url, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=LIVENESS_TIMEOUT) as http:
            while not self._stop.wait(0.05):
                try:
                    r = http.get("/health")
                    assert r.json() == {"status": "ok"}
                    self.answers += 1
                except Exception as exc:  # noqa: BLE001 - reported by stop()
                    self.failures.append(repr(exc))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self.failures, self.failures
        assert self.answers > 0


def stream_outcome(url: str, body: dict, seen: dict) -> None:
    """Stream ``body``; on its final event, note it and what ``/ready`` says then."""
    with httpx.stream(
        "POST", url, json=body, headers={"accept": "text/event-stream"}, timeout=300
    ) as r:
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: ") and name in ("result", "error"):
                seen["ready"] = httpx.get(url.rsplit("/", 1)[0] + "/ready").json()
                seen[name] = json.loads(line[6:])
                return


def wait_until(predicate, attempts: int = 6000) -> None:
    stop = threading.Event()
    for _ in range(attempts):
        if predicate():
            return
        stop.wait(0.05)
    raise AssertionError("the condition never held")


def test_slow_compile_never_holds_the_device_worker(make_server) -> None:
    srv = make_server(env={
        "DXSERVE_STREAM_TIMEOUT": "0.5", "DXSERVE_COMPILE_THREADS": "1",
        "DXSERVE_COMPILE_QUEUE": "1",
    })
    http = httpx.Client(base_url=srv.url, timeout=300)
    warm = {"function": "rosenbrock", "backend": "jax-reverse", "x": [1.0, 2.0, 3.0]}
    assert http.post("/gradient", json=warm).json() == {"gradient": [-400.0, 1002.0, -200.0]}
    health = HealthWatch(srv.url)
    seen: dict = {}
    slow = threading.Thread(target=stream_outcome, args=(srv.url + "/gradient", slow_body(), seen))
    slow.start()
    wait_until(lambda: http.get("/ready").json()["compiling"] == 1)

    # while it compiles: warm gradients answer, and no device worker is held
    during = 0
    for _ in range(5):
        r = http.post("/gradient", json=warm)
        assert r.json() == {"gradient": [-400.0, 1002.0, -200.0]}
        ready = http.get("/ready").json()
        if ready["compiling"] == 1:
            during += 1
            assert ready["queued"] == 0
    assert during >= 1

    # a second compilation queues behind it; a third finds the queue full
    queued: dict = {}
    second = threading.Thread(
        target=lambda: queued.update(r=http.post("/gradient", json=slow_body(SLOW_LEAVES - 1)))
    )
    second.start()
    wait_until(lambda: http.get("/ready").json()["compiling"] == 2)
    with httpx.Client(base_url=srv.url, timeout=300) as other:
        full = other.post("/gradient", json=slow_body(SLOW_LEAVES - 2))
    assert full.status_code == 503, full.text
    assert full.headers["retry-after"] == "1" and full.json()["type"].endswith(":overloaded")

    # the slow request got its 504 at its deadline, while its compilation still ran
    slow.join(300)
    assert seen["error"]["status"] == 504, seen
    assert seen["error"]["type"].endswith(":deadline-exceeded")
    assert seen["ready"]["compiling"] >= 1

    second.join(600)
    check_gradient(queued["r"].json()["gradient"], SLOW_LEAVES - 1)
    # its executable was kept: the same request now answers without compiling again
    check_gradient(http.post("/gradient", json=slow_body()).json()["gradient"], SLOW_LEAVES)
    assert compiles(srv, "gradient of least_squares") == 2
    assert http.get("/ready").json()["compiling"] == 0
    health.stop()
    http.close()


def test_identical_first_requests_compile_once(make_server) -> None:
    srv = make_server()
    body = slow_body(300)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(
            lambda _: httpx.post(srv.url + "/gradient", json=body, timeout=300), range(4)
        ))
    for r in answers:
        check_gradient(r.json()["gradient"], 300)
    assert compiles(srv, "gradient of least_squares") == 1
