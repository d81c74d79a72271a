"""The FastAPI app: a thin adapter over ``Service``.

decode -> ``Service`` (resolve function and backend -> prepared executable (cached)
-> device worker) -> encode. The endpoints are in ``routes``; this module builds the
app: routes, problem handlers, middleware and the OpenAPI document.
"""

from __future__ import annotations

import json
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from dxclient import codec
from dxclient.operators import ALIASES, OPERATORS

from ..service import Service
from ..settings import Settings
from . import problems, routes, schemas
from .dispatch import OperatorDispatch, OperatorRoute
from .metrics import Metrics

_PROBLEMS = {
    400: "Malformed body", 404: "Unknown function or handle", 409: "Prep mismatch",
    413: "Body too large", 415: "Unsupported media type", 422: "Semantically invalid",
    503: "Overloaded (Retry-After)", 504: "Timed out",
}


def create_app(settings: Settings | None = None, *, service: Service | None = None) -> FastAPI:
    """The HTTP app over ``service`` (by default a new ``Service(settings)``).

    The app closes the service when its lifespan ends. Process-wide set-up (thread
    priorities, JAX caches, warm-up) is ``runtime.bootstrap``'s, not the app's.
    """
    service = service or Service(settings or Settings())
    metrics = Metrics(service.cache, service.batcher, service.workers)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if service.settings.warm_up:  # the first thread hand-off costs ~20-100 ms (anyio's set-up)
            await run_in_threadpool(int)
        yield
        service.close()

    app = FastAPI(
        title="dxserve",
        version="0.1.0",
        summary="Differentiation as a service: DifferentiationInterface-style derivatives over JAX",
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.metrics = metrics
    problems.install(app)
    _add_routes(app)
    # Innermost, so the metrics (and any other) middleware still see every request.
    app.add_middleware(OperatorDispatch, api=app)
    app.add_middleware(_MetricsMiddleware, metrics=metrics)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _add_routes(app: FastAPI) -> None:
    problem_responses = {
        status: {"model": schemas.Problem, "description": desc} for status, desc in _PROBLEMS.items()
    }
    for name in (*OPERATORS, *ALIASES):
        op = OPERATORS[ALIASES.get(name, name)]
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
            responses={200: {"model": schemas.RESPONSES[op.name]}, **problem_responses},
            openapi_extra=body, summary=name, include_in_schema=name in OPERATORS,
            route_class_override=OperatorRoute,
        )
        if name in OPERATORS:
            app.router.add_api_route(
                f"/prepare/{name}", routes.PrepareEndpoint(op), methods=["POST"],
                tags=["preparation"],
                responses={200: {"model": schemas.PrepareResponse}, **problem_responses},
                openapi_extra=body, summary=f"prepare_{name}",
                route_class_override=OperatorRoute,
            )
    app.get("/functions", response_model=schemas.FunctionList, tags=["functions"])(
        routes.list_functions
    )
    app.get(
        "/functions/{name}", response_model=schemas.FunctionInfoModel, tags=["functions"],
        responses={404: {"model": schemas.Problem}},
    )(routes.get_function)
    app.post(
        "/functions", tags=["functions"], status_code=201,
        response_model=schemas.FunctionInfoModel,
        responses={200: {"description": "Identical content was already registered"},
                   **problem_responses, 401: {"model": schemas.Problem}},
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/RegisterFunction"}}}}},
    )(routes.register_function)
    app.delete(
        "/functions/{name}", tags=["functions"],
        responses={404: {"model": schemas.Problem}, 401: {"model": schemas.Problem}},
    )(routes.delete_function)
    app.get("/backends", tags=["service"])(routes.list_backends)
    app.get("/health", tags=["service"])(routes.health)
    app.get("/ready", tags=["service"])(routes.ready)
    app.get("/metrics", tags=["service"], response_class=Response)(routes.prometheus)


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
    """Pure ASGI: counts and times every HTTP request by route template."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            path = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.record(path, status[0], time.perf_counter() - start)
