"""RFC 9457 problem responses for every error the service can answer with."""

from __future__ import annotations

import difflib
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from dxcontract.codec import dumps
from dxcontract.errors import (
    DeadlineExceededError,
    DxError,
    ForbiddenError,
    FunctionConflictError,
    InternalError,
    InvalidArgumentError,
    JobCancelledError,
    JobNotFinishedError,
    MalformedRequestError,
    OverloadedError,
    PayloadTooLargeError,
    PreparationMismatchError,
    RequestTimeoutError,
    StorageFullError,
    TooManyFunctionsError,
    TooManyJobsError,
    TooManyQueuedError,
    TooManyStreamsError,
    UnauthorizedError,
    UnknownFunctionError,
    UnknownJobError,
    UnknownPreparationError,
    UnsupportedMediaTypeError,
)
from dxserve.core.preparation import out_of_memory
from dxserve.frameworks import is_runtime_error

PROBLEM_TYPE = "application/problem+json"
log = logging.getLogger("dxserve.http")

# The HTTP status of each error class. Errors themselves carry no status (the
# library has no HTTP meaning); a class not listed takes the status of its nearest
# listed base, so every InvalidArgumentError subclass answers 422 and any other
# DxError 400.
STATUS: dict[type[DxError], int] = {
    DxError: 400,
    MalformedRequestError: 400,
    UnauthorizedError: 401,
    ForbiddenError: 403,
    UnknownFunctionError: 404,
    UnknownPreparationError: 404,
    UnknownJobError: 404,
    RequestTimeoutError: 408,
    PreparationMismatchError: 409,
    FunctionConflictError: 409,
    JobNotFinishedError: 409,
    JobCancelledError: 409,
    PayloadTooLargeError: 413,
    UnsupportedMediaTypeError: 415,
    InvalidArgumentError: 422,
    TooManyFunctionsError: 429,
    TooManyQueuedError: 429,
    TooManyJobsError: 429,
    TooManyStreamsError: 429,
    InternalError: 500,
    OverloadedError: 503,
    DeadlineExceededError: 504,
    StorageFullError: 507,
}


def status_of(error: DxError | type[DxError]) -> int:
    """The HTTP status an error (or error class) is answered with, per ``STATUS``."""
    cls = error if isinstance(error, type) else type(error)
    for base in cls.__mro__:
        status = STATUS.get(base)
        if status is not None:
            return status
    raise TypeError(f"{cls.__name__} is not a DxError")


def problem_document(error: DxError, status: int | None = None) -> dict[str, Any]:
    """The RFC 9457 body: type, title, status, detail, plus ``field`` and extras.

    ``status`` defaults to ``status_of(error)``.
    """
    problem: dict[str, Any] = {
        "type": error.type,
        "title": error.title,
        "status": status_of(error) if status is None else status,
        "detail": error.json_detail(),
    }
    if error.field is not None:
        problem["field"] = error.field
    if error.fix:
        problem["fix"] = error.fix
    problem.update(error.extra)
    return problem


def problem_response(error: DxError, *, status: int | None = None, close: bool = False) -> Response:
    """``error`` as an ``application/problem+json`` response (status from ``STATUS``
    unless given), with ``Retry-After`` when the error has ``retry_after``."""
    headers = {}
    retry = error.extra.get("retry_after")
    if retry is not None:
        headers["Retry-After"] = str(retry)
    if close:
        headers["Connection"] = "close"
    status = status_of(error) if status is None else status
    return Response(
        dumps(problem_document(error, status)), status, headers, media_type=PROBLEM_TYPE
    )


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
        return problem_response(exc, close=_closes(request))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        field = _field_of(tuple(first.get("loc", ())))
        return problem_response(InvalidArgumentError(f"{field}: {first.get('msg')}", field=field))

    async def _runtime(request: Request, exc: Exception) -> Response:
        # Out of memory wherever it surfaces (device or host) is a 503: the request may
        # fit later. Handled here rather than as a bare 500, so the connection stays usable.
        oom = out_of_memory(exc)
        if oom is not None:
            log.warning("out of memory on %s %s: %s", request.method, request.url.path, exc)
            return problem_response(oom)
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return problem_response(InternalError(f"{type(exc).__name__}; the server logged it"))

    async def _framework_runtime(request: Request, exc: Exception) -> Response:
        # A framework's own runtime error (JAX's, which is a RuntimeError), by the
        # frameworks' word; any other RuntimeError goes on as unhandled, as before.
        if not is_runtime_error(exc):
            raise exc
        return await _runtime(request, exc)

    app.add_exception_handler(MemoryError, _runtime)
    app.add_exception_handler(RuntimeError, _framework_runtime)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        # The client went away (or its connection timed out) mid-body: nobody reads this.
        return problem_response(
            MalformedRequestError("the client disconnected", field="body"), close=True
        )

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:
        detail, field = str(exc.detail), None
        suggestions: list[str] = []
        if exc.status_code == 404 and detail == "Not Found":
            suggestions = near_routes(request)
            detail, field = not_found_detail(request.method, request.url.path, suggestions), "path"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("allow") or (exc.headers or {}).get("Allow")
            detail = f"{request.method} is not allowed on {request.url.path}" + (
                f"; use {allowed}" if allowed else ""
            )
            field = "method"
        # Starlette's own errors (unknown route, wrong method) have no DxError class;
        # they keep Starlette's status and get a slug and title of their own.
        err = DxError(detail, field=field, **({"suggestions": suggestions} if suggestions else {}))
        err.title = {404: "Not found", 405: "Method not allowed"}.get(exc.status_code, "HTTP error")  # type: ignore[misc]
        err.slug = {404: "not-found", 405: "method-not-allowed"}.get(exc.status_code, "http")  # type: ignore[misc]
        response = problem_response(err, status=exc.status_code)
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        return response

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        # Starlette answers this one outside the app's middleware: the request's record
        # (``records``) gives the answer its request id and timing here.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        response = problem_response(InternalError(f"{type(exc).__name__}; the server logged it"))
        record = getattr(request.state, "record", None)
        if record is not None:
            for name, value in record.answer_headers(500):
                response.headers[name.decode("latin-1")] = value.decode("latin-1")
        return response


#: Names newcomers bring from other autodiff libraries, as this API calls them.
SYNONYMS = {
    "jvp": "pushforward", "vjp": "pullback", "grad": "gradient", "jac": "jacobian",
    "jacfwd": "jacobian", "jacrev": "jacobian", "hess": "hessian", "eval": "value",
}
_WHY = {
    "pushforward": "a JVP is a pushforward: J t for each tangent t",
    "pullback": "a VJP is a pullback: J^T c for each cotangent c",
}


def near_routes(request: Request) -> list[str]:
    """Paths of this app close to ``request``'s unknown one: its words renamed from other
    libraries' (``/jvp``: ``/pushforward``, ``/grad``: ``/gradient``), else the closest
    spellings (``difflib``); paths that take the request's method first."""
    path = request.url.path
    root = request.scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    routes = [r for r in request.app.routes if isinstance(getattr(r, "path", None), str)]
    known = [r.path for r in routes if "{" not in r.path]
    same_method = [
        r.path for r in routes
        if "{" not in r.path and request.method in (getattr(r, "methods", None) or ())
    ]
    words = re.split(r"([/_])", path.strip().lower())
    renamed = "".join(SYNONYMS.get(w, w) for w in words)
    if renamed != path and renamed in known:
        return [renamed]
    for pool in (same_method, known):
        close = difflib.get_close_matches(path, pool, n=3, cutoff=0.75)
        if close:
            return close
    return []


def not_found_detail(method: str, path: str, suggestions: list[str]) -> str:
    """The 404 detail for a path no route serves, naming what was probably meant."""
    if not suggestions:
        return f"no route {method} {path}; see /docs for every route"
    first = suggestions[0].rsplit("/", 1)[-1]
    why = f" ({_WHY[first]})" if first in _WHY and len(suggestions) == 1 else ""
    return (
        f"no route {method} {path}; did you mean {' or '.join(suggestions)}{why}? "
        "See /docs for every route"
    )


def _closes(request: Request) -> bool:
    """Was the request's body left unread (see ``operators.close_after_answer``)?"""
    return getattr(request.state, "close_connection", False)
