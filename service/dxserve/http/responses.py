"""Responses for operator results: small ones ready-made, large ones in parts.

``BodyResponse`` is a complete small body whose headers are all known, so it skips
Starlette's header assembly (a dict walk and charset rules) that every small answer paid.

``PartsResponse`` is written as consecutive parts, never joined into one ``bytes``.

Large binary results are sent this way: the header, then each array's own memory
(a byte memoryview) straight to the socket. Joining them first would copy the whole
body while holding the GIL (``bytes.join`` keeps it for memoryviews), and for an
18 MB Jacobian that kept the event loop from answering anyone for ~20 ms.

The parts are bytes-like objects rather than the ``bytes`` the ASGI spec names; uvicorn
(the server ``dxserve serve`` runs) and Starlette's test client take them as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from starlette.responses import Response


class PartsResponse(Response):
    #: called once the body has been sent (or sending failed): releases what it held
    on_sent: Callable[[], None] | None = None

    def __init__(
        self,
        parts: Iterable[Any],
        status_code: int = 200,
        headers: Mapping[str, str] | None = None,
        media_type: str | None = None,
    ) -> None:
        """``headers``, then the parts' Content-Length, then ``media_type`` as the
        Content-Type unless ``headers`` has one (no charset added): Starlette's header
        assembly, not run."""
        views = [p if isinstance(p, bytes) else _byte_view(p) for p in parts]
        self.parts = [p for p in views if len(p)]
        self.status_code = status_code
        self.media_type = media_type
        self.background = None
        self.body = b""
        raw_headers = [
            (k.lower().encode("latin-1"), v.encode("latin-1"))
            for k, v in (headers or {}).items()
            if k.lower() != "content-length"
        ]
        raw_headers.append((b"content-length", str(sum(len(p) for p in self.parts)).encode()))
        if media_type is not None and all(k != b"content-type" for k, _ in raw_headers):
            raw_headers.append((b"content-type", media_type.encode("latin-1")))
        self.raw_headers = raw_headers

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self._send(scope, send)
        finally:
            self.parts = []
            if self.on_sent is not None:
                self.on_sent()
                self.on_sent = None
        if self.background is not None:
            await self.background()

    async def _send(self, scope: Any, send: Any) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        if scope.get("method") == "HEAD" or not self.parts:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            last = len(self.parts) - 1
            for i, part in enumerate(self.parts):
                await send({"type": "http.response.body", "body": part, "more_body": i < last})


def _byte_view(part: Any) -> memoryview:
    view = memoryview(part)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class BodyResponse(Response):
    def __init__(
        self, body: bytes, status_code: int, media_type: str, headers: Mapping[str, str]
    ) -> None:
        self.body = body
        self.status_code = status_code
        self.media_type = media_type
        self.background = None
        self.raw_headers = [
            (b"content-length", str(len(body)).encode()),
            (b"content-type", media_type.encode("latin-1")),
            *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()),
        ]
