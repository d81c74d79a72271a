"""Adding a kind of function is one module: this file defines one and uses it.

``polynomial``: body field ``coefficients`` (c_0, c_1, ...), f(x) = sum_j sum_i c_i x_j**i.
It is added through ``dxserve.server.kinds.add_kind`` and then registered, differentiated,
persisted and listed like the built-in kinds, without any other change.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from pydantic import Field

import dxserve
from dxcontract.errors import InvalidArgumentError
from dxcontract.operators import OPERATORS
from dxserve.server import kinds
from dxserve.server.kinds import BaseKind, Built
from dxserve.server.registry import Registry
from dxserve.server.stores.directory import DirectoryStore

MAX_DEGREE = 64


class PolynomialKind(BaseKind):
    """sum_i c_i x**i, summed over the elements of x."""

    name = "polynomial"
    summary = "a polynomial"
    fields = {
        "coefficients": (
            list[float] | None,
            Field(None, description="c_0, c_1, ...: f(x) = sum of c_i x**i over x's elements"),
        ),
    }

    def validate(self, values: Mapping[str, Any]) -> bytes:
        coefficients = values["coefficients"]
        if not coefficients or len(coefficients) > MAX_DEGREE + 1:
            raise InvalidArgumentError(
                f"coefficients: give 1 to {MAX_DEGREE + 1} numbers", field="coefficients"
            )
        if not all(math.isfinite(c) for c in coefficients):
            raise InvalidArgumentError("coefficients must be finite", field="coefficients")
        return json.dumps([float(c) for c in coefficients]).encode()

    def build(self, content: bytes) -> Built:
        coefficients = json.loads(content)

        def polynomial(x):
            acc = 0.0
            for c in reversed(coefficients):  # Horner
                acc = acc * x + c
            return acc.sum()

        return Built(polynomial, {"args": ["x"], "coefficients": coefficients})


COEFFICIENTS = [1.0, -2.0, 0.5, 3.0]  # 1 - 2x + x^2/2 + 3x^3
X = np.array([0.3, -1.2, 2.0])


def analytic_gradient(x: np.ndarray) -> np.ndarray:
    return sum(i * c * x ** (i - 1) for i, c in enumerate(COEFFICIENTS) if i)


@pytest.fixture
def polynomial_kind() -> Iterator[PolynomialKind]:
    kind = kinds.add_kind(PolynomialKind())
    try:
        yield kind
    finally:
        kinds.remove_kind("polynomial")


def test_a_kind_registers_differentiates_and_persists(
    polynomial_kind: PolynomialKind, tmp_path: Path
) -> None:
    with DirectoryStore(tmp_path) as store:
        registry = Registry(store)
        body = {"name": "cubic", "coefficients": COEFFICIENTS, "description": "a cubic"}
        entry, created = registry.register_body(body)
        assert created and entry.kind == "polynomial"
        described = entry.describe()
        assert described == {
            "name": "cubic",
            "kind": "polynomial",
            "description": "a cubic",
            "signature": {"args": ["x"], "coefficients": COEFFICIENTS},
            "digest": entry.digest,
            "created": entry.created,
            # what dxserve.server.describe tells from a signature that gives no shapes
            "arguments": [{"name": "x", "role": "x", "shape": None, "dtype": None}],
            "output": None,
            "shapes_from": None,
            "operators": list(OPERATORS),
            "example": None,
        }
        g = dxserve.gradient(entry.fn, "jax-reverse", X)
        np.testing.assert_allclose(g, analytic_gradient(X), rtol=1e-13)
        assert registry.register_body(body) == (entry, False)  # idempotent
        assert registry.registered() == 1

    # Without the kind, the stored record is not loaded (and not lost)...
    kinds.remove_kind("polynomial")
    with DirectoryStore(tmp_path) as store:
        assert Registry(store).load_store() == 0
    # ...and once the kind is added again, it is back.
    kinds.add_kind(polynomial_kind)
    with DirectoryStore(tmp_path) as store:
        registry = Registry(store)
        assert registry.load_store() == 1
        again = registry.get("cubic")
        assert (again.kind, again.digest, again.created) == ("polynomial", entry.digest, entry.created)
        g = dxserve.gradient(again.fn, "jax-reverse", X)
        np.testing.assert_allclose(g, analytic_gradient(X), rtol=1e-13)
        H = dxserve.hessian(again.fn, "auto", X)
        np.testing.assert_allclose(np.diag(H), 1.0 + 18.0 * X, rtol=1e-13)


def test_the_body_rules_include_the_new_kind(polynomial_kind: PolynomialKind) -> None:
    registry = Registry(_MemoryStore())
    with pytest.raises(InvalidArgumentError) as ei:
        registry.register_body({"name": "p"})
    assert ei.value.field == "expression"
    assert ei.value.detail == (
        "give exactly one of 'expression' (with 'args'), 'export' or 'coefficients'"
    )
    with pytest.raises(InvalidArgumentError) as ei:
        registry.register_body({"name": "p", "coefficients": [1.0], "export": "AAAA"})
    assert ei.value.field == "export"
    with pytest.raises(InvalidArgumentError) as ei:  # the kind's own validate
        registry.register_body({"name": "p", "coefficients": []})
    assert ei.value.field == "coefficients"
    with pytest.raises(InvalidArgumentError) as ei:  # its field's type, from the model
        registry.register_body({"name": "p", "coefficients": ["one"]})
    assert ei.value.field == "coefficients[0]"
    assert len(registry) == 0


def test_schemas_follow_the_kinds(polynomial_kind: PolynomialKind) -> None:
    schema = kinds.register_model().model_json_schema()
    assert "coefficients" in schema["properties"]
    assert schema["description"] == (
        "Register an expression (``expression`` + ``args``), a JAX export (``export``) "
        "or a polynomial (``coefficients``)."
    )
    assert "polynomial" in kinds.names()
    assert "polynomial" in kinds.stored_names()
    kinds.remove_kind("polynomial")
    assert "coefficients" not in kinds.register_model().model_json_schema()["properties"]
    with pytest.raises(InvalidArgumentError) as ei:  # unknown fields stay refused
        Registry(_MemoryStore()).register_body({"name": "p", "coefficients": [1.0]})
    assert ei.value.field == "coefficients"
    kinds.add_kind(polynomial_kind)


def test_add_kind_refuses_clashes(polynomial_kind: PolynomialKind) -> None:
    with pytest.raises(ValueError, match="already"):
        kinds.add_kind(PolynomialKind())
    kinds.add_kind(PolynomialKind(), replace=True)

    class Clash(PolynomialKind):
        name = "clash"

    with pytest.raises(ValueError, match="coefficients"):
        kinds.add_kind(Clash())
    with pytest.raises(TypeError):
        kinds.add_kind(object())  # type: ignore[arg-type]
    assert kinds.get_kind("clash") is None


def test_over_http(polynomial_kind: PolynomialKind, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from dxclient import Client
    from dxserve.http import create_app
    from dxserve.settings import Settings

    settings = Settings(store=str(tmp_path), compilation_cache="", functions=[])
    with TestClient(create_app(settings)) as http:
        r = http.post("/functions", json={"name": "cubic", "coefficients": COEFFICIENTS})
        assert r.status_code == 201, r.text
        assert r.json()["kind"] == "polynomial"
        assert http.get("/functions/cubic").json()["signature"]["coefficients"] == COEFFICIENTS
        r = http.post("/gradient", json={"function": "cubic", "backend": "jax-reverse",
                                         "x": X.tolist()})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["gradient"], analytic_gradient(X), rtol=1e-13)
        r = http.post("/functions", json={"name": "bad", "coefficients": []})
        assert r.status_code == 422 and r.json()["field"] == "coefficients", r.text
        kinds_listed = http.get("/openapi.json").json()["components"]["schemas"][
            "FunctionInfoModel"]["properties"]["kind"]["enum"]
        assert "polynomial" in kinds_listed
        # the Python client registers any kind by its body fields
        client = Client(http=httpx.Client(transport=http._transport, base_url="http://testserver"))
        made = client.register_kind("quadratic", {"coefficients": [0.0, 0.0, 1.0]})
        assert made.kind == "polynomial"
        np.testing.assert_allclose(client.gradient("quadratic", "jax-reverse", X), 2 * X, rtol=1e-14)


class _MemoryStore:
    """A FunctionStore that keeps nothing on disk (for body-validation tests)."""

    def __init__(self) -> None:
        self._records: dict[str, Any] = {}

    def put(self, name, kind, content, metadata, *, replace=False):  # noqa: ANN001, ANN201
        from dxserve.server.stores.directory import StoredFunction, content_digest

        record = StoredFunction(name, kind, content_digest(content), content, metadata, "now")
        created = name not in self._records
        self._records[name] = record
        return record, created

    def get(self, name):  # noqa: ANN001, ANN201
        return self._records.get(name)

    def delete(self, name):  # noqa: ANN001, ANN201
        return self._records.pop(name, None) is not None

    def list(self):  # noqa: ANN201
        return list(self._records.values())

    def __len__(self) -> int:
        return len(self._records)

    def close(self) -> None:
        pass
