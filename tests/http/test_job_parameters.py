"""Every job id, cursor and page parameter is validated: a 4xx problem document, never
a 5xx, whatever the value, with a SQLite and with a directory store (real servers).
``/health`` answers 1 s probes throughout."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ServerProcess, start_server, stop_server
from tests.health_probe import HealthProbe

PROBLEM = "application/problem+json"


@pytest.fixture(scope="module", params=["sqlite", "dir"])
def store_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    work = tmp_path_factory.mktemp(f"params-{request.param}")
    args = ("--store", f"dir://{work / 'dirstore'}") if request.param == "dir" else ()
    srv = start_server(
        work,
        env={"DXSERVE_WARM_UP": "false", "DXSERVE_JOB_RUNNERS": "1"},
        args=args,
        modules=("dxserve.examples",),
    )
    try:
        with httpx.Client(base_url=srv.url) as http:  # one job, so pages exist
            r = http.post("/jobs/gradient", json={"function": "rosenbrock", "x": [1.0, 2.0]})
            assert r.status_code == 202, r.text
        probe = HealthProbe(srv.url)  # through every test of the module: none unanswered
        try:
            yield srv
        finally:
            probe.stop()
        probe.check()
    finally:
        stop_server(srv)


def _cursor(value: Any) -> str:
    raw = json.dumps(value).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _cursor_raw(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _get(http: httpx.Client, params: dict[str, Any]) -> httpx.Response:
    """``GET /jobs`` with ``params`` percent-encoded as sent raw (lone surrogates as
    their UTF-8-style bytes, as a hostile client may send them)."""
    query = "&".join(
        f"{k}={quote(str(v).encode('utf-8', 'surrogatepass'), safe='')}" for k, v in params.items()
    )
    return http.get(f"/jobs?{query}")


def _check(http: httpx.Client, params: dict[str, Any]) -> None:
    r = _get(http, params)
    assert r.status_code < 500, (params, r.status_code, r.text)
    if r.status_code != 200:
        assert 400 <= r.status_code < 500 and r.headers["content-type"] == PROBLEM, r.text
        assert r.json()["field"] in ("after", "limit", "query.after", "query.limit"), r.text


#: cursors that reached the store before: an overflowing created, a lone surrogate id,
#: infinities, NaN, booleans, wrong shapes
HOSTILE = [
    _cursor_raw(b"[" + b"9" * 320 + b', "abcdefgh"]'),
    _cursor_raw(b'[1e400, "abcdefgh"]'),
    _cursor_raw(b'[-1e400, "abcdefgh"]'),
    _cursor_raw(b'[NaN, "abcdefgh"]'),
    _cursor_raw(b'[1.5, "\\ud800abcdefgh"]'),
    _cursor_raw(b'[1.5, "\\udfffxyzxyzxy"]'),
    _cursor_raw(b'[true, "abcdefgh"]'),
    _cursor_raw(b'[1.5, "a"]'),
    _cursor_raw(b'[1.5, "' + b"a" * 300 + b'"]'),
    _cursor_raw(b'{"a": 1, "b": 2}'),
    _cursor_raw(b'[1.5, "abcdefgh", 3]'),
    _cursor_raw(b"\xff\xfe"),
    _cursor_raw(
        b"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]"
    ),
    "\udcff",
    "\ud800\udc00",
    "====",
    "a" * 600,
    "-_-_",
    "",
]


def test_hostile_cursors_are_4xx_problems(store_server: ServerProcess) -> None:
    with httpx.Client(base_url=store_server.url) as http:
        for after in HOSTILE:
            r = _get(http, {"after": after})
            if after == "":  # no cursor: the first page
                assert r.status_code == 200, r.text
                continue
            assert r.status_code == 422, (after[:60], r.status_code, r.text)
            assert r.headers["content-type"] == PROBLEM
        # a well-formed cursor still pages
        ok = http.get("/jobs", params={"after": _cursor([1e12, "abcdefgh"])})
        assert ok.status_code == 200 and len(ok.json()["jobs"]) == 1, ok.text


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=6,
)


_CURSOR_PARTS = dict(
    created=st.one_of(
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.booleans(),
        st.text(max_size=10),
        st.none(),
    ),
    job_id=st.one_of(st.text(max_size=70), st.integers(), st.none()),
    extra=st.one_of(st.just([]), st.lists(_json_values, max_size=2)),
    junk=st.one_of(st.none(), st.text(max_size=80), st.binary(max_size=60)),
    limit=st.one_of(st.none(), st.integers(-5, 200), st.text(max_size=6)),
)


def _fuzz_cursor(
    store_server: ServerProcess, created: Any, job_id: Any, extra: list, junk: Any, limit: Any
) -> None:
    if junk is None:
        raw = json.dumps([created, job_id, *extra], allow_nan=True).encode("utf-8", "surrogatepass")
        after = _cursor_raw(raw)
    elif isinstance(junk, bytes):
        after = _cursor_raw(junk)
    else:
        after = junk
    params: dict[str, Any] = {"after": after}
    if limit is not None:
        params["limit"] = limit
    with httpx.Client(base_url=store_server.url) as http:
        _check(http, params)


_HEALTH = [HealthCheck.function_scoped_fixture]


# make test: a few derandomized cursors; make test-slow: many random ones
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=_HEALTH)
@given(**_CURSOR_PARTS)
def test_fuzzed_cursors_and_limits_never_5xx(
    store_server: ServerProcess, created: Any, job_id: Any, extra: list, junk: Any, limit: Any
) -> None:
    _fuzz_cursor(store_server, created, job_id, extra, junk, limit)


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=_HEALTH)
@given(**_CURSOR_PARTS)
def test_fuzzed_cursors_and_limits_never_5xx_long(
    store_server: ServerProcess, created: Any, job_id: Any, extra: list, junk: Any, limit: Any
) -> None:
    _fuzz_cursor(store_server, created, job_id, extra, junk, limit)
