"""The client names any backend type the server lists in ``GET /backends``, plug-ins
included, with or without parameters, although its own process has never heard of
them; an unknown name is refused by the server before anything runs, with a 422 that
the client raises as ``InvalidBackendError`` listing the types the server knows."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from dxclient import AsyncClient, Client
from dxcontract.backends import BACKEND_TYPES, backend_to_json
from dxcontract.errors import InvalidBackendError
from tests.conftest import ServerProcess, start_server, stop_server
from tests.references import rosenbrock_gradient

X = np.array([1.0, 2.0, 3.0, 0.5])




@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("backend-names"),
                          modules=("dxserve.examples", "tests.server_only_backend"))
    try:
        yield server
    finally:
        stop_server(server)


def test_this_process_does_not_know_the_plug_in() -> None:
    assert "imaginary-step" not in BACKEND_TYPES


@pytest.mark.parametrize("backend", [
    "imaginary-step", {"type": "imaginary-step"}, {"type": "imaginary-step", "h": 1e-40},
])
def test_a_server_side_plug_in_by_name(srv: ServerProcess, backend) -> None:
    with Client(srv.url) as client:
        assert "imaginary-step" in {b["type"] for b in client.backends()}
        g = client.gradient("rosenbrock", backend, X)
        # complex steps have no subtraction: exact to rounding
        np.testing.assert_allclose(g, rosenbrock_gradient(X), rtol=1e-13)
        y, (jvp,) = client.value_and_pushforward("rosenbrock", backend, X, (np.ones(4),))
        np.testing.assert_allclose(jvp, rosenbrock_gradient(X).sum(), rtol=1e-13)


def test_from_the_async_client(srv: ServerProcess) -> None:
    import asyncio

    async def go() -> np.ndarray:
        async with AsyncClient(srv.url) as client:
            return await client.gradient("rosenbrock", "imaginary-step", X)

    np.testing.assert_allclose(asyncio.run(go()), rosenbrock_gradient(X), rtol=1e-13)


def test_nested_in_second_order_the_name_travels_as_written() -> None:
    nested = {"type": "second-order", "outer": "made-up-step", "inner": "jax-reverse"}
    assert backend_to_json(nested) == nested
    assert backend_to_json("made-up-step") == {"type": "made-up-step"}
    assert backend_to_json("jax-reverse") == {"type": "jax-reverse"}


def test_an_unknown_name_fails_before_anything_runs(srv: ServerProcess) -> None:
    with Client(srv.url) as client, pytest.raises(InvalidBackendError) as info:
        client.gradient("rosenbrock", "imaginary-stpe", X)
    assert info.value.field == "backend.type"
    assert "imaginary-step" in info.value.detail and "jax-reverse" in info.value.detail


def test_a_known_type_with_a_wrong_parameter_is_refused_in_the_client() -> None:
    with Client("http://127.0.0.1:9") as client, pytest.raises(InvalidBackendError) as info:
        client.gradient("rosenbrock", {"type": "jax-reverse", "stpe": 1}, X)  # never sent
    assert info.value.field == "backend.stpe"
