"""Errors carry no HTTP status; the server's HTTP layer maps each class to one."""

from __future__ import annotations

import json

import pytest

from dxclient import errors as E
from dxclient._models import raise_for_problem
from dxserve.core.backends.real_parts import ComplexRefused
from dxserve.http.problems import STATUS, problem_document, problem_response, status_of

# Every error class and the status the server answers it with (unchanged from when
# the classes carried their own status).
EXPECTED: dict[type[E.DxError], int] = {
    E.DxError: 400,
    E.MalformedRequestError: 400,
    E.UnauthorizedError: 401,
    E.ForbiddenError: 403,
    E.UnknownFunctionError: 404,
    E.UnknownPreparationError: 404,
    E.UnknownJobError: 404,
    E.RequestTimeoutError: 408,
    E.PreparationMismatchError: 409,
    E.FunctionConflictError: 409,
    E.JobNotFinishedError: 409,
    E.JobCancelledError: 409,
    E.PayloadTooLargeError: 413,
    E.UnsupportedMediaTypeError: 415,
    E.InvalidArgumentError: 422,
    E.ShapeMismatchError: 422,
    E.DtypeMismatchError: 422,
    E.NotScalarOutputError: 422,
    E.NotScalarInputError: 422,
    E.UnsupportedOperatorError: 422,
    ComplexRefused: 422,
    E.InvalidBackendError: 422,
    E.FunctionEvaluationError: 422,
    E.InvalidExpressionError: 422,
    E.InvalidExportError: 422,
    E.ResultTooLargeError: 422,
    E.BudgetExceededError: 422,
    E.RequestShapeError: 422,
    E.SparsityDetectionError: 422,
    E.TooManyFunctionsError: 429,
    E.TooManyQueuedError: 429,
    E.TooManyJobsError: 429,
    E.TooManyStreamsError: 429,
    E.InternalError: 500,
    E.OverloadedError: 503,
    E.DeadlineExceededError: 504,
    E.StorageFullError: 507,
}


def _all_error_classes() -> list[type[E.DxError]]:
    """Every error class a server may answer with (the client's own, raised where no
    answer came, are not among them)."""
    out, todo = [E.DxError], [E.DxError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in E.CLIENT_ONLY:
                out.append(sub)
            todo.append(sub)
    return out


def test_client_only_errors_are_never_a_problem_document() -> None:
    assert E.CLIENT_ONLY == (E.ServerUnreachableError,)
    assert E.ServerUnreachableError not in STATUS


def test_no_error_class_carries_a_status():
    for cls in _all_error_classes():
        assert not hasattr(cls, "status"), cls
        assert not hasattr(cls("detail"), "status"), cls


def test_status_of_covers_every_error_class():
    classes = _all_error_classes()
    assert set(classes) == set(EXPECTED), "add new error classes to EXPECTED"
    for cls in classes:
        assert status_of(cls) == EXPECTED[cls], cls
        assert status_of(cls("detail")) == EXPECTED[cls], cls
    assert set(STATUS) <= set(EXPECTED)


def test_status_of_refuses_other_exceptions():
    with pytest.raises(TypeError):
        status_of(ValueError)  # type: ignore[arg-type]


def test_problem_document_on_the_wire():
    err = E.OverloadedError("busy", field="x", retry_after=5)
    assert list(problem_document(err)) == [
        "type",
        "title",
        "status",
        "detail",
        "field",
        "retry_after",
    ]
    response = problem_response(err)
    assert response.status_code == 503 and response.headers["Retry-After"] == "5"
    assert response.body == (
        b'{"type":"urn:dxserve:problem:overloaded","title":"Server overloaded, retry later",'
        b'"status":503,"detail":"busy","field":"x","retry_after":5}'
    )
    plain = problem_response(E.DxError("no route"), status=404)
    assert plain.status_code == 404 and json.loads(plain.body)["status"] == 404


@pytest.mark.parametrize(
    "cls", sorted(EXPECTED, key=lambda c: c.__name__), ids=lambda c: c.__name__
)
def test_client_rebuilds_the_class_and_keeps_the_http_status(cls):
    err = cls("went wrong", field="x")
    status = status_of(err)
    body = problem_response(err).body
    with pytest.raises(E.DxError) as info:
        raise_for_problem(status, {}, body)
    # a server-side refinement travels as its contract class (its problem type)
    assert type(info.value) is (E.UnsupportedOperatorError if cls is ComplexRefused else cls)
    assert info.value.status == info.value.http_status == status
    assert info.value.problem == json.loads(body) and info.value.field == "x"


def test_client_falls_back_by_status_for_unknown_types():
    body = json.dumps({"type": "urn:dxserve:problem:from-the-future", "detail": "d"}).encode()
    for status in (400, 401, 404, 409, 413, 415, 422, 429, 500, 503, 504):
        with pytest.raises(E.DxError) as info:
            raise_for_problem(status, {}, body)
        # the fallback class is one the server answers with that very status
        assert status_of(info.value) == status and info.value.status == status
    with pytest.raises(E.DxError) as info:
        raise_for_problem(502, {}, b"<html>bad gateway</html>")
    assert type(info.value) is E.DxError and info.value.status == info.value.http_status == 502
