"""OpenAPI operationIds are the operators' and routes' own names (generated clients use them)."""

from __future__ import annotations

import json
from pathlib import Path

from dxcontract.operators import OPERATORS

SPEC = json.loads((Path(__file__).resolve().parents[2] / "openapi/openapi.json").read_text())


def test_operation_ids_are_plain_names() -> None:
    ids = {
        (path, method): operation["operationId"]
        for path, methods in SPEC["paths"].items()
        for method, operation in methods.items()
    }
    assert len(set(ids.values())) == len(ids)
    for name in OPERATORS:
        assert ids[(f"/{name}", "post")] == name
        assert ids[(f"/prepare/{name}", "post")] == f"prepare_{name}"
    assert ids[("/functions", "get")] == "list_functions"
    assert ids[("/functions", "post")] == "register_function"
    assert ids[("/functions/{name}", "get")] == "get_function"
    assert ids[("/functions/{name}", "delete")] == "delete_function"
    assert ids[("/health", "get")] == "health"
    assert ids[("/jobs/{operator}", "post")] == "submit_job"
    assert ids[("/jobs", "get")] == "list_jobs"
    assert ids[("/jobs/{job_id}", "get")] == "get_job"
    assert ids[("/jobs/{job_id}", "delete")] == "delete_job"
    assert ids[("/jobs/{job_id}/result", "get")] == "get_job_result"
    assert ids[("/jobs/{job_id}/events", "get")] == "get_job_events"
