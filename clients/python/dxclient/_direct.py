"""Operator calls straight to the client's fast transport, around httpx's objects.

A request that ``dxclient.transport`` takes itself (plain HTTP, a body of at least the
transport's ``min_bytes``) needs nothing more from httpx than the head httpx would
write and the timeouts it would apply. Building an ``httpx.Request`` (URL, headers,
stream), passing it through the client's auth, redirect, hook and cookie steps and
wrapping the answer in an ``httpx.Response`` is ~500 Python calls a request: ~60 us
here, a tenth of a whole gradient call at 10^5 values.

``DirectCalls`` sends such a call with a head httpx itself built once per path and
header set (the same bytes, with the body's length written in), through the
transport's own connection pool, and returns an ``Answer``. It does so only while
nothing httpx does per request could change the request or what becomes of the
answer: the httpx client is open, has no auth (nor credentials in its URL), no event
hooks, no query parameters, no cookies, and does not follow redirects. Otherwise, and
for every call the transport would hand to httpcore anyway, it returns None and the
call goes through httpx. An answer that sets a cookie or is content-encoded becomes
an ``httpx.Response`` after all, so its cookies are stored and its body decoded
exactly as httpx does; errors are httpx's, with their ``request`` set.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from dxcontract.lru import LRU

from ._models import Call, PartsCall
from .transport import (
    BODY_PARTS,
    AsyncFastTransport,
    FastTransport,
    Timeouts,
    _Head,
    _response,
    request_head,
    url_address,
)

#: heads kept per client: one per path and header set (a binary body's header length is
#: one of its headers, so a few per operator)
_TEMPLATES = 256
_UNKNOWN: Any = object()
# httpx logs each request at INFO under its own name; so do direct calls
_httpx_log = logging.getLogger("httpx")
#: answer headers that need httpx: cookies to store, a body to decode
_TO_HTTPX = (b"set-cookie", b"content-encoding")


class AnswerHeaders(dict):
    """An answer's headers by lower-case name, looked up in any case; a repeated
    header's values joined by ", " (what ``httpx.Headers`` gives for it)."""

    def get(self, name: str, default: Any = None) -> Any:
        return dict.get(self, name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return dict.__getitem__(self, name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and dict.__contains__(self, name.lower())


class Answer:
    """An answer read by a direct call: ``status_code``, ``headers``
    (``AnswerHeaders``) and ``content`` (bytes-like)."""

    __slots__ = ("content", "headers", "status_code")

    def __init__(self, status_code: int, headers: AnswerHeaders, content: Any) -> None:
        self.status_code, self.headers, self.content = status_code, headers, content


class _Template:
    """A call's head as httpx writes it, split where its Content-Length value goes."""

    __slots__ = ("before", "after", "close")

    def __init__(self, request: httpx.Request) -> None:
        head = request_head(request)
        name = b"\r\ncontent-length: "
        at = head.lower().index(name) + len(name)
        self.before = head[:at]
        self.after = head[head.index(b"\r\n", at):]
        self.close = request.headers.get("connection", "").lower() == "close"

    def head(self, size: int) -> bytes:
        return self.before + str(size).encode("ascii") + self.after


class DirectCalls:
    """Direct calls for ``http`` (an httpx client) whose transport is ``transport``."""

    def __init__(
        self, http: httpx.Client | httpx.AsyncClient, transport: FastTransport | AsyncFastTransport
    ) -> None:
        self.http = http
        self.transport = transport
        self._headers: list[tuple[bytes, bytes]] = []  # the client's headers the heads hold
        self._templates: LRU[tuple, _Template | None] = LRU(_TEMPLATES)

    def _prepared(self, call: Call, url: httpx.URL) -> tuple[bytes, tuple, bool] | None:
        """``(head, body parts, close)`` of ``call`` to ``url`` if it goes direct (``close``:
        the head says ``Connection: close``), else None."""
        if type(call) is PartsCall:
            size, body = call.size, call.parts
        else:
            size, body = len(call.body), (call.body,)
        http = self.http
        if (
            size < self.transport.min_bytes or url.scheme != "http" or http.is_closed
            or http.auth is not None or http.follow_redirects or http.params
            or any(http.event_hooks.values()) or len(http.cookies.jar)
        ):
            return None
        client_headers = http.headers.raw
        if client_headers != self._headers:  # changed (a new token, say): heads anew
            self._headers, self._templates = client_headers, LRU(_TEMPLATES)
        key = (call.method, url, type(call) is PartsCall, *call.headers.items())
        template = self._templates.get(key, _UNKNOWN)
        if template is _UNKNOWN:
            template = self._template(call, url)
            self._templates.put(key, template)
        if template is None:
            return None
        return template.head(size), body, template.close

    def _template(self, call: Call, url: httpx.URL) -> _Template | None:
        if url.userinfo:  # httpx sends these as basic auth
            return None
        request = self._request(call, url)
        if "content-length" not in request.headers:
            return None
        return _Template(request)

    def _request(self, call: Call, url: httpx.URL) -> httpx.Request:
        """The ``httpx.Request`` httpx would send for ``call`` (its body not read)."""
        if type(call) is PartsCall:
            return self.http.build_request(
                call.method, url, content=call.parts,
                headers={**call.headers, "content-length": str(call.size)},
                extensions={BODY_PARTS: call.parts},
            )
        return self.http.build_request(call.method, url, content=call.body, headers=call.headers)

    def _answer(
        self, call: Call, url: httpx.URL, head: _Head, data: Any
    ) -> Answer | httpx.Response:
        if any(name.lower() in _TO_HTTPX for name, _ in head.headers):
            return self._through_httpx(call, url, head, data)
        headers = AnswerHeaders()
        for name, value in head.headers:
            key, text = name.decode("latin-1").lower(), value.decode("latin-1")
            known = dict.get(headers, key)
            headers[key] = text if known is None else f"{known}, {text}"
        if _httpx_log.isEnabledFor(logging.INFO):
            _httpx_log.info('HTTP Request: %s %s "HTTP/1.1 %d %s"', call.method, url,
                            head.status, head.reason)
        return Answer(head.status, headers, data)

    def _through_httpx(self, call: Call, url: httpx.URL, head: _Head, data: Any) -> httpx.Response:
        """The answer as httpx would have returned it: cookies stored, body decoded
        (an encoded body is read here, from the bytes already in)."""
        request = self._request(call, url)
        response = _response(request, head, data)
        response.read()  # a content-encoded body is decoded here; any other is in already
        self.http.cookies.extract_cookies(response)
        _httpx_log.info('HTTP Request: %s %s "HTTP/1.1 %d %s"', call.method, url,
                        head.status, head.reason)
        return response

    def _timeouts(self) -> Timeouts:
        timeout = self.http.timeout
        return timeout.connect, timeout.write, timeout.read

    def send(self, call: Call, url: httpx.URL) -> Answer | httpx.Response | None:
        """``call`` to ``url`` sent directly and its answer, or None: send it through
        httpx. For a client with a ``FastTransport``."""
        prepared = self._prepared(call, url)
        if prepared is None:
            return None
        head, parts, close = prepared
        try:
            answer, data = self.transport.exchange(
                url_address(url), call.method, head, parts, self._timeouts(), close
            )
        except httpx.RequestError as exc:
            exc.request = self._request(call, url)
            raise
        return self._answer(call, url, answer, data)

    async def asend(self, call: Call, url: httpx.URL) -> Answer | httpx.Response | None:
        """``send``, for a client with an ``AsyncFastTransport`` (on asyncio: under any
        other event loop, None)."""
        prepared = self._prepared(call, url)
        if prepared is None or not _on_asyncio():
            return None
        head, parts, close = prepared
        try:
            answer, data = await self.transport.exchange(
                url_address(url), call.method, head, parts, self._timeouts(), close
            )
        except httpx.RequestError as exc:
            exc.request = self._request(call, url)
            raise
        return self._answer(call, url, answer, data)


def _on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # trio, say: the transport's fallback serves it
        return False
    return True
