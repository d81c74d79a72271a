"""One caller's flood of new shapes fills its own share of the compile queue, not everyone's.

A client at 127.0.0.1 posts 30 first gradients on distinct shapes at once; past
``DXSERVE_COMPILE_QUEUE_PER_CALLER`` (4 here) its calls get 429 ``too-many-queued``
naming the setting, while a second client (127.0.0.2, a different caller) gets its own
first gradient compiled and answered, checked against the analytic Rosenbrock gradient.
``/health`` answers probes throughout.
"""

from __future__ import annotations

import threading

import httpx
import numpy as np

from tests.conftest import start_server, stop_server
from tests.health_probe import HealthProbe
from tests.references import rosenbrock_gradient

FLOOD = 30


def test_a_flood_of_shapes_from_one_caller_leaves_room_for_another(tmp_path) -> None:
    env = {"DXSERVE_COMPILE_QUEUE_PER_CALLER": "4", "DXSERVE_COMPILE_QUEUE": "16"}
    srv = start_server(tmp_path / "fair", env=env, modules=("dxserve.examples",))
    probe = HealthProbe(srv.url)
    answers: list = []
    lock = threading.Lock()

    def flood_one(n: int) -> None:
        x = np.linspace(-1.0, 1.0, n).tolist()
        try:
            r = httpx.post(
                srv.url + "/gradient", json={"function": "rosenbrock", "x": x}, timeout=300
            )
            got = (r.status_code, r.json().get("limit"))
        except httpx.HTTPError as e:
            got = (repr(e), None)
        with lock:
            answers.append(got)

    try:
        threads = [
            threading.Thread(target=flood_one, args=(100 + n,), daemon=True) for n in range(FLOOD)
        ]
        for t in threads:
            t.start()
        with httpx.Client() as http:  # the flood holds its share of the queue
            for _ in range(3000):
                if http.get(srv.url + "/ready").json()["compiling"] >= 4:
                    break
                threading.Event().wait(0.02)
        # another caller: its own address, its own share
        other = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(transport=other, timeout=300) as http:
            x = np.linspace(-2.0, 2.0, 9)
            r = http.post(srv.url + "/gradient", json={"function": "rosenbrock", "x": x.tolist()})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["gradient"], rosenbrock_gradient(x), rtol=1e-10)
        for t in threads:
            t.join(300)
        statuses = sorted(a[0] for a in answers)
        assert len(answers) == FLOOD and set(statuses) <= {200, 429}, answers
        assert 429 in statuses, answers
        assert {a[1] for a in answers if a[0] == 429} == {"compile_queue_per_caller"}, answers
    finally:
        probe.stop()
        stop_server(srv)
    assert probe.ok > 0 and not probe.failed, probe.failed


def test_the_compile_share_counts_what_waits_or_runs_and_is_given_back() -> None:
    import asyncio

    import pytest

    from dxcontract.errors import TooManyQueuedError
    from dxserve.server.compiling import Compiler

    compiler = Compiler(threads=1, queue_size=8, per_caller=2)
    gate = threading.Event()

    async def main() -> None:
        run = compiler.run
        first = asyncio.ensure_future(run("k1", lambda: gate.wait(60) and 1, 60, caller="a"))
        second = asyncio.ensure_future(run("k2", lambda: 2, 60, caller="a"))
        await asyncio.sleep(0)
        with pytest.raises(TooManyQueuedError) as refused:
            await run("k3", lambda: 3, 60, caller="a")
        assert refused.value.extra["limit"] == "compile_queue_per_caller"
        joined = asyncio.ensure_future(run("k2", lambda: 99, 60, caller="a"))  # shares k2
        other = asyncio.ensure_future(run("k4", lambda: 4, 60, caller="b"))  # its own share
        await asyncio.sleep(0)
        gate.set()
        assert [await first, await second, await joined, await other] == [1, 2, 2, 4]
        assert await run("k5", lambda: 5, 60, caller="a") == 5  # its share was given back

    try:
        asyncio.run(main())
    finally:
        compiler.close()
    assert compiler._by_caller == {}
