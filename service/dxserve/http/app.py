"""The FastAPI app: routes that read straight through.

decode -> validate -> resolve function and backend -> prepared executable (cached)
-> device worker -> encode. Each step lives in its own module; this one wires them.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import secrets
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import jax
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from dxclient import codec
from dxclient.backends import BACKEND_TYPES
from dxclient.errors import (
    InvalidArgumentError,
    MalformedRequestError,
    PayloadTooLargeError,
    UnauthorizedError,
    UnknownPreparationError,
    UnsupportedMediaTypeError,
)
from dxclient.operators import ALIASES, OPERATORS, OperatorSpec

from .. import executable_cache, preparation, threads
from ..batching import Batcher
from ..preparation import Prep, PrepCache, lookup, prepare
from ..registry import Entry, Registry, expression_content
from ..settings import Settings
from ..store import DirectoryStore
from ..worker import Workers
from . import problems, schemas
from .metrics import Metrics
from .responses import BodyResponse, PartsResponse
from .routes import OperatorDispatch, OperatorRoute
from .wire import (
    decode_operator_request,
    payload,
    response_encoding,
    result_nbytes,
    wire_headers,
)

#: Bodies above this are decoded and encoded off the event loop.
LARGE_BYTES = 256 * 1024


class PrepHandles:
    """Handles returned by ``POST /prepare/{op}``: a bounded LRU of preps."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: OrderedDict[str, Prep] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, prep: Prep) -> str:
        handle = secrets.token_urlsafe(12)
        with self._lock:
            self._items[handle] = prep
            while len(self._items) > self.maxsize:
                self._items.popitem(last=False)
        return handle

    def get(self, handle: str) -> Prep:
        with self._lock:
            prep = self._items.get(handle)
        if prep is None:
            raise UnknownPreparationError(
                f"no prepared operator {handle!r} (expired or never made); POST /prepare again",
                field="prep",
            )
        return prep

    def forget(self, function: Callable) -> None:
        with self._lock:
            for key in [k for k, p in self._items.items() if p.function is function]:
                del self._items[key]


def _enable_compilation_cache(directory: str) -> None:
    if not directory:
        return
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def export_platforms() -> list[str]:
    """Platforms an uploaded export must be lowered for to run here."""
    platform = jax.default_backend()
    return ["cuda" if platform == "gpu" else platform]


async def read_body(request: Request, limit: int, declared: str | None = None) -> bytes:
    """The whole body, refused (413) past ``limit`` bytes. ``declared``: the request's
    Content-Length if the caller has read it already, else it is looked up here."""
    if declared is None:
        declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        err = PayloadTooLargeError(
            f"body of {declared} bytes exceeds the limit of {limit} bytes", field="body"
        )
        err.close = True  # type: ignore[attr-defined]  # the unread body makes the connection unusable
        raise err
    # Straight from ASGI receive, not ``request.stream()``: a small body is one message,
    # returned as is (the async generator and the join cost ~5 us per small request).
    chunks: list[bytes] = []
    size, more = 0, True
    while more:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        size += len(chunk)
        if size > limit:
            err = PayloadTooLargeError(f"body exceeds the limit of {limit} bytes", field="body")
            err.close = True  # type: ignore[attr-defined]
            raise err
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the service: registry loaded, workers started, routes installed."""
    settings = settings or Settings()
    # First, before anything starts a JAX backend: XLA's thread pools inherit this.
    threads.start_backend_at_low_priority(settings.compute_nice)
    sys.setswitchinterval(settings.switch_interval)
    _enable_compilation_cache(settings.compilation_cache)
    executable_cache.configure(
        Path(settings.compilation_cache) / "executables" if settings.compilation_cache else None,
        settings.executable_cache_mb << 20,
    )
    if settings.warm_up:
        executable_cache.warm_up()
    preparation.MAX_RESULT_ELEMENTS = settings.max_result_elements
    store = DirectoryStore(settings.store)
    registry = Registry(store, settings.max_functions)
    for module in settings.functions:
        registry.add_module(module)
    registry.load_store()
    cache = PrepCache(settings.cache_size)
    handles = PrepHandles(settings.max_prepared)
    registry.on_remove.append(lambda entry: cache.forget(entry.fn))
    registry.on_remove.append(lambda entry: handles.forget(entry.fn))
    batcher = Batcher()
    workers = Workers(
        settings.queue_size, settings.request_timeout, settings.inline_below,
        settings.max_batch, settings.batch_wait, settings.compute_nice,
    )
    metrics = Metrics(cache, batcher, workers)
    tokens = settings.tokens()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if settings.warm_up:  # the first thread hand-off costs ~20-100 ms (anyio's set-up)
            await run_in_threadpool(int)
        yield
        workers.close()
        store.close()

    app = FastAPI(
        title="dxserve",
        version="0.1.0",
        summary="Differentiation as a service: DifferentiationInterface-style derivatives over JAX",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.registry = registry
    app.state.cache = cache
    app.state.workers = workers
    app.state.metrics = metrics
    problems.install(app)

    # --- helpers ------------------------------------------------------------
    def authorize(request: Request) -> None:
        if not tokens:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and any(
            hmac.compare_digest(token.encode(), t.encode()) for t in tokens
        ):
            return
        raise UnauthorizedError(
            "send 'Authorization: Bearer <token>' with a valid token" if given
            else "this server needs 'Authorization: Bearer <token>' for this request",
            field="Authorization",
        )

    async def decode_operator(request: Request, op: OperatorSpec) -> tuple[Any, str, int]:
        content_type, accept, length, declared = wire_headers(request.scope)
        body = await read_body(request, settings.max_body_bytes, declared)
        encoding = response_encoding(content_type, accept, body)
        if len(body) > LARGE_BYTES:
            parsed = await run_in_threadpool(
                decode_operator_request, body, content_type, length, op
            )
        else:
            parsed = decode_operator_request(body, content_type, length, op)
        return parsed, encoding, len(body)

    async def encode(payload: dict, encoding: str, status: int = 200) -> Response:
        if result_nbytes(payload) > LARGE_BYTES:  # sent as parts: see responses.PartsResponse
            parts, media, headers = await run_in_threadpool(
                codec.encode_body_parts, payload, encoding
            )
            return PartsResponse(parts, status, headers, media_type=media)
        body, media, headers = codec.encode_body(payload, encoding)
        return BodyResponse(body, status, media, headers)

    # --- operators ------------------------------------------------------------
    def operator_route(op: OperatorSpec) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            if settings.require_token_for_compute:
                authorize(request)
            req, encoding, size = await decode_operator(request, op)
            entry = registry.get(req.function)
            prep = handles.get(req.prep) if req.prep is not None else None
            found = lookup(
                op.name, entry.fn, req.backend, req.x, req.tangents, req.contexts, prep, cache,
                req.signature,
            )
            # Same function, operator and body size: almost surely the same executable,
            # so its last run time predicts this one's (see worker.Workers.run).
            key = (entry.name, op.name, size, req.prep)
            if found.prep is not None and workers.batching:
                ready = found.prep

                def run_group(items: Sequence[tuple]) -> list:
                    results = batcher.run_group(ready, op.name, items)
                    return [r if isinstance(r, BaseException) else payload(op, r) for r in results]

                def holds(device: Any) -> bool:
                    return ready.holds(op.name, device)

                group = (ready, op.name)
                return await encode(
                    await workers.run_grouped(group, found.inputs, run_group, key, holds),
                    encoding,
                )

            def compute() -> dict:
                ready = found.prep or found.prepare(cache)  # first call: trace and compile
                return payload(op, ready.run(op.name, *found.inputs))

            return await encode(await workers.run(compute, key), encoding)

        handle.__name__ = op.name
        handle.__doc__ = _operator_doc(op)
        return handle

    def prepare_route(op: OperatorSpec) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            if settings.require_token_for_compute:
                authorize(request)
            req, _, _ = await decode_operator(request, op)
            entry = registry.get(req.function)

            def compile_it() -> Prep:
                return prepare(op.name, entry.fn, req.backend, req.x, req.tangents, req.contexts)

            prep = await workers.run(compile_it)
            return JSONResponse(
                {
                    "prep": handles.add(prep),
                    "operator": op.name,
                    "function": entry.name,
                    "backend": prep.backend.to_json(),
                    "resolved": prep.resolved.to_json(),
                }
            )

        handle.__name__ = f"prepare_{op.name}"
        handle.__doc__ = f"Compile `{op.name}` once for this signature; returns a handle."
        return handle

    problem_responses = {
        status: {"model": schemas.Problem, "description": desc}
        for status, desc in {
            400: "Malformed body", 404: "Unknown function or handle", 409: "Prep mismatch",
            413: "Body too large", 415: "Unsupported media type", 422: "Semantically invalid",
            503: "Overloaded (Retry-After)", 504: "Timed out",
        }.items()
    }
    names = list(OPERATORS) + list(ALIASES)
    for name in names:
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
            f"/{name}", operator_route(op), methods=["POST"], tags=["operators"],
            responses={200: {"model": schemas.RESPONSES[op.name]}, **problem_responses},
            openapi_extra=body, summary=name, include_in_schema=name in OPERATORS,
            route_class_override=OperatorRoute,
        )
        if name in OPERATORS:
            app.router.add_api_route(
                f"/prepare/{name}", prepare_route(op), methods=["POST"], tags=["preparation"],
                responses={200: {"model": schemas.PrepareResponse}, **problem_responses},
                openapi_extra=body, summary=f"prepare_{name}",
                route_class_override=OperatorRoute,
            )

    # --- registry -------------------------------------------------------------
    @app.get("/functions", response_model=schemas.FunctionList, tags=["functions"])
    async def list_functions() -> dict:
        """Every registered function with its kind, signature and description."""
        return {"functions": [e.describe() for e in registry.list()]}

    @app.get(
        "/functions/{name}", response_model=schemas.FunctionInfoModel, tags=["functions"],
        responses={404: {"model": schemas.Problem}},
    )
    async def get_function(name: str) -> dict:
        """One function's kind, signature and description."""
        return registry.get(name, "name").describe()

    @app.post(
        "/functions", tags=["functions"], status_code=201,
        response_model=schemas.FunctionInfoModel,
        responses={200: {"description": "Identical content was already registered"},
                   **problem_responses, 401: {"model": schemas.Problem}},
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/RegisterFunction"}}}}},
    )
    async def register_function(request: Request) -> Response:
        """Register an expression or an uploaded JAX export (token needed if configured)."""
        authorize(request)
        media = (request.headers.get("content-type") or "").split(";")[0].strip().lower()
        if media != codec.JSON_TYPE:
            raise UnsupportedMediaTypeError(
                f"POST /functions takes {codec.JSON_TYPE}, got {media or 'nothing'}",
                field="Content-Type",
            )
        body = await read_body(request, settings.max_upload_bytes)
        raw = codec.loads(body, field="body")
        if not isinstance(raw, dict):
            raise MalformedRequestError("the body must be a JSON object", field="body")
        try:
            spec = schemas.RegisterFunction.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = problems._field_of(tuple(first["loc"]))
            raise InvalidArgumentError(f"{field}: {first['msg']}", field=field) from None
        if (spec.expression is None) == (spec.export is None):
            raise InvalidArgumentError(
                "give exactly one of 'expression' (with 'args') or 'export'", field="expression"
            )
        if spec.expression is not None:
            kind, content = "expression", expression_content(spec.expression, spec.args)
        else:
            try:
                content = base64.b64decode(spec.export, validate=True)
            except (binascii.Error, ValueError):
                raise MalformedRequestError("export must be base64", field="export") from None
            kind = "export"
        entry, created = await run_in_threadpool(
            registry.register, spec.name, kind, content, spec.description, replace=spec.replace
        )
        return JSONResponse(entry.describe(), 201 if created else 200)

    @app.delete("/functions/{name}", tags=["functions"],
                responses={404: {"model": schemas.Problem}, 401: {"model": schemas.Problem}})
    async def delete_function(name: str, request: Request) -> dict:
        """Remove a registered expression or export (token needed if configured)."""
        authorize(request)
        entry: Entry = await run_in_threadpool(registry.delete, name)
        return {"deleted": entry.name}

    # --- service ----------------------------------------------------------------
    @app.get("/backends", tags=["service"])
    async def list_backends() -> dict:
        """Every backend type, its parameters, and the operators it serves."""
        return {"backends": BACKENDS}

    @app.get("/health", tags=["service"])
    async def health() -> dict:
        """Liveness: answers from the event loop even while workers compute."""
        return {"status": "ok"}

    @app.get("/ready", tags=["service"])
    async def ready() -> dict:
        """Readiness plus what this server runs on."""
        return {
            "status": "ready",
            "platform": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()],
            "export_platforms": export_platforms(),
            "jax_version": jax.__version__,
            "functions": len(registry),
            "queued": sum(w.pending for w in workers.workers),
        }

    @app.get("/metrics", tags=["service"], response_class=Response)
    async def prometheus() -> Response:
        """Prometheus text exposition."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # Innermost, so the metrics (and any other) middleware still see every request.
    app.add_middleware(OperatorDispatch, api=app)
    app.add_middleware(_MetricsMiddleware, metrics=metrics)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


FIRST_ORDER = [n for n, op in OPERATORS.items() if op.order <= 1]
SECOND_ORDER = [n for n, op in OPERATORS.items() if op.order == 2]
BACKENDS = [
    {"type": "jax-forward", "parameters": {"batch_size": "tangents per vectorized call (null: all)"},
     "operators": FIRST_ORDER + SECOND_ORDER,
     "notes": "second order as forward-over-reverse"},
    {"type": "jax-reverse", "parameters": {"batch_size": "rows per vectorized call (null: all)"},
     "operators": FIRST_ORDER + SECOND_ORDER,
     "notes": "second order as forward-over-reverse"},
    {"type": "finite-differences",
     "parameters": {"method": "'central' (default) or 'forward'",
                    "step": "relative step in (0, 1); null picks cbrt(eps) or sqrt(eps)",
                    "batch_size": "tangents per vectorized call"},
     "operators": FIRST_ORDER + SECOND_ORDER,
     "notes": "works on black-box functions; second order as finite differences over finite differences"},
    {"type": "second-order", "parameters": {"outer": "first-order backend", "inner": "first-order backend"},
     "operators": SECOND_ORDER},
    {"type": "auto", "parameters": {},
     "operators": FIRST_ORDER + SECOND_ORDER,
     "notes": "reverse for gradients/pullbacks, forward for pushforwards/derivatives, "
              "Jacobians by size, forward-over-reverse for second order"},
]
assert {b["type"] for b in BACKENDS} == set(BACKEND_TYPES)


def _operator_doc(op: OperatorSpec) -> str:
    takes = " and `tangents` (a list)" if op.takes_tangents else ""
    return (
        f"`{op.name}` of a registered function at `x`{takes}. "
        f"Returns {', '.join(f'`{r}`' for r in op.results)}. Arrays may be JSON lists, "
        "typed base64 objects, or the binary framing (`application/vnd.dxserve.binary`)."
    )


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
