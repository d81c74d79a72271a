"""Job event streams cost the same for 1 or hundreds of watchers (a real server).

Hundreds of ``GET /jobs/{id}/events`` streams on one running job share one store read
per poll interval (``dxserve_job_stream_reads`` grows with the interval, not with the
streams), ``/health`` answers throughout (probes, no stopwatch), and the
caps per job and per owner answer 429 with ``Retry-After`` before a stream starts.
Memory: the server grows by less than ``RSS_GROWTH`` for all the streams.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from tests.conftest import LIVENESS_TIMEOUT, ServerProcess, memory_of, start_server, stop_server

PER_JOB, PER_OWNER = 300, 340
POLL = 0.2
RSS_GROWTH = 256 * 2**20
#: a Hessian job of many chunks: running for the whole test (cancelled at its end)
LONG = {
    "function": "heavy_sines",
    "backend": {"type": "jax-forward", "batch_size": 20},
    "x": np.linspace(0.1, 1.3, 3000).tolist(),
}


@pytest.fixture(scope="module")
def streams_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(
        tmp_path_factory.mktemp("streams"),
        env={
            "DXSERVE_WARM_UP": "false",
            "DXSERVE_JOB_RUNNERS": "1",
            "DXSERVE_JOB_POLL_INTERVAL": str(POLL),
            "DXSERVE_MAX_STREAMS_PER_JOB": str(PER_JOB),
            "DXSERVE_MAX_STREAMS_PER_OWNER": str(PER_OWNER),
        },
        modules=("dxserve.examples", "tests.slow_functions"),
    )
    try:
        yield srv
    finally:
        stop_server(srv)


def _metric(text: str, name: str) -> float:
    found = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert found, name
    return sum(float(v) for v in found)


def _open_stream(port: int, job_id: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(
        f"GET /jobs/{job_id}/events HTTP/1.1\r\nhost: x\r\n"
        "accept: text/event-stream\r\n\r\n".encode()
    )
    return s


def _status_of(s: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1])


def test_many_watchers_share_one_poll_and_the_caps_answer_429(
    streams_server: ServerProcess,
) -> None:
    srv = streams_server
    with httpx.Client(base_url=srv.url) as http:
        running = http.post("/jobs/hessian", json=LONG).json()["id"]
        queued = http.post("/jobs/hessian", json=LONG).json()["id"]  # behind it: one runner
    baseline = memory_of(srv.proc.pid)["VmRSS"]
    failures: list[str] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=srv.url, timeout=LIVENESS_TIMEOUT) as http:
            while not stop.is_set():
                try:
                    if http.get("/health").status_code != 200:
                        failures.append("/health not 200")
                except Exception as exc:  # noqa: BLE001 - a timeout or a dead server
                    failures.append(f"{type(exc).__name__}: {exc}")
                stop.wait(0.2)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    streams = []
    try:
        for _ in range(PER_JOB):
            streams.append(_open_stream(srv.port, running))
        for s in streams[:5]:
            assert _status_of(s) == 200
        with httpx.Client(base_url=srv.url) as http:
            deadline = time.monotonic() + 300
            while _metric(text := http.get("/metrics").text, "dxserve_job_streams") < PER_JOB:
                assert time.monotonic() < deadline, text[-1500:]
                time.sleep(0.1)
            assert _metric(text, "dxserve_job_streams_jobs") == 1
            reads_before = _metric(text, "dxserve_job_stream_reads_total")
            # one more on that job: the per-job cap
            extra = http.get(f"/jobs/{running}/events", headers={"accept": "text/event-stream"})
            assert extra.status_code == 429, extra.text
            assert extra.headers["content-type"] == "application/problem+json"
            assert int(extra.headers["retry-after"]) >= 1
            assert "DXSERVE_MAX_STREAMS_PER_JOB" in extra.json()["detail"]
            # the owner's cap, on another job
            for _ in range(PER_OWNER - PER_JOB):
                streams.append(_open_stream(srv.port, queued))
            deadline = time.monotonic() + 300
            while _metric(text := http.get("/metrics").text, "dxserve_job_streams") < PER_OWNER:
                assert time.monotonic() < deadline, text[-1500:]
                time.sleep(0.1)
            over = http.get(f"/jobs/{queued}/events", headers={"accept": "text/event-stream"})
            assert over.status_code == 429, over.text
            assert "DXSERVE_MAX_STREAMS_PER_OWNER" in over.json()["detail"]
            # the reads are per job (each interval, and each chunk the running job
            # reports), not per stream: one read per stream per interval would be
            # 340 / POLL a second
            stop.wait(2.0)
            reads = (
                _metric(http.get("/metrics").text, "dxserve_job_stream_reads_total") - reads_before
            )
            assert reads < PER_OWNER / 2, reads
            # and the jobs themselves go on: progress reached a stream
            got = streams[0].recv(65536)
            assert b"event: progress" in got or b": keep-alive" in got, got[-300:]
    finally:
        for s in streams:
            s.close()
        stop.set()
        prober.join(timeout=10)
        with httpx.Client(base_url=srv.url) as http:
            for job in (running, queued):
                http.delete(f"/jobs/{job}")
    assert failures == [], failures[:5]
    assert memory_of(srv.proc.pid)["VmHWM"] - baseline < RSS_GROWTH
    with httpx.Client(base_url=srv.url) as http:  # streams closed: freed
        deadline = time.monotonic() + 300
        while _metric(text := http.get("/metrics").text, "dxserve_job_streams") > 0:
            assert time.monotonic() < deadline, text[-1500:]
            time.sleep(0.1)
