"""A client that survives: expired prep handles are prepared again (once), versions,
``py.typed``, and a clear error for functions JAX cannot trace.

The re-preparation tests use a real server that keeps one prep handle
(``DXSERVE_MAX_PREPARED=1``), so preparing a second operator evicts the first.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import re
import subprocess
import sys
from pathlib import Path

import httpx
import jax
import numpy as np
import pytest

import dxclient
import dxserve
from dxclient import AsyncClient, Client
from dxcontract.errors import UnknownPreparationError

REPO = Path(__file__).resolve().parents[2]

X = np.array([1.0, 2.0, 3.0])
GRADIENT = np.array([-400.0, 1002.0, -200.0])


def _prepare_count(url: str, operator: str) -> float:
    """``dxserve_requests`` for ``POST /prepare/<operator>`` answered 200."""
    text = httpx.get(url + "/metrics").text
    pattern = rf'dxserve_requests_total{{route="/prepare/{operator}",status="200"}} (\S+)'
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0


@pytest.fixture
def small_server(make_server):
    return make_server(env={"DXSERVE_MAX_PREPARED": "1"})


def test_expired_handle_is_prepared_again_once(small_server) -> None:
    with Client(small_server.url) as client:
        prep = client.prepare_gradient("rosenbrock", "jax-reverse", X)
        np.testing.assert_allclose(client.gradient("rosenbrock", "jax-reverse", X, prep=prep), GRADIENT)
        client.prepare_hvp("rosenbrock", "auto", X, (np.ones(3),))  # evicts ``prep``
        dropped = httpx.post(small_server.url + "/gradient", json={
            "function": "rosenbrock", "backend": "jax-reverse", "x": X.tolist(),
            "prep": prep.handle,
        })
        assert dropped.status_code == 404 and "unknown-preparation" in dropped.json()["type"]
        before = _prepare_count(small_server.url, "gradient")
        np.testing.assert_allclose(client.gradient("rosenbrock", "jax-reverse", X, prep=prep), GRADIENT)
        assert _prepare_count(small_server.url, "gradient") == before + 1
        # the renewed handle is remembered: the next call does not prepare again
        np.testing.assert_allclose(client.gradient("rosenbrock", "jax-reverse", X, prep=prep), GRADIENT)
        assert _prepare_count(small_server.url, "gradient") == before + 1


def test_async_client_prepares_again(small_server) -> None:
    async def run() -> np.ndarray:
        async with AsyncClient(small_server.url) as client:
            prep = await client.prepare_gradient("rosenbrock", "jax-reverse", X)
            await client.prepare_value("rosenbrock", "auto", X)  # evicts ``prep``
            return await client.gradient("rosenbrock", "jax-reverse", X, prep=prep)

    np.testing.assert_allclose(asyncio.run(run()), GRADIENT)


def test_prepared_again_only_once() -> None:
    """A server that never keeps a handle: one re-preparation, then the 404 surfaces."""
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path.startswith("/prepare/"):
            body = {"prep": f"h{len(seen)}", "operator": "gradient", "function": "f",
                    "backend": "auto", "resolved": {"type": "jax-reverse"}}
            return httpx.Response(200, json=body)
        problem = {"type": "urn:dxserve:problem:unknown-preparation", "title": "gone",
                   "status": 404, "detail": "no prepared operator", "field": "prep"}
        return httpx.Response(404, json=problem, headers={"content-type": "application/problem+json"})

    with Client("http://test", transport=httpx.MockTransport(answer), encoding="json") as client:
        prep = client.prepare_gradient("f", "auto", X)
        with pytest.raises(UnknownPreparationError):
            client.gradient("f", "auto", X, prep=prep)
    assert seen == ["/prepare/gradient", "/gradient", "/prepare/gradient", "/gradient"]


def test_versions_come_from_package_metadata() -> None:
    from importlib.metadata import version

    assert dxserve.__version__ == version("dxserve")
    assert dxclient.__version__ == version("dxserve-client")
    out = subprocess.run(
        [sys.executable, "-m", "dxserve.cli", "--version"], capture_output=True, text=True,
        timeout=120, check=True,
    ).stdout
    assert out.strip() == f"dxserve {dxserve.__version__}"


@pytest.mark.parametrize(("project", "package"), [(".", "dxserve"), ("clients/python", "dxclient")])
def test_py_typed_is_installed(project: str, package: str, tmp_path: Path) -> None:
    """setuptools' build (what a wheel holds) copies the ``py.typed`` marker."""
    assert (importlib.resources.files(package) / "py.typed").is_file()
    subprocess.run(
        [sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py",
         "-d", str(tmp_path)],
        cwd=REPO / project, check=True, capture_output=True, timeout=120,
    )
    assert (tmp_path / package / "py.typed").is_file()


def _numpy_only(x):
    return np.sum(np.asarray(x) ** 2)


def _python_branch(x):
    return x[0] if x[0] > 0 else -x[0]


@pytest.mark.parametrize("fn", [_numpy_only, _python_branch])
def test_register_untraceable_function_says_what_to_do(fn) -> None:
    def no_request(request: httpx.Request) -> httpx.Response:
        raise AssertionError("nothing is uploaded")

    with Client("http://test", transport=httpx.MockTransport(no_request)) as client:
        with pytest.raises(TypeError) as info:
            client.register(fn, np.ones(3), platforms=("cpu",))
    message = str(info.value)
    assert fn.__name__ in message and "JAX cannot trace it" in message
    assert "register_expression" in message and "@dxserve.function" in message
    assert isinstance(info.value.__cause__, jax.errors.JAXTypeError)
