"""The dtype grid of ``tests/library/test_dtype_grid.py`` over a real server.

Each drawn function is registered as an expression, called through ``dxclient.Client``
with every backend and operator, checked against JAX's transformation of the same text
in the same dtype, and deleted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from dxclient import Client
from tests.library.test_dtype_grid import (
    COUNTS,
    FAST,
    FAST_TIMEOUT,
    LONG,
    LONG_TIMEOUT,
    cases,
    run_grid,
)


@pytest.fixture(scope="module")
def client(server) -> Iterator[Client]:
    with Client(server.url) as c:
        yield c


def _over_the_wire(client: Client, case: dict[str, Any]) -> None:
    name = f"grid_{abs(hash(case['text'])) % 10**12}"
    client.register_expression(name, case["text"], case["args"], replace=True)
    try:
        run_grid(case, lambda op: lambda b, *a, **k: getattr(client, op)(name, b, *a, **k), "over the wire")
    finally:
        client.delete(name)


@pytest.mark.timeout(FAST_TIMEOUT)
@settings(max_examples=FAST // 2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_dtype_grid_over_the_wire(client: Client, case: dict[str, Any]) -> None:
    _over_the_wire(client, case)


@pytest.mark.slow
@pytest.mark.timeout(LONG_TIMEOUT)
@settings(max_examples=LONG // 3, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_dtype_grid_over_the_wire_long(client: Client, case: dict[str, Any]) -> None:
    _over_the_wire(client, case)


def teardown_module() -> None:
    print("\nexamples per (place, dtype):", dict(sorted(COUNTS.items())))
