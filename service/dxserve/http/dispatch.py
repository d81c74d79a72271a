"""The operator endpoints' hot path: served without FastAPI's per-request machinery.

The operator handlers take the raw ``Request`` and parse and validate the body
themselves (``wire``), so what FastAPI and Starlette do around an ``APIRoute`` per
request (telemetry checks, a body-limit and an exit-stack layer, dependency solving, a
regex scan over every route) has nothing to do for them, and on a small gradient that
machinery costs about as much as the computation.

``OperatorRoute`` stays an ``APIRoute``, so the OpenAPI document and every other
request (a GET on an operator path answers 405 through the router) are unchanged.
``OperatorApp`` is the FastAPI app with one shortcut: a POST to an ``OperatorRoute``
path goes to ``operator_stack`` (built by ``create_app``: the metrics middleware,
Starlette's ``ServerErrorMiddleware`` and ``OperatorEndpoints``) instead of FastAPI's
whole stack, so answers, problem documents and metrics are those of any route.
``OperatorApp.lane()`` is the same route table served from the HTTP protocol, without
ASGI (``lane``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
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
        if self.param_convertors:  # matches() and OperatorApp compare paths literally
            raise ValueError(f"OperatorRoute needs a fixed path, got {path!r}")

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        # A string comparison, not a regex: the router tries these ~40 routes before
        # /functions, /health and the rest.
        if scope["type"] != "http" or route_path(scope) != self.path:
            return Match.NONE, {}
        child = {"endpoint": self.endpoint, "path_params": {}, "route": self}
        return (Match.FULL if scope["method"] in self.methods else Match.PARTIAL), child


class OperatorEndpoints:
    """Pure ASGI: a POST to an ``OperatorRoute`` path (``scope["route"]``) -> its
    endpoint. An exception the
    endpoint raises goes to the app's handler for its class (the lookup Starlette's
    ``ExceptionMiddleware`` makes, without its send wrapper); 500/Exception belong to
    ``ServerErrorMiddleware``, further out, as Starlette splits them."""

    def __init__(self, api: FastAPI) -> None:
        self.routes = {r.path: r for r in api.router.routes if isinstance(r, OperatorRoute)}
        self.handlers = {
            k: h for k, h in api.exception_handlers.items() if k not in (500, Exception)
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = scope["route"]  # looked up once, by OperatorApp
        request = Request(scope, receive, send)
        try:
            response = await route.endpoint(request)
        except Exception as exc:
            handler = self.handler(exc)
            if handler is None:
                raise
            response = await handler(request, exc)
        await response(scope, receive, send)

    def handler(self, exc: Exception) -> Any:
        """The app's handler for ``exc``'s class (not 500/Exception), or None."""
        if isinstance(exc, HTTPException) and exc.status_code in self.handlers:
            return self.handlers[exc.status_code]
        for cls in type(exc).__mro__:
            if cls in self.handlers:
                return self.handlers[cls]
        return None


class OperatorApp(FastAPI):
    """A FastAPI app whose operator POSTs skip FastAPI's stack for ``operator_stack``.

    ``operator_stack(endpoints)`` wraps an ``OperatorEndpoints`` in the middleware every
    answer needs (set by ``create_app``); it is built at the first request, when every
    route is registered, as Starlette builds its own stack. Until it is set, every
    request takes FastAPI's way.
    """

    operator_stack: Callable[[ASGIApp], ASGIApp] | None = None
    #: builds the protocol's operator lane (set by ``create_app``; None: no lane)
    lane_factory: Callable[[], Any] | None = None
    _operators: tuple[ASGIApp, dict[str, OperatorRoute]] | None = None
    _lane: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and self.operator_stack:
            route = self.operator_route(scope)
            if route is not None:
                await self._operators[0](scope, receive, send)  # type: ignore[index]
                return
        await super().__call__(scope, receive, send)

    def operator_route(self, scope: Scope) -> OperatorRoute | None:
        """The ``OperatorRoute`` of a POST's ``scope`` (set in it, as routing would),
        or None. Needs ``operator_stack``."""
        if self.root_path:
            scope["root_path"] = self.root_path
        if self._operators is None:
            endpoints = OperatorEndpoints(self)
            self._operators = (self.operator_stack(endpoints), endpoints.routes)  # type: ignore[misc]
        route = self._operators[1].get(route_path(scope))
        if route is not None:
            scope["app"], scope["route"] = self, route
            scope["endpoint"], scope["path_params"] = route.endpoint, {}
        return route

    def lane(self) -> Any:
        """The protocol's operator lane (``lane.OperatorLane``), built at first use;
        None when the app has none."""
        if self._lane is None and self.lane_factory is not None and self.operator_stack:
            self._lane = self.lane_factory()
        return self._lane
