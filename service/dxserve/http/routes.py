"""The HTTP endpoints besides the operators (``operators``): the registry and the
service itself. Each decodes, calls the ``Service`` and encodes; nothing else.

Each endpoint finds the service on ``request.app.state.service``; no endpoint holds
state of its own.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from starlette.responses import JSONResponse, Response

from dxcontract import codec
from dxcontract.errors import (
    MalformedRequestError,
    PayloadTooLargeError,
    UnsupportedMediaTypeError,
)
from dxserve.http.operators import bearer_token, close_after_answer
from dxserve.server.service import Action, Service


def service_of(request: Request) -> Service:
    return request.app.state.service


def authorize(request: Request, action: Action) -> None:
    authorization = request.headers.get("authorization")
    token = bearer_token(authorization.encode("latin-1") if authorization is not None else None)
    service_of(request).authorize(token, action)


async def read_upload(request: Request, limit: int) -> bytes:
    """A registration's whole body, refused (413) past ``limit`` bytes; the connection
    is closed after an answer that leaves the body unread."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        close_after_answer(request.scope)
        raise PayloadTooLargeError(
            f"body of {declared} bytes exceeds the limit of {limit} bytes", field="body"
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            close_after_answer(request.scope)
            raise PayloadTooLargeError(f"body exceeds the limit of {limit} bytes", field="body")
        chunks.append(chunk)
    return b"".join(chunks)


async def list_functions(request: Request, details: bool = False) -> Any:
    """Every registered function, by name: its kind, description and the address of
    its full description (shapes, operators, an example request). ``?details=true``
    lists the full descriptions instead, as ``GET /functions/{name}`` gives each."""
    authorize(request, "read")
    functions = service_of(request).functions()
    if details:  # each as GET /functions/{name} answers it (its model's fields)
        from dxserve.http.schemas import FunctionInfoModel

        full = [FunctionInfoModel.model_validate(f).model_dump(mode="json") for f in functions]
        return JSONResponse({"functions": full})
    return {
        "functions": [
            {"name": f["name"], "kind": f["kind"], "description": f["description"],
             "href": f"/functions/{f['name']}"}
            for f in functions
        ]
    }  # fmt: skip


async def get_function(name: str, request: Request) -> dict:
    """One function's kind, signature and description."""
    authorize(request, "read")
    return service_of(request).function(name)


async def register_function(request: Request) -> Response:
    """Register an expression or an uploaded JAX export (token needed if configured)."""
    authorize(request, "write")
    media = (request.headers.get("content-type") or "").split(";")[0].strip().lower()
    if media != codec.JSON_TYPE:
        raise UnsupportedMediaTypeError(
            f"POST /functions takes {codec.JSON_TYPE}, got {media or 'nothing'}",
            field="Content-Type",
        )
    service = service_of(request)
    body = await read_upload(request, service.settings.max_upload_bytes)
    raw = codec.loads(body, field="body")
    if not isinstance(raw, dict):
        raise MalformedRequestError("the body must be a JSON object", field="body")
    described, created = await service.register(raw)
    return JSONResponse(described, 201 if created else 200)


async def delete_function(name: str, request: Request) -> dict:
    """Remove a registered expression or export (token needed if configured)."""
    authorize(request, "write")
    return {"deleted": await service_of(request).delete(name)}


async def list_backends(request: Request) -> dict:
    """Every backend type, its parameters, and the operators it serves."""
    return {"backends": service_of(request).backends()}


async def health() -> dict:
    """Liveness: answers from the event loop even while workers compute."""
    return {"status": "ok"}


async def ready(request: Request) -> dict:
    """Readiness plus what this server runs on."""
    return service_of(request).ready()


async def prometheus(request: Request) -> Response:
    """Prometheus text exposition."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    authorize(request, "read")
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
