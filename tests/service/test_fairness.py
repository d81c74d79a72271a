"""Fairness: a small request is answered between the chunks of a long one (``worker``).

A real server over real sockets runs a dense Hessian in chunks (``heavy_sines`` at
n = 2000: 10 chunks of 200 columns, each a few hundred million flops) and streams its
progress. Small ``/gradient`` requests sent while it runs are answered before it
ends: after the last gradient comes back, the Hessian's stream still reports chunks
being done. Every value is checked; ``/health``
answers throughout.
"""

from __future__ import annotations

import json
import threading

import httpx
import numpy as np
import pytest

from tests.service.test_compile_off_worker import HealthWatch, wait_until
from tests.slow_functions import heavy_sines_hessian

N = 2000


@pytest.mark.slow
def test_small_gradient_answers_between_the_chunks_of_a_long_hessian(make_server) -> None:
    srv = make_server(modules=("dxserve.examples", "tests.slow_functions"))
    x = np.linspace(-1.0, 1.0, N)
    warm = {"function": "rosenbrock", "backend": "jax-reverse", "x": [1.0, 2.0, 3.0]}
    http = httpx.Client(base_url=srv.url, timeout=300)
    assert http.post("/gradient", json=warm).json() == {"gradient": [-400.0, 1002.0, -200.0]}
    health = HealthWatch(srv.url)

    events: list[tuple[str, object]] = []  # in arrival order, from both threads
    lock = threading.Lock()

    def hessian() -> None:
        with httpx.stream(
            "POST", srv.url + "/hessian",
            json={"function": "heavy_sines", "backend": "jax-forward", "x": x.tolist()},
            headers={"accept": "text/event-stream; arrays=b64"}, timeout=600,
        ) as r:
            name = None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    with lock:
                        events.append((name, json.loads(line[6:])))

    stream = threading.Thread(target=hessian)
    stream.start()
    # once it has run a chunk, ask for small gradients while it goes on
    wait_until(lambda: any(n == "progress" and d["done"] > 0 for n, d in list(events)))
    for _ in range(3):
        r = http.post("/gradient", json=warm)
        assert r.json() == {"gradient": [-400.0, 1002.0, -200.0]}
        with lock:
            events.append(("gradient", None))
    stream.join(600)
    health.stop()

    names = [n for n, _ in events]
    assert names[-1] == "result" and names.count("gradient") == 3
    dones = [d["done"] for n, d in events if n == "progress"]
    assert dones[-1] == N and len(set(dones)) >= 10
    # the Hessian was still running when the last gradient came back: at least two
    # more of its chunks were computed afterwards (reported done, short of the total)
    last_gradient = max(i for i, n in enumerate(names) if n == "gradient")
    later = {d["done"] for n, d in events[last_gradient:] if n == "progress"}
    assert len(later - {N}) >= 2, names

    from dxcontract import codec

    h = np.asarray(codec.decode_result(events[-1][1]["hessian"], "hessian"))
    np.testing.assert_allclose(h, heavy_sines_hessian(x), rtol=1e-9, atol=1e-9)
    http.close()
