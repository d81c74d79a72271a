"""The OpenAPI document says who may call what, which statuses come back, and what a
backend descriptor is (the whole union, second order and sparse included)."""

from __future__ import annotations

import json
from pathlib import Path

from dxcontract.backends import backend_from_json
from dxcontract.operators import OPERATORS

SPEC = json.loads((Path(__file__).resolve().parents[2] / "openapi" / "openapi.json").read_text())
SCHEMAS = SPEC["components"]["schemas"]


def test_bearer_scheme_on_every_token_checked_route() -> None:
    scheme = SPEC["components"]["securitySchemes"]["bearer"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    writes = [SPEC["paths"]["/functions"]["post"], SPEC["paths"]["/functions/{name}"]["delete"]]
    computes = [SPEC["paths"][f"/{name}"]["post"] for name in OPERATORS]
    computes += [SPEC["paths"][f"/prepare/{name}"]["post"] for name in OPERATORS]
    for operation in writes + computes:
        # a token when one is configured; none on a tokenless loopback server
        assert operation["security"] == [{"bearer": []}, {}], operation["operationId"]
        assert "401" in operation["responses"], operation["operationId"]
    for operation in writes:
        assert "403" in operation["responses"]
    assert "429" in SPEC["paths"]["/functions"]["post"]["responses"]  # the function limit
    for path in ("/health", "/ready", "/backends"):
        assert "security" not in SPEC["paths"][path]["get"], path
    for path in ("/functions", "/functions/{name}", "/metrics"):  # DXSERVE_PRIVATE_METADATA
        assert SPEC["paths"][path]["get"]["security"] == [{"bearer": []}, {}], path


def _union(name: str) -> dict:
    backend = SCHEMAS[name]["properties"]["backend"]
    (names,) = [s for s in backend["anyOf"] if "enum" in s]
    (objects,) = [s for s in backend["anyOf"] if "discriminator" in s]
    return {"names": names["enum"], "mapping": objects["discriminator"]["mapping"]}


def test_backend_union_is_complete() -> None:
    union = _union("HvpRequest")
    assert set(union["mapping"]) == {
        "jax-forward", "jax-reverse", "torch-forward", "torch-reverse", "finite-differences",
        "second-order", "auto", "sparse",
    }
    second = SCHEMAS["SecondOrderBackend"]
    assert set(second["required"]) == {"type", "outer", "inner"}
    assert second["additionalProperties"] is False
    sparse = SCHEMAS["SparseBackend"]["properties"]
    assert {"dense", "sparsity", "coloring", "format"} <= set(sparse)
    # every documented example and shorthand is a backend the server takes
    for name in union["names"]:
        backend_from_json(name)
    for schema in ("SecondOrderBackend", "SparseBackend", "JaxForwardBackend"):
        backend_from_json(SCHEMAS[schema]["example"])


def test_arrays_admit_non_finite_scalars() -> None:
    x = SCHEMAS["GradientRequest"]["properties"]["x"]["anyOf"]
    assert {"enum": ["NaN", "Infinity", "-Infinity"], "type": "string"} in x


def test_no_jax_named_routes() -> None:
    assert "/jvp" not in SPEC["paths"] and "/vjp" not in SPEC["paths"]


def test_a_server_without_a_token_shows_no_lock(tmp_path: Path) -> None:
    """Swagger UI draws a lock on every operation with a ``security`` requirement: a
    server that takes no token anywhere documents none (the committed document, dumped
    with a token, shows where one goes)."""
    from dxserve.http import create_app
    from dxserve.settings import Settings

    settings = Settings(store=str(tmp_path / "store"), compilation_cache="", warm_up=False)
    app = create_app(settings)
    try:
        spec = app.openapi()
    finally:
        app.state.service.close()
    assert "securitySchemes" not in spec.get("components", {})
    locked = [
        operation.get("operationId")
        for methods in spec["paths"].values()
        for operation in methods.values()
        if "security" in operation
    ]
    assert not locked, locked
