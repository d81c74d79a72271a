"""Test clients wait as long as the server may take: a slow answer on a loaded machine
is not a failure (httpx's own default, 5 s, made one)."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import httpx

from dxclient import AsyncClient, Client
from dxserve.settings import Settings
from tests.conftest import HTTP_TIMEOUT, LIVENESS_TIMEOUT, REQUEST_DEADLINE

TESTS = Path(__file__).resolve().parents[1]
#: The calls that make an HTTP client or send a request.
_HTTPX = {
    "get",
    "post",
    "put",
    "patch",
    "delete",
    "head",
    "options",
    "request",
    "stream",
    "Client",
    "AsyncClient",
}
#: Tests about timeouts themselves: they give short ones on purpose.
_ABOUT_TIMEOUTS = {"client/test_async_transport.py", "client/test_client_twins.py"}


def test_default_http_timeouts_are_the_servers_deadline() -> None:
    deadline = Settings().request_timeout
    assert REQUEST_DEADLINE >= deadline
    assert HTTP_TIMEOUT.read is not None and HTTP_TIMEOUT.read >= deadline
    with httpx.Client() as client:
        assert client.timeout == HTTP_TIMEOUT

    async def main() -> httpx.Timeout:
        async with httpx.AsyncClient() as client:
            return client.timeout

    assert asyncio.run(main()) == HTTP_TIMEOUT
    for fn in (httpx.get, httpx.post, httpx.delete, httpx.request, httpx.stream):
        assert getattr(fn, "__wrapped__", fn).__kwdefaults__["timeout"] == HTTP_TIMEOUT, fn
    with Client("http://127.0.0.1:9") as client:
        assert client.http.timeout.read >= deadline
    assert AsyncClient.__init__.__kwdefaults__["timeout"] >= deadline


def _short_timeouts(path: Path) -> list[str]:
    """``timeout=<number>`` under the server's deadline given to an httpx or dxclient
    call (``httpx.post(...)``, ``httpx.Client(...)``, ``Client(...)``) in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        http = (
            isinstance(f, ast.Attribute)
            and isinstance(f.value, ast.Name)
            and f.value.id == "httpx"
            and f.attr in _HTTPX
        )
        if not (http or isinstance(f, ast.Name) and f.id in ("Client", "AsyncClient")):
            continue
        for kw in node.keywords:
            value = kw.value
            if (
                kw.arg == "timeout"
                and isinstance(value, ast.Constant)
                and isinstance(value.value, (int, float))
                and value.value < REQUEST_DEADLINE
            ):
                found.append(f"{path.relative_to(TESTS)}:{node.lineno} timeout={value.value}")
    return found


def test_no_test_client_gives_a_timeout_shorter_than_the_servers_deadline() -> None:
    short = [
        hit
        for path in sorted(TESTS.rglob("test_*.py"))
        if path.relative_to(TESTS).as_posix() not in _ABOUT_TIMEOUTS
        for hit in _short_timeouts(path)
    ]
    assert short == [], "\n".join(short)
    assert LIVENESS_TIMEOUT >= 30  # a probe's answer may wait behind a loaded machine
