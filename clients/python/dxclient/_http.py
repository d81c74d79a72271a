"""The httpx clients ``Client`` and ``AsyncClient`` make when not given one.

They are httpx's, except for one thing: an answer's cookies are read only when it sets
one. httpx looks for ``Set-Cookie`` in every answer by rebuilding its request and its
headers through the standard library's ``urllib`` and ``email`` classes: ~25 us of
pure Python per call, a twelfth of a small call's whole round trip. A dxserve answer
sets no cookie, so that work finds nothing; an answer that does set one (a load balancer
pinning a session, say) is read exactly as httpx reads it, and later requests send the
cookie as usual.
"""

from __future__ import annotations

from typing import Any

import httpx

_SET_COOKIE = b"set-cookie"


class SetCookieOnly(httpx.Cookies):
    """httpx's cookie jar, given only the answers that carry a ``Set-Cookie`` header."""

    def extract_cookies(self, response: httpx.Response) -> None:
        for name, _ in response.headers.raw:
            if name.lower() == _SET_COOKIE:
                super().extract_cookies(response)
                return


class _SetCookieOnlyJar:
    """A client whose ``cookies`` are a ``SetCookieOnly`` (mixed in before httpx's class)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._jar = SetCookieOnly(kwargs.get("cookies"))

    @property
    def cookies(self) -> httpx.Cookies:
        return self._jar

    @cookies.setter
    def cookies(self, cookies: Any) -> None:
        self._jar = SetCookieOnly(cookies)


class HttpClient(_SetCookieOnlyJar, httpx.Client):
    """``httpx.Client``, cookies read only from answers that set one."""


class AsyncHttpClient(_SetCookieOnlyJar, httpx.AsyncClient):
    """``httpx.AsyncClient``, cookies read only from answers that set one."""
