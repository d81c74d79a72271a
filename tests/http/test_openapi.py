"""The committed OpenAPI document is current, deterministic and complete."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from dxcontract.operators import OPERATORS, result_names
from dxserve.openapi_dump import document

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "openapi" / "openapi.json"
PROBLEM = "application/problem+json"
PROBLEM_STATUSES = ("400", "404", "409", "413", "415", "422", "503", "504")


@pytest.fixture(scope="module")
def spec() -> dict:
    return document()


def _resolve(spec: dict, schema: dict) -> dict:
    ref = schema.get("$ref")
    if ref is None:
        return schema
    assert ref.startswith("#/components/schemas/"), ref
    return spec["components"]["schemas"][ref.rsplit("/", 1)[1]]


def test_committed_document_is_current(spec: dict) -> None:
    committed = json.loads(COMMITTED.read_text())
    current = json.loads(json.dumps(spec))
    if committed != current:
        stale = sorted(
            set(committed.get("paths", {})) ^ set(current.get("paths", {}))
            | {p for p in current.get("paths", {})
               if committed.get("paths", {}).get(p) != current["paths"][p]}
        )  # fmt: skip
        pytest.fail(
            "openapi/openapi.json is out of date with the app; run `make openapi` and commit "
            f"the result (paths that differ: {stale[:10]}; components differ: "
            f"{committed.get('components') != current.get('components')})"
        )


def test_dump_is_deterministic(spec: dict) -> None:
    text = json.dumps(spec, indent=2, sort_keys=True) + "\n"
    assert text == json.dumps(document(), indent=2, sort_keys=True) + "\n"
    assert COMMITTED.read_text() == text, "run `make openapi` (the file is not in dump format)"


@pytest.mark.parametrize("name", list(OPERATORS))
def test_operator_paths_are_documented(spec: dict, name: str) -> None:
    op = OPERATORS[name]
    for path in (f"/{name}", f"/prepare/{name}"):
        post = spec["paths"][path]["post"]
        body = post["requestBody"]
        assert body["required"] is True
        request = _resolve(spec, body["content"]["application/json"]["schema"])
        assert request["properties"], path
        example = request["example"]
        assert isinstance(example["function"], str) and "x" in example
        assert ("tangents" in example) == op.takes_tangents
        assert set(request["required"]) >= {"function", "x"}
        assert body["content"]["application/vnd.dxserve.binary"]["schema"]["format"] == "binary"

        ok = post["responses"]["200"]["content"]["application/json"]["schema"]
        response = _resolve(spec, ok)
        assert response and response.get("properties"), f"{path}: empty 200 schema"
        if path.startswith("/prepare/"):
            assert set(response["properties"]) >= {"prep", "operator", "function", "resolved"}
        else:
            # aux only with has_aux: documented, never required
            assert set(response["properties"]) == set(result_names(op, op.aux))
            assert set(response["required"]) == set(op.results)
            assert "application/vnd.dxserve.binary" in post["responses"]["200"]["content"]

        for status in PROBLEM_STATUSES:
            content = post["responses"][status]["content"]
            assert list(content) == [PROBLEM], (path, status)
            assert content[PROBLEM]["schema"] == {"$ref": "#/components/schemas/Problem"}


def test_problem_and_other_routes(spec: dict) -> None:
    problem = spec["components"]["schemas"]["Problem"]
    assert set(problem["required"]) == {"type", "title", "status", "detail"}
    assert "field" in problem["properties"]
    for jax_name in ("/jvp", "/vjp"):  # no aliases: /pushforward and /pullback
        assert jax_name not in spec["paths"]
    for path in ("/health", "/ready", "/functions", "/functions/{name}", "/backends", "/metrics"):
        assert path in spec["paths"], path
    register = spec["paths"]["/functions"]["post"]
    schema = _resolve(spec, register["requestBody"]["content"]["application/json"]["schema"])
    assert schema["example"]["expression"]
    assert list(register["responses"]["401"]["content"]) == [PROBLEM]
    # every error response anywhere is a problem document
    for path, methods in spec["paths"].items():
        for method, operation in methods.items():
            for status, response in operation["responses"].items():
                if status.startswith(("4", "5")) and "content" in response:
                    assert list(response["content"]) == [PROBLEM], (path, method, status)
    assert "HTTPValidationError" not in spec["components"]["schemas"]


@pytest.mark.parametrize("name", list(OPERATORS))
def test_examples_run(server: Any, spec: dict, name: str) -> None:
    """Each operator's documented example is a request the server answers with 200."""
    request = spec["paths"][f"/{name}"]["post"]["requestBody"]["content"]["application/json"]
    example = _resolve(spec, request["schema"])["example"]
    r = httpx.post(f"{server.url}/{name}", json=example)
    assert r.status_code == 200, r.text
    assert set(r.json()) == set(OPERATORS[name].results)


def test_job_routes_are_documented(spec: dict) -> None:
    paths = spec["paths"]
    submit = paths["/jobs/{operator}"]["post"]
    (operator,) = [p for p in submit["parameters"] if p["name"] == "operator"]
    assert operator["in"] == "path" and operator["schema"]["enum"] == list(OPERATORS)
    body = submit["requestBody"]["content"]
    refs = {s["$ref"].rsplit("/", 1)[1] for s in body["application/json"]["schema"]["anyOf"]}
    assert refs == {  # the operators' own request bodies, every one
        paths[f"/{n}"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        .rsplit("/", 1)[1] for n in OPERATORS
    }
    assert body["application/vnd.dxserve.binary"]["schema"]["format"] == "binary"
    assert {"202", "404", "429", "507"} <= set(submit["responses"])
    assert "Location" in submit["responses"]["202"]["headers"]
    status = _resolve(spec, submit["responses"]["202"]["content"]["application/json"]["schema"])
    assert {"id", "status", "progress", "timings", "error"} <= set(status["properties"])
    assert set(paths["/jobs/{job_id}"]) == {"get", "delete"}
    assert "204" in paths["/jobs/{job_id}"]["delete"]["responses"]
    result = paths["/jobs/{job_id}/result"]["get"]["responses"]
    assert "409" in result and "application/vnd.dxserve.binary" in result["200"]["content"]
    events = paths["/jobs/{job_id}/events"]["get"]["responses"]["200"]["content"]
    assert list(events) == ["text/event-stream"]
    assert "limit" in {p["name"] for p in paths["/jobs"]["get"]["parameters"]}
