"""Test clients wait as long as the server may take: a slow answer on a loaded machine
is not a failure (httpx's own default, 5 s, made one)."""

from __future__ import annotations

import asyncio

import httpx

from dxserve.settings import Settings
from tests.conftest import HTTP_TIMEOUT


def test_default_http_timeouts_are_the_servers_deadline() -> None:
    deadline = Settings().request_timeout
    assert HTTP_TIMEOUT.read is not None and HTTP_TIMEOUT.read >= deadline
    with httpx.Client() as client:
        assert client.timeout == HTTP_TIMEOUT

    async def main() -> httpx.Timeout:
        async with httpx.AsyncClient() as client:
            return client.timeout

    assert asyncio.run(main()) == HTTP_TIMEOUT
    for fn in (httpx.get, httpx.post, httpx.delete, httpx.request, httpx.stream):
        assert getattr(fn, "__wrapped__", fn).__kwdefaults__["timeout"] == HTTP_TIMEOUT, fn
