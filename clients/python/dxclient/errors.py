"""``dxcontract.errors``, where dxclient's users found it: the contract package shared
with the server holds it now. Besides the server's problems, one error is the client's
own: ``ServerUnreachableError``, when no server answers at all."""

from __future__ import annotations

import httpx

from dxcontract.errors import *  # noqa: F403
from dxcontract.errors import DxError


class ServerUnreachableError(DxError, httpx.ConnectError):
    """No connection to the server could be made, after every retry: ``url`` is the
    address tried, ``tries`` how many times. Also an ``httpx.ConnectError`` (and so an
    ``httpx.TransportError``), as the failure was before this error had a type of its own."""

    slug = "server-unreachable"
    title = "Cannot reach the dxserve server"

    def __init__(self, url: str, tries: int, reason: str) -> None:
        retries = tries - 1
        super().__init__(
            f"no connection to {url} after {tries} {'try' if tries == 1 else 'tries'} "
            f"({retries} {'retry' if retries == 1 else 'retries'}): {reason}. Is the server "
            "running? Start it with `make serve` (or `dxserve serve`), or check the URL "
            "given to the client.",
            url=url,
            tries=tries,
        )
        self.url = url
        self.tries = tries
        self.retries = retries


#: The client's own errors: raised where no answer came, never sent by a server.
CLIENT_ONLY: tuple[type[DxError], ...] = (ServerUnreachableError,)
