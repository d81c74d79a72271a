"""The FastAPI app: a thin adapter over ``Service``, through the request layer.

Routes: each operator is a plain ASGI endpoint (``operators``) on its own path, first
in the route table so the router tries them before anything else; then the registry,
the service's own routes and the API documents. Errors are answered by the app's
exception handlers (``problems``), and every request passes one middleware
(``records``: request id, timing, metrics, log line). The OpenAPI document describes
the operator endpoints through ``APIRoute`` descriptions of the same paths.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles

from dxcontract import codec
from dxcontract.encodings import ENCODINGS
from dxcontract.operators import OPERATORS, OperatorSpec
from dxserve import __version__
from dxserve.http import jobs, problems, routes, schemas
from dxserve.http.metrics import Metrics
from dxserve.http.operators import OperatorEndpoint, PrepareEndpoint
from dxserve.http.records import RequestRecords
from dxserve.http.sending import SendPath
from dxserve.pipeline import WireMemo, stored_calls
from dxserve.server.jobs.detached import Detached
from dxserve.server.service import Service
from dxserve.settings import Settings

_PROBLEMS = {
    400: "Malformed body", 401: "Missing or invalid bearer token (DXSERVE_REQUIRE_TOKEN_FOR_COMPUTE)",
    404: "Unknown function or handle", 409: "Prep mismatch",
    413: "Body too large", 415: "Unsupported media type", 422: "Semantically invalid",
    503: "Overloaded (Retry-After)", 504: "Timed out",
}
OPENAPI_URL, DOCS_URL, REDOC_URL = "/openapi.json", "/docs", "/redoc"
TITLE = "dxserve"
SUMMARY = "Differentiation as a service: DifferentiationInterface-style derivatives over JAX"


def create_app(settings: Settings | None = None, *, service: Service | None = None) -> FastAPI:
    """The HTTP app over ``service`` (by default a new ``Service(settings)``).

    The app closes the service when its lifespan ends. Process-wide set-up (thread
    priorities, JAX caches, warm-up) is ``runtime.bootstrap``'s, not the app's.
    """
    service = service or Service(settings or Settings())
    #: detached jobs: this process claims and runs them from the store while it serves
    detached = Detached(service, open_call=stored_calls(service))
    metrics = Metrics(
        service.cache, service.batcher, service.workers, service.cancelled, service.budget,
        jobs=detached.counts if detached.store is not None else None,
        streams=detached.stream_counts if detached.store is not None else None,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if service.settings.warm_up:  # the first thread hand-off costs ~20-100 ms
            await asyncio.to_thread(int)
        detached.start()  # jobs left queued or running by a stopped process resume now
        yield
        # Closing waits for threads, and one may compute something that never ends: in
        # the server process (``dxserve serve`` sets ``close_grace``), past that many
        # seconds the process exits without them.
        grace = getattr(app.state, "close_grace", None)
        guard = threading.Timer(grace, _exit_now, (grace,)) if grace else None
        if guard is not None:
            guard.daemon = True
            guard.start()
        try:
            await detached.stop()
            service.close()
        finally:
            if guard is not None:
                guard.cancel()

    # The documents are routes of our own, after the operators (see the module).
    telemetry = service.settings.opentelemetry
    app = FastAPI(
        title=TITLE, version=__version__, summary=SUMMARY, lifespan=lifespan,
        openapi_url=None, docs_url=None, redoc_url=None,
        telemetry={"tracing": telemetry, "metrics": telemetry, "logs": telemetry},
    )
    app.state.service = service
    app.state.detached = detached
    app.state.metrics = metrics
    problems.install(app)
    app.add_middleware(
        RequestRecords, metrics=metrics, log_requests=service.settings.log_format == "json"
    )
    # added last, so outermost of ours: every answer of every route is sent through it
    app.add_middleware(SendPath, budget=service.budget)
    memo = WireMemo()  # this app's validated requests: repeats skip validation
    for name in _by_use():
        app.router.add_route(
            f"/{name}", OperatorEndpoint(service, OPERATORS[name], memo), methods=["POST"]
        )
    for name in _by_use():
        app.router.add_route(
            f"/prepare/{name}", PrepareEndpoint(service, OPERATORS[name]), methods=["POST"]
        )
    app.router.add_route(
        "/jobs/{operator}", jobs.JobSubmitEndpoint(service, detached, memo), methods=["POST"]
    )
    _add_routes(app)
    _add_documents(app)
    # FastAPI's documented way to shape the OpenAPI document
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


#: The operators most requests ask for: the router tries their routes first.
_MOST_USED = ("gradient", "value_and_gradient", "hvp", "jacobian", "pullback", "pushforward")


def _by_use() -> list[str]:
    """Every operator's name, the most used first."""
    return [*(n for n in _MOST_USED if n in OPERATORS), *(n for n in OPERATORS if n not in _MOST_USED)]


def _operator_docs() -> list[APIRoute]:
    """``APIRoute`` descriptions of the operator endpoints, for the OpenAPI document
    only (they are served by ``operators``)."""
    problem_responses = _problem_responses()
    docs = []
    for name, op in OPERATORS.items():
        request = {"schema": {"$ref": f"#/components/schemas/{schemas.REQUESTS[op.name].__name__}"}}
        body = {"requestBody": {"required": True, "content": {
            media: request if media == codec.JSON_TYPE else _BYTES for media in _body_media()
        }}}
        docs.append(APIRoute(
            f"/{name}", _described(name, _operator_summary(op)), methods=["POST"],
            tags=["operators"],
            responses={200: {"model": schemas.RESPONSES[op.name], "content": _EVENT_STREAM},
                       **problem_responses},
            openapi_extra=body, summary=name, operation_id=name,
        ))
        docs.append(APIRoute(
            f"/prepare/{name}",
            _described(f"prepare_{name}", f"Compile `{name}` once for this signature; returns a handle."),
            methods=["POST"], tags=["preparation"],
            responses={200: {"model": schemas.PrepareResponse}, **problem_responses},
            openapi_extra=body, summary=f"prepare_{name}", operation_id=f"prepare_{name}",
        ))
    return docs


#: an operator body (or answer) in a media type other than JSON: bytes of that encoding
_BYTES = {"schema": {"type": "string", "format": "binary"}}


def _body_media() -> list[str]:
    """The media types operator bodies and answers may take: every registered
    encoding's, JSON first."""
    media = {e.media_type.lower() for e in ENCODINGS.values()} - {codec.JSON_TYPE}
    return [codec.JSON_TYPE, *sorted(media)]


def _operator_summary(op: OperatorSpec) -> str:
    takes = " and `tangents` (a list)" if op.takes_tangents else ""
    return (
        f"`{op.name}` of a registered function at `x`{takes}. "
        f"Returns {', '.join(f'`{r}`' for r in op.results)}"
        f"{' (and `aux` with `has_aux`)' if op.aux else ''}. Arrays may be JSON lists, "
        "typed base64 objects, or the binary framing (`application/vnd.dxserve.binary`)."
    )


def _described(name: str, doc: str) -> Any:
    """An endpoint that only describes (its name and docstring feed the document)."""

    async def endpoint(request: Request) -> Response:  # never routed to
        raise NotImplementedError

    endpoint.__name__ = name
    endpoint.__doc__ = doc
    return endpoint


def _problem_responses() -> dict:
    return {
        status: {"model": schemas.Problem, "description": desc} for status, desc in _PROBLEMS.items()
    }


def _add_routes(app: FastAPI) -> None:
    problem_responses = _problem_responses()
    # Explicit operationIds: generated clients name their methods after them.
    app.get(
        "/functions", response_model=schemas.FunctionList, tags=["functions"],
        responses=_private_problems(), operation_id="list_functions",
    )(
        routes.list_functions
    )
    app.get(
        "/functions/{name}", response_model=schemas.FunctionInfoModel, tags=["functions"],
        responses={404: {"model": schemas.Problem}, **_private_problems()},
        operation_id="get_function",
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
    _add_job_routes(app)
    app.get("/backends", tags=["service"], operation_id="list_backends")(routes.list_backends)
    app.get("/health", tags=["service"], operation_id="health")(routes.health)
    app.get("/ready", tags=["service"], operation_id="ready")(routes.ready)
    app.get(
        "/metrics", tags=["service"], response_class=Response, responses=_private_problems(),
        operation_id="metrics",
    )(routes.prometheus)


def _job_problems(*statuses: int) -> dict:
    described = {
        400: "Malformed body", 401: "Missing or invalid bearer token",
        404: "No such job of yours (another token's jobs are not found either)",
        409: "Not finished (Retry-After), or cancelled", 413: "Body too large",
        415: "Unsupported media type", 422: "Semantically invalid",
        429: "Too many jobs queued or running (DXSERVE_MAX_JOBS_PER_TOKEN)",
        503: "The store is unavailable (Retry-After)",
        507: "The job store is full (DXSERVE_JOB_STORE_BYTES)",
    }
    return {s: {"model": schemas.Problem, "description": described[s]} for s in statuses}


def _add_job_routes(app: FastAPI) -> None:
    """``GET /jobs``, ``GET``/``DELETE /jobs/{id}``, its ``result`` and ``events``
    (``POST /jobs/{operator}`` is an ASGI endpoint, documented by ``_job_docs``)."""
    app.get(
        "/jobs", response_model=schemas.JobList, tags=["jobs"], operation_id="list_jobs",
        responses=_job_problems(401, 422, 503),
    )(jobs.list_jobs)
    app.get(
        "/jobs/{job_id}", response_model=schemas.JobStatus, tags=["jobs"],
        operation_id="get_job", responses=_job_problems(401, 404, 422, 503),
    )(jobs.get_job)
    app.delete(
        "/jobs/{job_id}", tags=["jobs"], operation_id="delete_job", status_code=202,
        response_model=schemas.JobStatus,
        responses={204: {"description": "The ended job and its result are removed"},
                   **_job_problems(401, 404, 422, 503)},
    )(jobs.delete_job)
    results = {media: _BYTES for media in _body_media() if media != codec.JSON_TYPE}
    app.get(
        "/jobs/{job_id}/result", tags=["jobs"], operation_id="get_job_result",
        response_class=Response,
        responses={200: {"description": "The operator's answer, in the encoding asked for",
                         "content": {codec.JSON_TYPE: {"schema": {"type": "object"}},
                                     **results}},
                   **_problem_responses(), **_job_problems(401, 404, 409, 503)},
    )(jobs.get_job_result)
    app.get(
        "/jobs/{job_id}/events", tags=["jobs"], operation_id="get_job_events",
        response_class=Response,
        responses={200: {"description": "Server-Sent Events", "content": _JOB_EVENTS},
                   **_job_problems(401, 404, 422, 503),
                   429: {"model": schemas.Problem, "description": (
                       "Too many streams on this job or of this owner "
                       "(DXSERVE_MAX_STREAMS_PER_JOB, DXSERVE_MAX_STREAMS_PER_OWNER; Retry-After)")}},
    )(jobs.job_events)


_JOB_EVENTS = {"text/event-stream": {"schema": {
    "type": "object",
    "properties": {"event": {"type": "string", "enum": ["progress", "result", "error"]},
                   "data": {"type": "string", "description": "One line of JSON"}},
    "description": "Server-Sent Events (each one described), as a streamed operator's: `event: progress` with data "
    '`{"done": k, "total": n, "unit": ...}` as the job moves, `: keep-alive` comments, then '
    "one `event: result` (the operator's JSON answer; typed base64 arrays with `Accept: "
    "text/event-stream; arrays=b64`) or one `event: error` (a problem document). Closing "
    "the stream does not cancel the job.",
}}}


def _job_docs() -> list[APIRoute]:
    """The description of ``POST /jobs/{operator}``, for the OpenAPI document only."""
    body = {"anyOf": [{"$ref": f"#/components/schemas/{model.__name__}"}
                      for model in schemas.REQUESTS.values()]}
    extra = {
        "parameters": [{
            "name": "operator", "in": "path", "required": True,
            "description": "The operator to run, as its own route is named",
            "schema": {"type": "string", "enum": list(OPERATORS)},
        }],
        "requestBody": {"required": True, "content": {
            media: {"schema": body} if media == codec.JSON_TYPE else _BYTES
            for media in _body_media()
        }},
    }
    return [APIRoute(
        "/jobs/{operator}", _described("submit_job", (
            "Run an operator as a detached job: the operator's own body (any encoding), "
            "stored and run by whichever server process claims it. Answers 202 with "
            "`Location: /jobs/{id}`; the job belongs to the bearer token sent."
        )), methods=["POST"], tags=["jobs"], status_code=202,
        responses={202: {"model": schemas.JobStatus, "description": "Queued",
                         "headers": {"Location": {"schema": {"type": "string"},
                                                  "description": "/jobs/{id}"}}},
                   **_problem_responses(), **_job_problems(401, 404, 429, 507)},
        openapi_extra=extra, summary="submit_job", operation_id="submit_job",
    )]


def _private_problems() -> dict:
    return {
        401: {"model": schemas.Problem,
              "description": "Missing or invalid bearer token (DXSERVE_PRIVATE_METADATA)"},
        403: {"model": schemas.Problem,
              "description": "DXSERVE_PRIVATE_METADATA without a token configured"},
    }


def _registry_problems() -> dict:
    return {
        401: {"model": schemas.Problem, "description": "Missing or invalid bearer token"},
        403: {"model": schemas.Problem,
              "description": "Registration closed: no token configured beyond loopback"},
    }


#: the bearer token of ``DXSERVE_TOKEN`` / ``DXSERVE_TOKENS_FILE``
BEARER = "bearer"


def _document_security(spec: dict, tokens: bool = True) -> None:
    """Registry writes take a bearer token whenever tokens are configured; computations
    only with ``DXSERVE_REQUIRE_TOKEN_FOR_COMPUTE``. Either way ``{}`` (no token) is also
    listed: a server without tokens on loopback takes anonymous requests. A server with
    no token configured (``tokens`` false) takes none anywhere: its document shows no
    scheme, so Swagger UI draws no lock."""
    if not tokens:
        return
    spec["components"]["securitySchemes"] = {BEARER: {
        "type": "http", "scheme": "bearer",
        "description": "A token of DXSERVE_TOKEN or DXSERVE_TOKENS_FILE: "
                       "'Authorization: Bearer <token>'",
    }}
    for methods in spec.get("paths", {}).values():
        for operation in methods.values():
            if "401" in operation.get("responses", {}):
                operation["security"] = [{BEARER: []}, {}]


#: Where /docs and /redoc load their scripts, styles and icon from: this server, from the
#: files the pinned ``fastapi-offline`` package ships, so the pages work with no network.
ASSETS_URL = "/docs/assets"
_ASSETS_PACKAGE = ("fastapi_offline", "static")
SWAGGER_JS, SWAGGER_CSS = "swagger-ui-bundle.js", "swagger-ui.css"
REDOC_JS, FAVICON = "redoc.standalone.js", "favicon.png"


def _add_documents(app: FastAPI) -> None:
    """``/openapi.json``, ``/docs`` (Swagger UI) and ``/redoc``, as FastAPI serves them,
    with their assets served from ``ASSETS_URL`` rather than a CDN."""

    def asset(request: Request, name: str) -> str:
        # under a proxy's path prefix (root_path) the pages still find their assets
        return f"{request.scope.get('root_path', '')}{ASSETS_URL}/{name}"

    async def openapi(request: Request) -> JSONResponse:
        routes.authorize(request, "read")
        return JSONResponse(app.openapi())

    async def swagger_ui(request: Request) -> HTMLResponse:
        routes.authorize(request, "read")
        return get_swagger_ui_html(
            openapi_url=OPENAPI_URL, title=f"{TITLE} - Swagger UI",
            oauth2_redirect_url=f"{DOCS_URL}/oauth2-redirect",
            swagger_js_url=asset(request, SWAGGER_JS),
            swagger_css_url=asset(request, SWAGGER_CSS),
            swagger_favicon_url=asset(request, FAVICON),
        )

    async def swagger_ui_redirect(request: Request) -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    async def redoc(request: Request) -> HTMLResponse:
        routes.authorize(request, "read")
        return get_redoc_html(
            openapi_url=OPENAPI_URL, title=f"{TITLE} - ReDoc",
            redoc_js_url=asset(request, REDOC_JS), redoc_favicon_url=asset(request, FAVICON),
            with_google_fonts=False,  # fonts from a CDN otherwise; ReDoc falls back to local ones
        )

    for path, endpoint in (
        (OPENAPI_URL, openapi), (DOCS_URL, swagger_ui),
        (f"{DOCS_URL}/oauth2-redirect", swagger_ui_redirect), (REDOC_URL, redoc),
    ):
        app.router.add_route(path, endpoint, methods=["GET", "HEAD"], include_in_schema=False)
    # Served by StaticFiles (content types, ETag, Last-Modified, 304s) behind one route
    # template rather than a mount, so every asset request is counted under that template
    # and unknown names cannot add series to /metrics.
    assets = StaticFiles(packages=[_ASSETS_PACKAGE])

    async def docs_asset(name: str, request: Request) -> Response:
        return await assets.get_response(name, request.scope)

    app.api_route(
        f"{ASSETS_URL}/{{name}}", methods=["GET", "HEAD"], include_in_schema=False
    )(docs_asset)


def _openapi(app: FastAPI) -> dict:
    if app.openapi_schema:
        return app.openapi_schema
    spec = get_openapi(
        title=app.title, version=app.version, summary=app.summary,
        routes=[*_operator_docs(), *_job_docs(), *app.routes],
    )
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    models = [*schemas.REQUESTS.values(), schemas.RegisterFunction]
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
    _document_wire_media(spec)
    _document_security(spec, tokens=app.state.service.takes_tokens)
    app.openapi_schema = spec
    return spec


def _document_wire_media(spec: dict) -> None:
    """Say what goes over the wire: errors are ``application/problem+json`` (FastAPI's
    request-validation errors too, rendered by ``problems``), and operators answer in
    every encoding's media type (the binary framing, plugged-in ones) when asked."""
    problem = {"schema": {"$ref": "#/components/schemas/Problem"}}
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
            takes = operation.get("requestBody", {}).get("content", {})
            if ok is not None and not path.startswith("/prepare/"):
                for media in takes:  # answered in the request's encoding, or the Accept's
                    if media != codec.JSON_TYPE:
                        ok[media] = _BYTES
    components = spec.get("components", {}).get("schemas", {})
    text = json.dumps(spec.get("paths", {}))
    for unused in ("HTTPValidationError", "ValidationError"):
        if f"#/components/schemas/{unused}" not in text:
            components.pop(unused, None)


def _exit_now(grace: float) -> None:
    """End the process at once (closing took longer than ``grace`` seconds)."""
    logging.getLogger("dxserve").error(
        "shutdown: closing took over %g s (a computation that does not end?); exiting now",
        grace,
    )
    logging.shutdown()
    os._exit(0)
