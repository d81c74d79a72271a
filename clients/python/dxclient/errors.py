"""Typed errors shared by the library, the server and the client.

Every error knows its HTTP status and renders itself as an RFC 9457 problem
document, so the server maps exceptions to responses without a lookup table and
the client turns a problem document back into the same exception class.
"""

from __future__ import annotations

from typing import Any, ClassVar

PROBLEM_TYPE_PREFIX = "urn:dxserve:problem:"


class DxError(Exception):
    """Base class. ``field`` names the offending request field (dotted path)."""

    status: ClassVar[int] = 400
    slug: ClassVar[str] = "bad-request"
    title: ClassVar[str] = "Bad request"

    def __init__(self, detail: str, *, field: str | None = None, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.field = field
        self.extra = extra

    @property
    def type(self) -> str:
        return PROBLEM_TYPE_PREFIX + self.slug

    def to_problem(self) -> dict[str, Any]:
        """The RFC 9457 body: type, title, status, detail, plus ``field`` and extras."""
        problem: dict[str, Any] = {
            "type": self.type,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
        }
        if self.field is not None:
            problem["field"] = self.field
        problem.update(self.extra)
        return problem

    @staticmethod
    def from_problem(status: int, problem: dict[str, Any]) -> DxError:
        """Rebuild the typed exception a server sent as a problem document."""
        slug = str(problem.get("type", "")).removeprefix(PROBLEM_TYPE_PREFIX)
        cls = _BY_SLUG.get(slug) or _BY_STATUS.get(status) or DxError
        extra = {
            k: v
            for k, v in problem.items()
            if k not in ("type", "title", "status", "detail", "field")
        }
        err = cls(str(problem.get("detail", "")), field=problem.get("field"), **extra)
        err.problem = problem  # type: ignore[attr-defined]
        err.http_status = status  # type: ignore[attr-defined]
        return err

    def __str__(self) -> str:
        where = f" [{self.field}]" if self.field else ""
        return f"{self.title}{where}: {self.detail}"


# --- 400 ------------------------------------------------------------------
class MalformedRequestError(DxError):
    """The body cannot be parsed: bad JSON, bad base64, lying binary header."""

    status, slug, title = 400, "malformed-request", "Malformed request"


# --- 401 / 404 / 409 / 413 / 415 -----------------------------------------
class UnauthorizedError(DxError):
    status, slug, title = 401, "unauthorized", "Missing or invalid bearer token"


class UnknownFunctionError(DxError):
    status, slug, title = 404, "unknown-function", "Unknown function"


class UnknownPreparationError(DxError):
    status, slug, title = 404, "unknown-preparation", "Unknown preparation handle"


class PreparationMismatchError(DxError):
    """A call's signature (shapes, dtypes, structure) differs from its prep's."""

    status, slug, title = 409, "preparation-mismatch", "Call does not match its preparation"


class FunctionConflictError(DxError):
    status, slug, title = 409, "function-conflict", "Name already used by other content"


class PayloadTooLargeError(DxError):
    status, slug, title = 413, "payload-too-large", "Request body too large"


class UnsupportedMediaTypeError(DxError):
    status, slug, title = 415, "unsupported-media-type", "Unsupported media type"


# --- 422: well-formed but semantically wrong ------------------------------
class InvalidArgumentError(DxError):
    status, slug, title = 422, "invalid-argument", "Invalid argument"


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


# --- 429 / 503 / 504 -------------------------------------------------------
class TooManyFunctionsError(DxError):
    status, slug, title = 429, "too-many-functions", "Function limit reached"


class OverloadedError(DxError):
    status, slug, title = 503, "overloaded", "Server overloaded, retry later"


class DeadlineExceededError(DxError):
    status, slug, title = 504, "deadline-exceeded", "Computation timed out"


class InternalError(DxError):
    status, slug, title = 500, "internal", "Internal error"


def _subclasses(cls: type[DxError]) -> list[type[DxError]]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_subclasses(sub))
    return out


_BY_SLUG: dict[str, type[DxError]] = {c.slug: c for c in [DxError, *_subclasses(DxError)]}
_BY_STATUS: dict[int, type[DxError]] = {}
for _cls in [DxError, *_subclasses(DxError)]:
    _BY_STATUS.setdefault(_cls.status, _cls)
