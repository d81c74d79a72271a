"""The operator endpoints' hot path: served without FastAPI's per-request machinery.

The operator handlers take the raw ``Request`` and parse and validate the body
themselves (``wire``), so what FastAPI does around an ``APIRoute`` per request
(dependency solving, exit stacks, a regex scan over every route) has nothing to do
for them, and on a small gradient that machinery costs about as much as the
computation.

``OperatorRoute`` stays an ``APIRoute``, so the OpenAPI document and every other
request (a GET on an operator path answers 405 through the router) are unchanged.
``OperatorDispatch`` is the innermost user middleware: it sends a POST to an
``OperatorRoute`` path straight to the route's endpoint, inside every other
middleware, through Starlette's own ``ExceptionMiddleware`` with the app's
handlers, so answers, problem documents and metrics are those of any route.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.requests import Request
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send


def route_path(scope: Scope) -> str:
    """The request path below the app's mount point (``root_path``)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class OperatorRoute(APIRoute):
    """An ``APIRoute`` on a fixed path whose endpoint is ``async (Request) -> Response``."""

    def __init__(self, path: str, endpoint: Any, **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        if self.param_convertors:  # matches() and OperatorDispatch compare paths literally
            raise ValueError(f"OperatorRoute needs a fixed path, got {path!r}")

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        # A string comparison, not a regex: the router tries these ~40 routes before
        # /functions, /health and the rest.
        if scope["type"] != "http" or route_path(scope) != self.path:
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
        # 500/Exception belong to ServerErrorMiddleware, further out, so an unexpected
        # error propagates to it as from any route (Starlette splits them the same way).
        handlers = {k: h for k, h in api.exception_handlers.items() if k not in (500, Exception)}
        self.endpoints = ExceptionMiddleware(self._endpoint, handlers=handlers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = None
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self.routes.get(route_path(scope))
        if route is None:
            await self.app(scope, receive, send)
            return
        scope["endpoint"], scope["path_params"], scope["route"] = route.endpoint, {}, route
        await self.endpoints(scope, receive, send)

    @staticmethod
    async def _endpoint(scope: Scope, receive: Receive, send: Send) -> None:
        response = await scope["endpoint"](Request(scope, receive, send))
        await response(scope, receive, send)
