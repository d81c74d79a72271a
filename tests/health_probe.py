"""``/health`` probed while a test attacks a server.

Not a test module. A probe that does not answer 200 within ``LIVENESS_TIMEOUT`` (generous:
a loaded machine answers slowly, a blocked server not at all) is counted as a
miss (its status or exception kept in ``failed``); tests assert there were none, never
how long an answer took. On a quiet machine, ``DXSERVE_TEST_HEALTH_TIMEOUT=1`` holds the
same tests to the one-second bar (``bench/soak.py`` reports it under load).
"""

from __future__ import annotations

import os
import threading

import httpx

from tests.conftest import LIVENESS_TIMEOUT

#: seconds a probe may take to be answered
TIMEOUT = float(os.environ.get("DXSERVE_TEST_HEALTH_TIMEOUT", LIVENESS_TIMEOUT))
#: seconds between probes
INTERVAL = 0.2


class HealthProbe:
    """Probes ``url + "/health"`` from a thread until stopped; ``ok`` counts the answers,
    ``failed`` lists what did not answer (a status, or the exception's repr).

    Use as a context manager (stopped on exit) or call ``stop()``; stop it before the
    server it probes is stopped.
    """

    def __init__(self, url: str) -> None:
        self.url, self.ok, self.failed = url, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=TIMEOUT) as http:
            while True:  # one probe at once, so even a short test has one
                try:
                    r = http.get(self.url + "/health")
                    if r.status_code == 200:
                        self.ok += 1
                    else:
                        self.failed.append(r.status_code)
                except httpx.HTTPError as e:
                    self.failed.append(repr(e))
                if self._stop.wait(INTERVAL):
                    return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def __enter__(self) -> HealthProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def check(self) -> None:
        """Stop, then fail the test unless every probe was answered (and one was made)."""
        self.stop()
        assert self.ok > 0 and not self.failed, f"/health missed: {self.failed[:5]}"
