"""RFC 9457 problem responses for every error the service can answer with."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from dxclient.codec import dumps
from dxclient.errors import DxError, InternalError, InvalidArgumentError

PROBLEM_TYPE = "application/problem+json"
log = logging.getLogger("dxserve.http")


def problem_response(error: DxError, *, close: bool = False) -> Response:
    headers = {}
    retry = error.extra.get("retry_after")
    if retry is not None:
        headers["Retry-After"] = str(retry)
    if close:
        headers["Connection"] = "close"
    return Response(dumps(error.to_problem()), error.status, headers, media_type=PROBLEM_TYPE)


def _field_of(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


def install(app: FastAPI) -> None:
    """Map every exception to a problem document; none escapes as a bare 500."""

    @app.exception_handler(DxError)
    async def _dx(request: Request, exc: DxError) -> Response:
        return problem_response(exc, close=getattr(exc, "close", False))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        field = _field_of(tuple(first.get("loc", ())))
        return problem_response(InvalidArgumentError(f"{field}: {first.get('msg')}", field=field))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:
        detail, field = str(exc.detail), None
        if exc.status_code == 404 and detail == "Not Found":
            detail, field = f"no route {request.method} {request.url.path}; see /docs", "path"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("allow") or (exc.headers or {}).get("Allow")
            detail = f"{request.method} is not allowed on {request.url.path}" + (
                f"; use {allowed}" if allowed else ""
            )
            field = "method"
        err = DxError(detail, field=field)
        err.status = exc.status_code  # type: ignore[misc]
        err.title = {404: "Not found", 405: "Method not allowed"}.get(exc.status_code, "HTTP error")  # type: ignore[misc]
        err.slug = {404: "not-found", 405: "method-not-allowed"}.get(exc.status_code, "http")  # type: ignore[misc]
        response = problem_response(err)
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        return response

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return problem_response(InternalError(f"{type(exc).__name__}; the server logged it"))
