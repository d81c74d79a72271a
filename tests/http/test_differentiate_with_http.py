"""A served JAX function with a numpy piece inside (``DifferentiateWith``), over real HTTP.

The server registers ``tests.differentiate_with_functions``: a JAX loss whose numpy step
is ``DifferentiateWith(np_step, FiniteDifferences())``, and the same loss in JAX alone.
Gradients and Hessians of the first (``jax-reverse``, ``jax-forward``, ``auto``) match
JAX's of the second, computed here in float64, at finite-difference tolerances
(normwise; see ``tests/library/test_differentiate_with.py``): rtol 1e-7 at first order,
1e-5 at second.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import jax
import numpy as np
import pytest

from dxclient import Client
from tests import differentiate_with_functions as m
from tests.conftest import ServerProcess, start_server, stop_server

FIRST, SECOND = 1e-7, 1e-5
PROBLEM = "application/problem+json"
X = m.X
POINTS = np.stack([X, 0.5 * X, -X])
T = np.array([0.5, -1.0, 2.0, 0.25])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(
        Path(tmp_path_factory.mktemp("dxserve-differentiate-with")),
        modules=("tests.differentiate_with_functions",),
    )
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    with jax.enable_x64(True):
        ref = m.loss(m.jnp_step)
        return {
            "value": np.asarray(ref(X)),
            "gradient": np.asarray(jax.grad(ref)(X)),
            "hessian": np.asarray(jax.hessian(ref)(X)),
            "hvp": np.asarray(jax.hessian(ref)(X) @ T),
            "gradients": np.asarray(jax.vmap(jax.grad(ref))(POINTS)),
        }


def near(got, want, rtol: float) -> None:
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=rtol, atol=rtol * np.max(np.abs(want)))


def post(srv: ServerProcess, operator: str, **body) -> dict:
    r = httpx.post(f"{srv.url}/{operator}", json={"function": "loss_with_numpy_step", **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("backend", ["jax-reverse", "jax-forward", "auto"])
def test_gradient_and_hessian_match_the_all_jax_loss(served, reference, backend: str) -> None:
    x = X.tolist()
    near(post(served, "gradient", backend=backend, x=x)["gradient"], reference["gradient"], FIRST)
    near(post(served, "hessian", backend=backend, x=x)["hessian"], reference["hessian"], SECOND)


def test_value_hvp_and_a_batch_of_points(served, reference) -> None:
    near(post(served, "value", backend="auto", x=X.tolist())["value"], reference["value"], 1e-14)
    got = post(served, "hvp", backend="jax-reverse", x=X.tolist(), tangents=[T.tolist()])
    near(got["hvps"][0], reference["hvp"], SECOND)
    got = post(served, "gradient", backend="jax-reverse", x=POINTS.tolist(), batch_axis=0)
    near(got["gradient"], reference["gradients"], FIRST)
    # the served all-JAX loss agrees with the reference exactly
    r = httpx.post(f"{served.url}/gradient", json={
        "function": "loss_all_jax", "backend": "jax-reverse", "x": X.tolist()})
    near(r.json()["gradient"], reference["gradient"], 1e-12)


def test_through_the_client(served, reference) -> None:
    with Client(served.url) as client:
        v, g = client.value_and_gradient("loss_with_numpy_step", "auto", X)
        H = client.hessian("loss_with_numpy_step", "auto", X)
    near(v, reference["value"], 1e-14)
    near(g, reference["gradient"], FIRST)
    near(H, reference["hessian"], SECOND)


def test_a_careless_request_is_a_4xx(served) -> None:
    # the numpy step cannot take 7 numbers: the function's error, named, not a 500
    r = httpx.post(f"{served.url}/gradient", json={
        "function": "loss_with_numpy_step", "backend": "jax-reverse", "x": [0.1] * 7})
    assert 400 <= r.status_code < 500 and r.headers["content-type"].startswith(PROBLEM), r.text


def test_a_step_failing_inside_the_program_is_a_422_naming_why(served) -> None:
    """The numpy step refuses x[0] > 5 while the compiled program runs (in a callback):
    a 422 whose detail is the step's own message."""
    for operator in ("value", "gradient", "hessian"):
        r = httpx.post(f"{served.url}/{operator}", json={
            "function": "loss_with_a_domain", "backend": "jax-reverse",
            "x": [10.0, 0.0, 0.0, 0.0]})
        assert r.status_code == 422 and r.headers["content-type"].startswith(PROBLEM), r.text
        assert "x[0] must be at most 5" in r.json()["detail"], r.text
    got = post(served, "gradient", backend="jax-reverse", x=X.tolist())  # still serving
    assert np.all(np.isfinite(got["gradient"]))
