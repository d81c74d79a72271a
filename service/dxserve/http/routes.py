"""The operator endpoints' hot path: served without FastAPI's per-request machinery.

The operator handlers take the raw ``Request`` and parse and validate the body
themselves (``wire``), so what FastAPI and Starlette do around an ``APIRoute`` per
request (dependency solving, two ``AsyncExitStack``s, telemetry hooks, a linear
regex scan over every route, the exception and exit-stack middlewares) has nothing
to do for them. Profiled on the 2-core bench machine it cost about as much as the
whole computation of a small gradient, against SPEC §7's small-request target.

``OperatorRoute`` stays an ``APIRoute``, so the OpenAPI document and every other
request (a GET on an operator path answers 405 through the router, as before) are
unchanged. ``OperatorDispatch`` is the innermost user middleware: it sends a POST to
an ``OperatorRoute`` path straight to the route's endpoint, inside every other
middleware (metrics, CORS if ever added, the server-error handler) and with the
app's exception handlers applied exactly as Starlette's ``ExceptionMiddleware``
would, so answers, problem documents and metrics are the same.
"""

from __future__ import annotations

import inspect
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette._utils import get_route_path
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send


class OperatorRoute(APIRoute):
    """An ``APIRoute`` on a fixed path whose endpoint is ``async (Request) -> Response``."""

    def __init__(self, path: str, endpoint: Any, **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        if self.param_convertors:  # matches() and OperatorDispatch compare paths literally
            raise ValueError(f"OperatorRoute needs a fixed path, got {path!r}")

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        # A string comparison, not a regex: the router tries these ~40 routes before
        # /functions, /health and the rest.
        if scope["type"] != "http" or get_route_path(scope) != self.path:
            return Match.NONE, {}
        child = {"endpoint": self.endpoint, "path_params": {}, "route": self}
        return (Match.FULL if scope["method"] in self.methods else Match.PARTIAL), child


class OperatorDispatch:
    """Pure ASGI: ``POST`` to an ``OperatorRoute`` path -> its endpoint, directly.

    Add it before any other middleware (``add_middleware`` puts later ones outside).
    Routes are read when Starlette builds the middleware stack, at the first request
    (or lifespan start-up), so every route registered by then is served.
    """

    def __init__(self, app: ASGIApp, api: FastAPI) -> None:
        self.app = app
        self.routes = {r.path: r for r in api.router.routes if isinstance(r, OperatorRoute)}
        # What ExceptionMiddleware handles; 500/Exception belong to ServerErrorMiddleware,
        # further out, so an unexpected error propagates to it as from any route.
        self.handlers = {
            key: handler for key, handler in api.exception_handlers.items()
            if key not in (500, Exception)
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = None
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self.routes.get(get_route_path(scope))
        if route is None:
            await self.app(scope, receive, send)
            return
        scope["endpoint"], scope["path_params"], scope["route"] = route.endpoint, {}, route
        request = Request(scope, receive, send)
        try:
            response = await route.endpoint(request)
        except Exception as exc:
            handler = self._handler(exc)
            if handler is None:
                raise
            response = handler(request, exc)
            if inspect.isawaitable(response):
                response = await response
        await response(scope, receive, send)

    def _handler(self, exc: Exception) -> Any:
        if isinstance(exc, HTTPException) and exc.status_code in self.handlers:
            return self.handlers[exc.status_code]
        for cls in type(exc).__mro__:
            if cls in self.handlers:
                return self.handlers[cls]
        return None
