"""The FastAPI app: a thin adapter over ``Service``.

decode -> ``Service`` (resolve function and backend -> prepared executable (cached)
-> device worker) -> encode. The endpoints are in ``routes``; this module builds the
app: routes, problem handlers, middleware and the OpenAPI document.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.concurrency import run_in_threadpool
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.responses import Response

from dxclient import codec
from dxclient.operators import OPERATORS

from .. import __version__
from ..service import Service
from ..settings import Settings
from . import problems, routes, schemas
from .dispatch import OperatorApp, OperatorRoute
from .lane import OperatorLane
from .metrics import Metrics
from .records import RequestRecord

_PROBLEMS = {
    400: "Malformed body", 401: "Missing or invalid bearer token (DXSERVE_REQUIRE_TOKEN_FOR_COMPUTE)",
    404: "Unknown function or handle", 409: "Prep mismatch",
    413: "Body too large", 415: "Unsupported media type", 422: "Semantically invalid",
    503: "Overloaded (Retry-After)", 504: "Timed out",
}


def create_app(settings: Settings | None = None, *, service: Service | None = None) -> FastAPI:
    """The HTTP app over ``service`` (by default a new ``Service(settings)``).

    The app closes the service when its lifespan ends. Process-wide set-up (thread
    priorities, JAX caches, warm-up) is ``runtime.bootstrap``'s, not the app's.
    """
    service = service or Service(settings or Settings())
    metrics = Metrics(service.cache, service.batcher, service.workers, service.cancelled)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if service.settings.warm_up:  # the first thread hand-off costs ~20-100 ms (anyio's set-up)
            await run_in_threadpool(int)
        yield
        service.close()

    app = OperatorApp(
        title="dxserve",
        version=__version__,
        summary="Differentiation as a service: DifferentiationInterface-style derivatives over JAX",
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.metrics = metrics
    problems.install(app)
    _add_routes(app)
    # Outermost, around Starlette's ServerErrorMiddleware too, so that an unexpected
    # error's 500 is counted, timed and given its request id like any answer.
    build_stack = app.build_middleware_stack
    log_requests = service.settings.log_format == "json"

    def build_middleware_stack() -> Any:
        return _MetricsMiddleware(build_stack(), metrics, app, log_requests)

    def operator_stack(endpoints: Any) -> Any:
        errors = app.exception_handlers.get(500) or app.exception_handlers.get(Exception)
        inner = ServerErrorMiddleware(endpoints, handler=errors, debug=app.debug)
        return _MetricsMiddleware(inner, metrics, app, log_requests)

    app.build_middleware_stack = build_middleware_stack  # type: ignore[method-assign]
    app.operator_stack = operator_stack
    if service.settings.operator_lane:
        app.lane_factory = lambda: OperatorLane(app, metrics, log_requests)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


#: The 200 answer of an operator route asked for ``Accept: text/event-stream``.
_EVENT_STREAM = {"text/event-stream": {"schema": {
    "type": "string",
    "description": "Server-Sent Events: `event: progress` with data "
    '`{"done": k, "total": n, "unit": "columns"|"rows"|"points"|"tangents"}` after each '
    "chunk (and at least every second), `: keep-alive` comments while there is none, then "
    "one `event: result` whose data is this route's JSON answer (typed base64 arrays "
    "with `Accept: text/event-stream; arrays=b64`) or one `event: error` whose data is a "
    "problem document. Closing the connection cancels the computation.",
}}}


def _add_routes(app: FastAPI) -> None:
    problem_responses = {
        status: {"model": schemas.Problem, "description": desc} for status, desc in _PROBLEMS.items()
    }
    for name, op in OPERATORS.items():
        body = {
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"$ref": f"#/components/schemas/{schemas.REQUESTS[op.name].__name__}"}
                    },
                    codec.BINARY_TYPE: {"schema": {"type": "string", "format": "binary"}},
                },
            }
        }
        # app.router's add_api_route: FastAPI.add_api_route has no route_class_override.
        app.router.add_api_route(
            f"/{name}", routes.OperatorEndpoint(op), methods=["POST"], tags=["operators"],
            responses={200: {"model": schemas.RESPONSES[op.name], "content": _EVENT_STREAM},
                       **problem_responses},
            openapi_extra=body, summary=name,
            route_class_override=OperatorRoute, operation_id=name,
        )
        app.router.add_api_route(
            f"/prepare/{name}", routes.PrepareEndpoint(op), methods=["POST"],
            tags=["preparation"],
            responses={200: {"model": schemas.PrepareResponse}, **problem_responses},
            openapi_extra=body, summary=f"prepare_{name}",
            route_class_override=OperatorRoute, operation_id=f"prepare_{name}",
        )
    # Explicit operationIds: generated clients name their methods after them.
    app.get(
        "/functions", response_model=schemas.FunctionList, tags=["functions"],
        operation_id="list_functions",
    )(
        routes.list_functions
    )
    app.get(
        "/functions/{name}", response_model=schemas.FunctionInfoModel, tags=["functions"],
        responses={404: {"model": schemas.Problem}}, operation_id="get_function",
    )(routes.get_function)
    app.post(
        "/functions", tags=["functions"], status_code=201,
        response_model=schemas.FunctionInfoModel, operation_id="register_function",
        responses={200: {"description": "Identical content was already registered"},
                   **problem_responses, **_registry_problems(),
                   409: {"model": schemas.Problem, "description": "Name taken by other content"},
                   429: {"model": schemas.Problem, "description": "Function limit reached"},
                   507: {"model": schemas.Problem, "description": "No space left to store it"}},
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/RegisterFunction"}}}}},
    )(routes.register_function)
    app.delete(
        "/functions/{name}", tags=["functions"],
        responses={404: {"model": schemas.Problem}, **_registry_problems(),
                   409: {"model": schemas.Problem, "description": "A server-side module's function"}},
        operation_id="delete_function",
    )(routes.delete_function)
    app.get("/backends", tags=["service"], operation_id="list_backends")(routes.list_backends)
    app.get("/health", tags=["service"], operation_id="health")(routes.health)
    app.get("/ready", tags=["service"], operation_id="ready")(routes.ready)
    app.get(
        "/metrics", tags=["service"], response_class=Response, operation_id="metrics"
    )(routes.prometheus)


def _registry_problems() -> dict:
    return {
        401: {"model": schemas.Problem, "description": "Missing or invalid bearer token"},
        403: {"model": schemas.Problem,
              "description": "Registration closed: no token configured beyond loopback"},
    }


#: the bearer token of ``DXSERVE_TOKEN`` / ``DXSERVE_TOKENS_FILE``
BEARER = "bearer"


def _document_security(spec: dict) -> None:
    """Registry writes take a bearer token whenever tokens are configured; computations
    only with ``DXSERVE_REQUIRE_TOKEN_FOR_COMPUTE``. Either way ``{}`` (no token) is also
    listed: a server without tokens on loopback takes anonymous requests."""
    spec["components"]["securitySchemes"] = {BEARER: {
        "type": "http", "scheme": "bearer",
        "description": "A token of DXSERVE_TOKEN or DXSERVE_TOKENS_FILE: "
                       "'Authorization: Bearer <token>'",
    }}
    for methods in spec.get("paths", {}).values():
        for operation in methods.values():
            if "401" in operation.get("responses", {}):
                operation["security"] = [{BEARER: []}, {}]


def _openapi(app: FastAPI) -> dict:
    if app.openapi_schema:
        return app.openapi_schema
    spec = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    models = [*schemas.REQUESTS.values(), schemas.RegisterFunction]
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
    _document_wire_media(spec)
    _document_security(spec)
    app.openapi_schema = spec
    return spec


def _document_wire_media(spec: dict) -> None:
    """Say what goes over the wire: errors are ``application/problem+json`` (FastAPI's
    request-validation errors too, rendered by ``problems``), and operators answer in
    the binary framing when asked."""
    problem = {"schema": {"$ref": "#/components/schemas/Problem"}}
    binary = {"schema": {"type": "string", "format": "binary"}}
    for path, methods in spec.get("paths", {}).items():
        for operation in methods.values():
            responses = operation.get("responses", {})
            for status, response in responses.items():
                content = response.get("content")
                if not content or not str(status).startswith(("4", "5")):
                    continue
                content.pop("application/json", None)
                content[problems.PROBLEM_TYPE] = problem
                if response.get("description") == "Validation Error":
                    response["description"] = "Semantically invalid"
            ok = responses.get("200", {}).get("content")
            if ok is not None and codec.BINARY_TYPE in operation.get("requestBody", {}).get(
                "content", {}
            ) and not path.startswith("/prepare/"):
                ok[codec.BINARY_TYPE] = binary
    components = spec.get("components", {}).get("schemas", {})
    text = json.dumps(spec.get("paths", {}))
    for unused in ("HTTPValidationError", "ValidationError"):
        if f"#/components/schemas/{unused}" not in text:
            components.pop(unused, None)


class _MetricsMiddleware:
    """Pure ASGI: counts and times every HTTP request by route template, and gives
    every answer an ``X-Request-ID`` (the request's own, else a new one) and a
    ``Server-Timing`` (total, and decode/queue/compute/encode where the request made a
    service call). With JSON logs on, one line per request (``event`` "rejected" for
    4xx/5xx, with the problem's type and detail).

    The operator hot path runs through here: the added work is a context variable,
    a header scan and two header appends; logging only when JSON logs are on.
    """

    def __init__(self, app: Any, metrics: Metrics, api: FastAPI, log_requests: bool = False) -> None:
        self.app = app
        self.metrics = metrics
        self.api = api
        self.log_requests = log_requests
        self._known: frozenset[str] | None = None

    def known_paths(self) -> frozenset[str]:
        """Paths of routes without parameters (FastAPI's own /docs and /openapi.json
        among them), counted under themselves when the route leaves no ``scope["route"]``."""
        if self._known is None:
            self._known = frozenset(
                path for r in self.api.routes
                if "{" not in (path := getattr(r, "path", "{"))
            )
        return self._known

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(scope["headers"])
        problem: list[bytes] = []

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *message.get("headers", ()), *record.answer_headers(message["status"])
                ]
            elif self.log_requests and record.status >= 400 and len(problem) < 4:
                problem.append(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")
            if route is not None:
                path = route.path
            else:
                path = scope["path"] if scope["path"] in self.known_paths() else "unmatched"
            record.finish(scope, path, self.metrics, self.log_requests, b"".join(problem))
