"""A client with no server behind its URL says so in one typed error: the address, how
many times it tried, and what to do (start the server)."""

from __future__ import annotations

import asyncio
import socket

import httpx
import numpy as np
import pytest

import dxclient
from dxclient.errors import DxError, ServerUnreachableError


def _closed_port() -> int:
    """A port nothing listens on (bound, then let go: connections are refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check(err: ServerUnreachableError, port: int, tries: int) -> None:
    text = str(err)
    assert f"http://127.0.0.1:{port}/gradient" in text, text
    retries = f"{tries - 1} retr{'y' if tries == 2 else 'ies'}"
    assert f"after {tries} tries ({retries})" in text, text
    assert "Is the server running?" in text and "`make serve`" in text, text
    assert err.url == f"http://127.0.0.1:{port}/gradient" and err.tries == tries
    # a DxError like the server's problems, and still what it was to httpx's users
    assert isinstance(err, DxError) and isinstance(err, httpx.ConnectError)
    assert isinstance(err, httpx.TransportError)


def test_client_against_a_closed_port() -> None:
    port = _closed_port()
    client = dxclient.Client(f"http://127.0.0.1:{port}", retries=2, backoff=0.01)
    with pytest.raises(ServerUnreachableError) as info:
        client.gradient("rosenbrock", np.array([1.0, 2.0, 3.0]))
    _check(info.value, port, tries=3)
    assert dxclient.errors.ServerUnreachableError is ServerUnreachableError


def test_async_client_against_a_closed_port() -> None:
    port = _closed_port()

    async def main() -> None:
        async with dxclient.AsyncClient(
            f"http://127.0.0.1:{port}", retries=1, backoff=0.01
        ) as client:
            await client.gradient("rosenbrock", np.array([1.0, 2.0, 3.0]))

    with pytest.raises(ServerUnreachableError) as info:
        asyncio.run(main())
    _check(info.value, port, tries=2)


def test_without_retries_one_try_is_said() -> None:
    port = _closed_port()
    client = dxclient.Client(f"http://127.0.0.1:{port}", retries=0)
    with pytest.raises(ServerUnreachableError, match=r"after 1 try \(0 retries\)"):
        client.gradient("rosenbrock", np.array([1.0, 2.0]))
