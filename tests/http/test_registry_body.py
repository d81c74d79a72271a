"""``Registry.register_body``: a decoded ``POST /functions`` body in, a published entry out.

The rules and error messages are those of the HTTP route it replaces.
"""

from __future__ import annotations

import base64
import threading
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import dxserve
from dxclient.export import export_function
from dxcontract.errors import (
    FunctionConflictError,
    InvalidArgumentError,
    InvalidExportError,
    InvalidExpressionError,
    MalformedRequestError,
)
from dxserve.server.registry import Registry
from dxserve.server.stores.directory import DirectoryStore


@pytest.fixture
def registry(tmp_path: Path):
    with DirectoryStore(tmp_path) as store:
        yield Registry(store, max_functions=500)


def test_expression(registry: Registry) -> None:
    body = {"name": "sq", "expression": "jnp.sum(jnp.sin(x) ** 2) * a", "args": ["x", "a"],
            "description": "sum of squared sines"}
    entry, created = registry.register_body(body)
    assert created and entry.kind == "expression"
    assert entry.describe()["signature"] == {"args": ["x", "a"],
                                             "expression": "jnp.sum(jnp.sin(x) ** 2) * a"}
    x = np.array([0.1, 0.7])
    g = dxserve.gradient(entry.fn, "jax-reverse", x, 3.0)
    np.testing.assert_allclose(g, 3.0 * np.sin(2 * x), rtol=1e-13)
    assert registry.register_body(body) == (entry, False)
    with pytest.raises(FunctionConflictError):
        registry.register_body(body | {"expression": "jnp.sum(x)", "args": ["x"]})
    replaced, created = registry.register_body(
        {"name": "sq", "expression": "jnp.sum(x)", "replace": True}
    )
    assert created and replaced.signature == {"args": ["x"], "expression": "jnp.sum(x)"}


def test_export(registry: Registry) -> None:
    bundle = export_function(lambda x: jnp.sum(x**3), np.ones(3))
    entry, created = registry.register_body(
        {"name": "cube", "export": base64.b64encode(bundle).decode()}
    )
    assert created and entry.kind == "export"
    x = np.array([1.0, -2.0, 0.5])
    np.testing.assert_allclose(dxserve.gradient(entry.fn, "jax-reverse", x), 3 * x**2)


@pytest.mark.parametrize(
    ("body", "error", "field", "detail"),
    [
        ([1, 2], MalformedRequestError, "body", "the body must be a JSON object"),
        ({"expression": "x"}, InvalidArgumentError, "name", "name: Field required"),
        ({"name": "1x", "expression": "x"}, InvalidArgumentError, "name", None),
        ({"name": "f", "expression": "x", "kind": "module"}, InvalidArgumentError, "kind",
         "kind: Extra inputs are not permitted"),
        ({"name": "f", "args": [1]}, InvalidArgumentError, "args[0]", None),
        ({"name": "f"}, InvalidArgumentError, "expression",
         "give exactly one of 'expression' (with 'args') or 'export'"),
        ({"name": "f", "expression": "x", "export": "AAAA"}, InvalidArgumentError, "expression",
         "give exactly one of 'expression' (with 'args') or 'export'"),
        ({"name": "f", "export": "not base64!"}, MalformedRequestError, "export",
         "export must be base64"),
        ({"name": "f", "export": "AAAA"}, InvalidExportError, "export", None),
        ({"name": "f", "expression": "open('x')"}, InvalidExpressionError, "expression", None),
        ({"name": "f", "expression": "x", "args": ["__x"]}, InvalidExpressionError, "args", None),
    ],
)
def test_refused(registry: Registry, body, error, field, detail) -> None:  # noqa: ANN001
    with pytest.raises(error) as ei:
        registry.register_body(body)
    assert ei.value.field == field
    if detail is not None:
        assert ei.value.detail == detail
    assert len(registry) == 0 and len(registry.store) == 0


def test_register_takes_stored_kinds_only(registry: Registry) -> None:
    with pytest.raises(InvalidArgumentError) as ei:
        registry.register("f", "module", b"os:system")
    assert ei.value.field == "kind"


def test_reads_during_concurrent_registrations(registry: Registry) -> None:
    errors: list[BaseException] = []
    done = threading.Event()

    def write(t: int) -> None:
        try:
            for i in range(40):
                registry.register_body({"name": f"f{t}_{i}", "expression": f"jnp.sum(x) * {i}"})
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def read() -> None:
        try:
            while not done.is_set():
                registry.list()
                registry.registered()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    writers = [threading.Thread(target=write, args=(t,)) for t in range(3)]
    readers = [threading.Thread(target=read) for _ in range(2)]
    for thread in readers + writers:
        thread.start()
    for thread in writers:
        thread.join()
    done.set()
    for thread in readers:
        thread.join()
    assert not errors, errors
    assert registry.registered() == 120 and len(registry.list()) == 120
