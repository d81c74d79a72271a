"""bfloat16 and float16 over HTTP: the client in every encoding, and raw JSON bodies.

A served derivative has x's dtype and the bits the library gives in process; finite
differences are refused with a 422 problem document that names the backend and what
to send instead.
"""

from __future__ import annotations

import httpx
import ml_dtypes
import numpy as np
import pytest

import dxserve
from dxclient import Client
from dxcontract.errors import UnsupportedOperatorError
from dxserve.examples import rosenbrock, sin_cumsum

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
LOW = [pytest.param(BF16, id="bfloat16"), pytest.param(F16, id="float16")]
ENCODINGS = ["binary", "b64", "json"]
X64 = np.array([0.5, 1.5, -1.0, 0.75, 1.25])
T64 = np.array([1.0, -0.5, 0.25, 2.0, -1.0])
FIX = "use jax-forward or jax-reverse, or send float32/float64"


def same(got, want, dt: np.dtype) -> None:
    """``got`` (a client's numpy array) is ``want`` (in process) bit for bit, in ``dt``."""
    want = np.asarray(want)
    assert isinstance(got, np.ndarray) and got.dtype == dt and want.dtype == dt
    assert got.shape == want.shape and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("dt", LOW)
def test_the_client_gets_the_librarys_bits_in_x_dtype(server, dt: np.dtype, encoding: str) -> None:
    x, t = X64.astype(dt), T64.astype(dt)
    with Client(server.url, encoding=encoding) as client:
        for backend in ("jax-forward", "jax-reverse", "auto"):
            same(client.gradient("rosenbrock", backend, x),
                 dxserve.gradient(rosenbrock, backend, x), dt)
            same(client.jacobian("sin_cumsum", backend, x),
                 dxserve.jacobian(sin_cumsum, backend, x), dt)
            (hv,) = client.hvp("rosenbrock", backend, x, [t])
            same(hv, dxserve.hvp(rosenbrock, backend, x, (t,))[0], dt)
            same(client.hessian("rosenbrock", backend, x),
                 dxserve.hessian(rosenbrock, backend, x), dt)
        value, grad = client.value_and_gradient("rosenbrock", "jax-reverse", x)
        assert np.asarray(value).dtype == dt and grad.dtype == dt


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("dt", LOW)
def test_finite_differences_are_refused_through_the_client(
    server, dt: np.dtype, encoding: str
) -> None:
    with Client(server.url, encoding=encoding) as client:
        with pytest.raises(UnsupportedOperatorError) as info:
            client.gradient("rosenbrock", "finite-differences", X64.astype(dt))
    err = info.value
    assert err.status == 422 and err.field == "backend"
    assert dt.name in err.detail and FIX in err.detail


@pytest.mark.parametrize("dt", LOW)
def test_raw_json_bodies_typed_low_precision(server, dt: np.dtype) -> None:
    x = {"__ndarray__": X64.tolist(), "dtype": dt.name, "shape": [5]}
    r = httpx.post(server.url + "/gradient", json={"function": "rosenbrock", "backend": "jax-reverse", "x": x})
    assert r.status_code == 200, r.text
    gradient = r.json()["gradient"]
    assert gradient["dtype"] == dt.name and gradient["shape"] == [5]
    want = np.asarray(dxserve.gradient(rosenbrock, "jax-reverse", X64.astype(dt)))
    # written as float64 numbers, each exactly the value: read back, the same bits
    assert np.array(gradient["__ndarray__"]).astype(dt).tobytes() == want.tobytes()
    assert gradient["__ndarray__"] == want.astype(np.float64).tolist()

    r = httpx.post(server.url + "/gradient", json={"function": "rosenbrock", "backend": "finite-differences", "x": x})
    assert r.status_code == 422
    assert r.headers["content-type"].startswith("application/problem+json")
    problem = r.json()
    assert problem["type"].endswith("unsupported-operator") and problem["field"] == "backend"
    assert dt.name in problem["detail"] and FIX in problem["detail"]


def test_float32_finite_differences_are_still_served(server) -> None:
    x = {"__ndarray__": X64.tolist(), "dtype": "float32", "shape": [5]}
    r = httpx.post(server.url + "/gradient", json={"function": "rosenbrock", "backend": "finite-differences", "x": x})
    assert r.status_code == 200 and r.json()["gradient"]["dtype"] == "float32"
