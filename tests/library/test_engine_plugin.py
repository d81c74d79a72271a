"""A new engine is one ``register_backend`` call: here a black-box numpy engine.

``NumpyForward`` takes forward differences with plain numpy on concrete arrays and
implements only ``pushforward``. Gradient, Jacobian and (as the outer backend over
``jax-reverse``) HVPs come from the DI-style fallbacks, in process and over HTTP,
and the client and ``GET /backends`` know it without any other file changing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

import dxserve
from dxclient import Client
from dxserve import Engine, SecondOrder, register_backend
from dxserve.examples import rosenbrock
from dxserve.http import create_app
from dxserve.settings import Settings


@dataclass(frozen=True)
class NumpyForward:
    """Forward differences in numpy with relative step ``step``."""

    step: float = 1e-7
    type: ClassVar[str] = "numpy-forward"

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, "step": self.step}


@dataclass(frozen=True)
class NumpyForwardEngine(Engine):
    step: float
    traced: bool = True
    traces = False  # numpy: runs on concrete arrays, never inside jit
    calls: ClassVar[list[int]] = []

    def pushforward(self, g, x, tx):
        x = np.asarray(x)
        y = np.asarray(g(x))
        h = self.step * max(1.0, float(np.max(np.abs(x))))
        out = np.stack([(np.asarray(g(x + h * t)) - y) / h for t in np.asarray(tx)])
        NumpyForwardEngine.calls.append(len(out))
        return y, out


@pytest.fixture(scope="module", autouse=True)
def numpy_backend() -> Iterator[None]:
    register_backend(
        NumpyForward,
        lambda b, *, traced, nested: NumpyForwardEngine(b.step, traced),
        parameters={"step": "relative forward-difference step"},
        notes="a test engine: forward differences in numpy",
    )
    yield


def _rosen_grad(x: np.ndarray) -> np.ndarray:
    g = np.zeros_like(x)
    g[:-1] = -400 * x[:-1] * (x[1:] - x[:-1] ** 2) - 2 * (1 - x[:-1])
    g[1:] += 200 * (x[1:] - x[:-1] ** 2)
    return g


def _rosen_hess(x: np.ndarray) -> np.ndarray:
    n = len(x)
    H = np.zeros((n, n))
    for i in range(n - 1):
        H[i, i] += 1200 * x[i] ** 2 - 400 * x[i + 1] + 2
        H[i, i + 1] = H[i + 1, i] = -400 * x[i]
        H[i + 1, i + 1] += 200
    return H


X = np.array([1.0, 2.0, 3.0, 0.5])
T = np.array([1.0, -1.0, 0.5, 2.0])


def _layer(x):  # R^4 -> R^3, traceable by JAX and by numpy alike
    return np.tanh(np.arange(12.0).reshape(3, 4) / 10 @ x) if isinstance(x, np.ndarray) else (
        __import__("jax").numpy.tanh(np.arange(12.0).reshape(3, 4) / 10 @ x)
    )


def _layer_jac(x: np.ndarray) -> np.ndarray:
    A = np.arange(12.0).reshape(3, 4) / 10
    return (1 - np.tanh(A @ x) ** 2)[:, None] * A


def test_in_process_gradient_jacobian_and_hvp_over_jax_reverse() -> None:
    backend = NumpyForward()
    g = dxserve.gradient(rosenbrock, backend, X)
    np.testing.assert_allclose(g, _rosen_grad(X), rtol=1e-5)
    J = dxserve.jacobian(_layer, backend, X)
    assert J.shape == (3, 4)
    np.testing.assert_allclose(J, _layer_jac(X), rtol=1e-6, atol=1e-8)
    (hv,) = dxserve.hvp(rosenbrock, SecondOrder(backend, dxserve.JaxReverse()), X, (T,))
    np.testing.assert_allclose(hv, _rosen_hess(X) @ T, rtol=1e-5)
    # the pullback comes from the fallback too: Jᵀ c from the Jacobian's columns
    (pb,) = dxserve.pullback(_layer, backend, X, (np.ones(3),))
    np.testing.assert_allclose(pb, _layer_jac(X).T @ np.ones(3), rtol=1e-6)
    assert dxserve.backend_from_json({"type": "numpy-forward", "step": 1e-6}) == NumpyForward(1e-6)


def test_second_order_of_the_new_backend_alone_is_fd_over_itself() -> None:
    resolved = dxserve.resolve(NumpyForward(), "hvp", rosenbrock, X)
    assert resolved == SecondOrder(NumpyForward(), NumpyForward())


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory, numpy_backend: None) -> Iterator[TestClient]:
    store = tmp_path_factory.mktemp("plugin-store")
    settings = Settings(store=store, compilation_cache="", functions=["dxserve.examples"], warm_up=False)
    with TestClient(create_app(settings)) as client:
        yield client


def test_over_http_json_and_listed_in_backends(http: TestClient) -> None:
    listed = {b["type"]: b for b in http.get("/backends").json()["backends"]}
    assert listed["numpy-forward"]["parameters"] == {"step": "relative forward-difference step"}
    assert "hvp" in listed["numpy-forward"]["operators"]
    r = http.post("/gradient", json={
        "function": "rosenbrock", "backend": {"type": "numpy-forward", "step": 1e-7},
        "x": X.tolist(),
    })
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["gradient"], _rosen_grad(X), rtol=1e-5)
    r = http.post("/hvp", json={
        "function": "rosenbrock",
        "backend": {"type": "second-order", "outer": {"type": "numpy-forward"},
                    "inner": "jax-reverse"},
        "x": X.tolist(), "tangents": [T.tolist()],
    })
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["hvps"][0], _rosen_hess(X) @ T, rtol=1e-5)
    bad = http.post("/gradient", json={
        "function": "rosenbrock", "backend": {"type": "numpy-forward", "stp": 1}, "x": [1.0, 2.0],
    })
    assert bad.status_code == 422 and bad.json()["field"] == "backend.stp"


def test_through_the_client(http: TestClient) -> None:
    client = Client(http=httpx.Client(transport=http._transport, base_url="http://testserver"))
    g = client.gradient("rosenbrock", NumpyForward(), X)
    np.testing.assert_allclose(g, _rosen_grad(X), rtol=1e-5)
    J = client.jacobian("tanh_layer", {"type": "numpy-forward"}, X[:3], np.eye(2, 3))
    assert J.shape == (2, 3)
    (hv,) = client.hvp("rosenbrock", SecondOrder(NumpyForward(), dxserve.JaxReverse()), X, (T,))
    np.testing.assert_allclose(hv, _rosen_hess(X) @ T, rtol=1e-5)
