"""Typed errors shared by the library, the server and the client.

An error's identity is its ``slug`` (the problem ``type`` URI is
``PROBLEM_TYPE_PREFIX + slug``) and its ``title``. Errors carry no HTTP status:
the library raises them without any HTTP meaning, the server's HTTP layer maps
each class to a status (``dxserve.http.problems.STATUS``) when it renders the
problem document, and the client turns a problem document back into the same
exception class by its ``type``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

PROBLEM_TYPE_PREFIX = "urn:dxserve:problem:"

#: Stands in a detail for the request options that fix the error (``fix=``): spelled
#: ``replace=True`` for Python callers, ``"replace": true`` in a problem document.
FIX = "{fix}"


def python_spelling(options: Mapping[str, Any]) -> str:
    """``replace=True``: options as a Python caller passes them."""
    return ", ".join(f"{k}={v!r}" for k, v in options.items())


def json_spelling(options: Mapping[str, Any]) -> str:
    """``"replace": true``: options as a JSON body carries them."""
    return ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in options.items())


class DxError(Exception):
    """Base class. ``field`` names the offending request field (dotted path)."""

    slug: ClassVar[str] = "bad-request"
    title: ClassVar[str] = "Bad request"

    def __init__(
        self, detail: str, *, field: str | None = None, fix: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> None:
        #: request options that fix the error (``{"replace": True}``); ``FIX`` in
        #: ``detail`` is where they are named, in the caller's spelling
        self.fix = dict(fix) if fix else None
        self._template = detail
        if self.fix:
            detail = detail.replace(FIX, python_spelling(self.fix))
        super().__init__(detail)
        self.detail = detail
        self.field = field
        self.extra = extra

    def json_detail(self) -> str:
        """``detail`` as a problem document says it: options spelled as JSON."""
        if not self.fix:
            return self.detail
        return self._template.replace(FIX, json_spelling(self.fix))

    @property
    def type(self) -> str:
        return PROBLEM_TYPE_PREFIX + self.slug

    @staticmethod
    def from_problem(status: int, problem: dict[str, Any]) -> DxError:
        """Rebuild the typed exception a server sent as a problem document (client side).

        The class comes from the problem's ``type``; a type this client does not know
        falls back to a class by HTTP status (``_CLIENT_FALLBACK_BY_STATUS``), else
        ``DxError``. The HTTP status is kept on the instance as ``status`` and
        ``http_status``, the document itself as ``problem``.
        """
        slug = str(problem.get("type", "")).removeprefix(PROBLEM_TYPE_PREFIX)
        cls = _BY_SLUG.get(slug) or _CLIENT_FALLBACK_BY_STATUS.get(status) or DxError
        extra = {
            k: v
            for k, v in problem.items()
            if k not in ("type", "title", "status", "detail", "field", "fix")
        }
        detail = str(problem.get("detail", ""))
        fix = problem.get("fix")
        if isinstance(fix, dict) and fix:  # the detail names it in JSON: say it in Python
            detail = detail.replace(json_spelling(fix), FIX)
        else:
            fix = None
        err = cls(detail, field=problem.get("field"), fix=fix, **extra)
        err.problem = problem  # type: ignore[attr-defined]
        err.status = status  # type: ignore[attr-defined]
        err.http_status = status  # type: ignore[attr-defined]
        return err

    def __str__(self) -> str:
        where = f" [{self.field}]" if self.field else ""
        return f"{self.title}{where}: {self.detail}"


# --- the request cannot be read ----------------------------------------
class MalformedRequestError(DxError):
    """The body cannot be parsed: bad JSON, bad base64, lying binary header."""

    slug, title = "malformed-request", "Malformed request"


# --- access, lookup, conflicts, body limits ------------------------------
class UnauthorizedError(DxError):
    slug, title = "unauthorized", "Missing or invalid bearer token"


class ForbiddenError(DxError):
    """The server refuses this request whatever the token, as configured (registry
    writes on a server reachable from other hosts with no token set)."""

    slug, title = "forbidden", "Forbidden by the server's configuration"


class UnknownFunctionError(DxError):
    slug, title = "unknown-function", "Unknown function"


class UnknownPreparationError(DxError):
    slug, title = "unknown-preparation", "Unknown preparation handle"


class PreparationMismatchError(DxError):
    """A call's signature (shapes, dtypes, structure) differs from its prep's."""

    slug, title = "preparation-mismatch", "Call does not match its preparation"


class FunctionConflictError(DxError):
    slug, title = "function-conflict", "Name already used by other content"


class PayloadTooLargeError(DxError):
    slug, title = "payload-too-large", "Request body too large"


class UnsupportedMediaTypeError(DxError):
    slug, title = "unsupported-media-type", "Unsupported media type"


# --- well-formed but semantically wrong ----------------------------------
class InvalidArgumentError(DxError):
    slug, title = "invalid-argument", "Invalid argument"


class ShapeMismatchError(InvalidArgumentError):
    slug, title = "shape-mismatch", "Shape or structure mismatch"


class DtypeMismatchError(InvalidArgumentError):
    slug, title = "dtype-mismatch", "Dtype mismatch"


class NotScalarOutputError(InvalidArgumentError):
    slug, title = "not-scalar-output", "Operator needs a scalar-valued function"


class NotScalarInputError(InvalidArgumentError):
    slug, title = "not-scalar-input", "Operator needs a scalar input"


class UnsupportedOperatorError(InvalidArgumentError):
    slug, title = "unsupported-operator", "Backend cannot do this operator here"


class InvalidBackendError(InvalidArgumentError):
    slug, title = "invalid-backend", "Unknown backend or bad backend parameters"


class FunctionEvaluationError(InvalidArgumentError):
    """The function raised while being traced or evaluated on these inputs."""

    slug, title = "evaluation-failed", "Function failed on these inputs"


class InvalidExpressionError(InvalidArgumentError):
    slug, title = "invalid-expression", "Expression not allowed"


class InvalidExportError(InvalidArgumentError):
    slug, title = "invalid-export", "Uploaded export cannot run here"


class ResultTooLargeError(InvalidArgumentError):
    slug, title = "result-too-large", "Result would exceed the size limit"


class BudgetExceededError(InvalidArgumentError):
    """XLA's estimate of the compiled operator (device memory, work, run time) is over a
    per-request limit; ``limit`` names the setting and ``estimate`` gives the estimate."""

    slug, title = "budget-exceeded", "Estimated cost exceeds a per-request limit"


class RequestShapeError(InvalidArgumentError):
    """The request's inputs are shaped past a server limit: too many tangents, or pytrees
    with too many leaves or nested too deep (what compile time grows with); ``limit``
    names the setting, ``maximum`` its value and ``count`` what the request holds."""

    slug, title = "request-shape", "Request shape over a server limit"


class SparsityDetectionError(InvalidArgumentError):
    """A ``Sparse`` backend could not find the pattern: detection took longer than the
    server allows (``DXSERVE_SPARSE_DETECTION_SECONDS``) or asdex cannot analyse it."""

    slug, title = "sparsity-detection", "Sparsity detection failed"


# --- limits and failures on the serving side ------------------------------
class TooManyFunctionsError(DxError):
    slug, title = "too-many-functions", "Function limit reached"


class TooManyQueuedError(DxError):
    """The caller has as many compilations (or sparsity detections) waiting or running
    as one caller may (``limit`` names the setting)."""

    slug, title = "too-many-queued", "Too many of your requests are waiting"


class OverloadedError(DxError):
    slug, title = "overloaded", "Server overloaded, retry later"


class StorageFullError(DxError):
    slug, title = "insufficient-storage", "Insufficient storage"


class RequestTimeoutError(DxError):
    """The request's headers or body did not arrive in time; the connection is closed."""

    slug, title = "request-timeout", "Request not received in time"


class DeadlineExceededError(DxError):
    slug, title = "deadline-exceeded", "Computation timed out"


class InternalError(DxError):
    slug, title = "internal", "Internal error"


# --- detached jobs ----------------------------------------------------------
class UnknownJobError(DxError):
    """No job of this id for this caller: never made, removed, expired, or another
    token's (a job is visible to the token that submitted it alone)."""

    slug, title = "unknown-job", "Unknown job"


class JobNotFinishedError(DxError):
    """The job has no result yet (queued or running); ``retry_after`` says when to ask
    again, ``job_status`` what it is doing."""

    slug, title = "job-not-finished", "Job not finished"


class JobCancelledError(DxError):
    """The job was cancelled before it finished: it has no result."""

    slug, title = "job-cancelled", "Job cancelled"


class TooManyJobsError(DxError):
    """The caller has as many jobs queued and running as a token may (``limit``)."""

    slug, title = "too-many-jobs", "Job limit reached"


class TooManyStreamsError(DxError):
    """As many event streams follow the job, or are open for the caller, as the server
    allows (``limit`` names which); retry after ``retry_after`` seconds."""

    slug, title = "too-many-streams", "Stream limit reached"


def _subclasses(cls: type[DxError]) -> list[type[DxError]]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_subclasses(sub))
    return out


_BY_SLUG: dict[str, type[DxError]] = {c.slug: c for c in [DxError, *_subclasses(DxError)]}

# Client side only: the class for a problem document whose ``type`` this client
# does not know (a newer server, or a proxy's own error page), chosen by the HTTP
# status it came with. The library never uses it; the server's class -> status
# mapping lives in its HTTP layer (``dxserve.http.problems.STATUS``).
_CLIENT_FALLBACK_BY_STATUS: dict[int, type[DxError]] = {
    400: DxError,
    401: UnauthorizedError,
    403: ForbiddenError,
    404: UnknownFunctionError,
    408: RequestTimeoutError,
    409: PreparationMismatchError,
    413: PayloadTooLargeError,
    415: UnsupportedMediaTypeError,
    422: InvalidArgumentError,
    429: TooManyFunctionsError,
    500: InternalError,
    503: OverloadedError,
    504: DeadlineExceededError,
    507: StorageFullError,
}
