"""``Client`` and ``AsyncClient`` behave the same, method for method.

Both run one script of every non-operator method (and an operator call and a
preparation) against their own fresh in-process app: the sync client through
Starlette's ``TestClient``, the async one through ``httpx.ASGITransport``. Results and
errors must match each other and what the server is known to answer.
"""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import Any

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

from dxclient import AsyncClient, Client, RemoteFunction, RemotePrep
from dxcontract.errors import DxError, FunctionConflictError, UnknownFunctionError, UnknownJobError

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")

X = np.array([1.0, 2.0, 3.0])


def squares(x: Any) -> Any:
    return jnp.sum(x**2)


# (method, args, kwargs): every public method that is not an operator.
SCRIPT: list[tuple[str, tuple, dict]] = [
    ("health", (), {}),
    ("ready", (), {}),
    ("backends", (), {}),
    ("functions", (), {}),
    ("function", ("rosenbrock",), {}),
    ("function", ("no_such_function",), {}),
    ("register_expression", ("cube", "jnp.sum(x ** 3)"), {"description": "cubes"}),
    ("register_expression", ("cube", "jnp.sum(x ** 4)"), {}),  # taken: conflict
    ("register_expression", ("cube", "jnp.sum(x ** 4)"), {"replace": True}),
    ("function", ("cube",), {}),
    ("gradient", ("cube", "jax-reverse", X), {}),
    ("prepare_gradient", ("cube", "jax-reverse", X), {}),
    ("register", (squares, X), {"platforms": ["cpu"], "description": "exported"}),
    ("register", (squares, X), {"name": "squares_too"}),  # platforms from GET /ready
    ("value", ("squares_too", "auto", X), {}),
    ("delete", ("cube",), {}),
    ("delete", (RemoteFunction("squares_too"),), {}),
    ("delete", ("cube",), {}),  # gone
    ("functions", (), {}),
    ("ready", (), {}),
    ("register_kind", ("quad", {"expression": "jnp.sum(x ** 4)", "args": ["x"]}), {}),
    ("gradient", ("quad", "jax-reverse", X), {}),
    ("jobs", (), {}),
    ("job", ("no-such-job-0000",), {}),
]

NON_OPERATOR_METHODS = {
    "health", "ready", "backends", "functions", "function", "register",
    "register_expression", "register_kind", "delete", "job", "jobs",
}  # fmt: skip


def _outcome(value: Any) -> Any:
    if isinstance(value, RemotePrep):
        return ("prep", value.operator, value.function, value.resolved)
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.tolist())
    return value


def _app(store: Path) -> Any:
    from dxserve.http import create_app
    from dxserve.settings import Settings

    return create_app(Settings(store=store, compilation_cache="", functions=["dxserve.examples"]))


def _sync_run(store: Path) -> list[Any]:
    from starlette.testclient import TestClient

    outcomes = []
    with TestClient(_app(store)) as http:
        client = Client(http=http)
        for method, args, kwargs in SCRIPT:
            try:
                outcomes.append(_outcome(getattr(client, method)(*args, **kwargs)))
            except DxError as exc:
                outcomes.append((type(exc), str(exc)))
    return outcomes


def _async_run(store: Path) -> list[Any]:
    async def main() -> list[Any]:
        outcomes = []
        transport = httpx.ASGITransport(app=_app(store))
        async with AsyncClient("http://testserver", transport=transport) as client:
            for method, args, kwargs in SCRIPT:
                try:
                    outcomes.append(_outcome(await getattr(client, method)(*args, **kwargs)))
                except DxError as exc:
                    outcomes.append((type(exc), str(exc)))
        return outcomes

    return asyncio.run(main())


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    return {
        "sync": _sync_run(tmp_path_factory.mktemp("sync")),
        "async": _async_run(tmp_path_factory.mktemp("async")),
    }


def test_script_covers_every_non_operator_method() -> None:
    from dxcontract.operators import OPERATORS

    operators = set(OPERATORS) | {f"prepare_{n}" for n in OPERATORS}
    # scipy() builds a sync-only adapter over the operators (tests/client/test_scipy_adapter.py)
    public = {
        name for name, _ in inspect.getmembers(Client, callable)
        if not name.startswith("_") and name not in operators and name not in ("close", "scipy")
    }  # fmt: skip
    assert public == NON_OPERATOR_METHODS
    assert NON_OPERATOR_METHODS <= {method for method, _, _ in SCRIPT}


def test_sync_and_async_clients_agree(outcomes: dict[str, list[Any]]) -> None:
    for step, sync, asynchronous in zip(SCRIPT, outcomes["sync"], outcomes["async"], strict=True):
        assert sync == asynchronous, step


def test_outcomes_are_the_servers_answers(outcomes: dict[str, list[Any]]) -> None:
    got = dict(enumerate(outcomes["sync"]))
    assert got[0] == {"status": "ok"}
    assert got[1]["status"] == "ready" and got[1]["export_platforms"]
    assert {b["type"] for b in got[2]} >= {"auto", "jax-forward", "jax-reverse", "second-order"}
    assert "rosenbrock" in {f.name for f in got[3]}
    assert (got[4].name, got[4].kind) == ("rosenbrock", "module") and got[4].description
    assert got[5][0] is UnknownFunctionError
    assert got[6] == RemoteFunction("cube", "expression", "cubes")
    assert got[7][0] is FunctionConflictError
    assert got[9] == RemoteFunction("cube", "expression", "")
    assert got[10] == ("array", "<f8", [4.0, 32.0, 108.0])  # 4 x^3
    assert got[11][:2] == ("prep", "gradient")
    assert got[12] == RemoteFunction("squares", "export", "exported")
    assert got[13] == RemoteFunction("squares_too", "export", "")
    assert got[14] == ("array", "<f8", 14.0)
    assert got[15] is None and got[16] is None
    assert got[17][0] is UnknownFunctionError
    names = {f.name for f in got[18]}
    assert "squares" in names and not names & {"cube", "squares_too"}
    assert got[19]["functions"] == got[1]["functions"] + 1
    assert got[20] == RemoteFunction("quad", "expression", "")
    assert got[21] == ("array", "<f8", [4.0, 32.0, 108.0])  # 4 x^3
    assert got[22] == []  # no jobs yet
    assert got[23][0] is UnknownJobError


@pytest.mark.parametrize("cls, http_cls", [(Client, httpx.Client), (AsyncClient, httpx.AsyncClient)])
def test_construction_is_shared(cls: type, http_cls: type) -> None:
    """The same arguments give the same set-up; a token is added to a given ``http``."""
    made = cls("http://example.test:9", token="s3cret", timeout=3.0, encoding="json")
    given = cls(http=http_cls(base_url="http://example.test:9"), token="s3cret")
    for client in (made, given):
        assert isinstance(client.http, http_cls)
        assert client.http.headers["authorization"] == "Bearer s3cret"
        assert str(client.http.base_url) == "http://example.test:9"
    assert made.encoding == "json" and given.encoding == "binary"
    assert made.http.timeout == httpx.Timeout(3.0)


def test_context_managers_close_the_http_client() -> None:
    with Client("http://example.test") as client:
        pass
    assert client.http.is_closed

    async def main() -> AsyncClient:
        async with AsyncClient("http://example.test") as client:
            pass
        return client

    assert asyncio.run(main()).http.is_closed
