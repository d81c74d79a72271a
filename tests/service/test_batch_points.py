"""Many points in one request: ``batch_axis=0``.

x (every leaf) and the tangents lead with an axis of B independent points, contexts
are shared, and each result comes back stacked (B, ...) from one vmapped, compiled
call. References are ``jax.vmap`` of JAX's own derivatives, at rtol 1e-12, in
process, over HTTP (raw JSON and the client in all three encodings) and through
``AsyncClient``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fastapi.testclient import TestClient

import dxserve
from dxclient import AsyncClient, Client
from dxcontract import codec
from dxcontract.errors import DxError, PreparationMismatchError
from dxserve.examples import rosenbrock, sin_cumsum
from dxserve.http import create_app
from dxserve.settings import Settings

B, N = 1000, 10
RTOL = 1e-12
rng = np.random.default_rng(13)
X = rng.normal(size=(B, N))
T = rng.normal(size=(B, N))
W = rng.normal(size=(3, N))  # a shared context of tanh_layer


def _ref(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in float64 (dxserve's own 64-bit scope), as numpy."""
    with dxserve.float64_scope():
        return jax.tree_util.tree_map(np.asarray, fn(*args))


def _close(got: Any, want: Any, rtol: float = RTOL) -> None:
    got_leaves, want_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        g = np.asarray(g)
        assert g.shape == np.shape(w)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-300)


def _hvp(f: Any) -> Any:
    return jax.vmap(lambda x, t: jax.jvp(jax.grad(f), (x,), (t,))[1])


GRAD = _ref(jax.vmap(jax.grad(rosenbrock)), X)
HVP = _ref(_hvp(rosenbrock), X, T)
JAC_ROSEN = _ref(jax.vmap(jax.jacobian(rosenbrock)), X)
JAC = _ref(jax.vmap(jax.jacobian(sin_cumsum)), X)


# --- in process ---------------------------------------------------------------
def test_in_process_gradient_hvp_jacobian_match_vmap() -> None:
    _close(dxserve.gradient(rosenbrock, "jax-reverse", X, batch_axis=0), GRAD)
    (hv,) = dxserve.hvp(rosenbrock, "auto", X, (T,), batch_axis=0)
    _close(hv, HVP)
    _close(dxserve.jacobian(rosenbrock, "auto", X, batch_axis=0), JAC_ROSEN)
    _close(dxserve.jacobian(sin_cumsum, "jax-forward", X, batch_axis=0), JAC)
    _close(dxserve.jacobian(sin_cumsum, "jax-reverse", X, batch_axis=0), JAC)


def test_in_process_other_operators() -> None:
    x, t = X[:7], T[:7]
    _close(dxserve.value(rosenbrock, "auto", x, batch_axis=0), _ref(jax.vmap(rosenbrock), x))
    v, g = dxserve.value_and_gradient(rosenbrock, "auto", x, batch_axis=0)
    _close((v, g), (_ref(jax.vmap(rosenbrock), x), GRAD[:7]))
    jvp = _ref(jax.vmap(lambda u, s: jax.jvp(sin_cumsum, (u,), (s,))[1]), x, t)
    (p1, p2) = dxserve.pushforward(sin_cumsum, "auto", x, (t, 2 * t), batch_axis=0)
    _close((p1, p2), (jvp, 2 * jvp))
    vjp = _ref(jax.vmap(lambda u, s: jax.vjp(sin_cumsum, u)[1](s)[0]), x, t)
    (q,) = dxserve.pullback(sin_cumsum, "auto", x, (t,), batch_axis=0)
    _close(q, vjp)
    _close(dxserve.hessian(rosenbrock, "auto", x, batch_axis=0),
           _ref(jax.vmap(jax.hessian(rosenbrock)), x))
    # contexts are shared by every point
    # (tanh' near 0 is tiny here: a matmul's summation order moves it ~1e-11 relatively)
    layer = _ref(jax.vmap(jax.jacobian(lambda u: jnp.tanh(W @ u))), x)
    got = dxserve.jacobian(lambda u, w: jnp.tanh(w @ u), "auto", x, W, batch_axis=0)
    _close(got, layer, rtol=1e-9)
    # scalar points: derivative and second derivative over a vector of points
    s = np.linspace(-1.0, 1.0, 5)
    _close(dxserve.second_derivative(jnp.sin, "auto", s, batch_axis=0), -np.sin(s))


def test_pytree_points_every_leaf_carries_the_axis() -> None:
    def loss(p: dict) -> Any:
        return jnp.sum(p["w"] ** 2) * p["b"]

    P = {"w": X[:4], "b": np.arange(1.0, 5.0)}
    g = dxserve.gradient(loss, "auto", P, batch_axis=0)
    want = _ref(jax.vmap(jax.grad(loss)), P)
    _close(g, want)
    assert g["w"].shape == (4, N) and g["b"].shape == (4,)


def test_black_box_functions_loop_point_by_point() -> None:
    def numpy_f(x: Any) -> float:  # not traceable by JAX: finite differences, one by one
        return float(np.sum(np.asarray(x) ** 3))

    g = dxserve.gradient(numpy_f, "auto", X[:3], batch_axis=0)
    one_by_one = np.stack([dxserve.gradient(numpy_f, "auto", x) for x in X[:3]])
    np.testing.assert_array_equal(g, one_by_one)
    np.testing.assert_allclose(g, 3 * X[:3] ** 2, rtol=1e-6, atol=1e-8)


def test_preparation_is_per_batched_signature() -> None:
    prep = dxserve.prepare_gradient(rosenbrock, "auto", X, batch_axis=0)
    _close(dxserve.gradient(rosenbrock, "auto", X, prep=prep, batch_axis=0), GRAD)
    with pytest.raises(PreparationMismatchError) as err:
        dxserve.gradient(rosenbrock, "auto", X, prep=prep)
    assert err.value.field == "batch_axis"
    # the same shapes unbatched: rosenbrock of a (B, N) matrix is another function of x
    unbatched = dxserve.prepare_gradient(rosenbrock, "auto", X[:5])
    with pytest.raises(PreparationMismatchError) as err:
        dxserve.gradient(rosenbrock, "auto", X[:5], prep=unbatched, batch_axis=0)
    assert err.value.field == "batch_axis"
    whole = _ref(jax.grad(rosenbrock), X[:5])
    _close(dxserve.gradient(rosenbrock, "auto", X[:5]), whole)
    _close(dxserve.gradient(rosenbrock, "auto", X[:5], batch_axis=0), GRAD[:5])


def test_in_process_refusals_name_the_field() -> None:
    with pytest.raises(DxError) as err:
        dxserve.gradient(rosenbrock, "auto", X, batch_axis=1)
    assert err.value.field == "batch_axis"
    with pytest.raises(DxError) as err:
        dxserve.hvp(rosenbrock, "auto", X, (T[:5],), batch_axis=0)
    assert err.value.field == "tangents[0]"
    with pytest.raises(DxError) as err:  # 1000 points * (10*10 + 10) numbers
        dxserve.core.preparation.prepare(
            "jacobian", sin_cumsum, "auto", X, None, (), max_result_elements=50_000, batch_axis=0
        )
    assert err.value.field == "x" and "1,000 points" in str(err.value)


# --- over HTTP -------------------------------------------------------------------
@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = Settings(
        store=tmp_path_factory.mktemp("batch-store"), compilation_cache="",
        functions=["dxserve.examples"], warm_up=False, max_result_elements=500_000,
    )
    with TestClient(create_app(settings)) as client:
        yield client


def _client(http: TestClient, encoding: str) -> Client:
    return Client(
        encoding=encoding,
        http=httpx.Client(transport=http._transport, base_url="http://testserver"),
    )


def test_post_gradient_hvp_jacobian_json(http: TestClient) -> None:
    base = {"function": "rosenbrock", "backend": "auto", "x": X.tolist(), "batch_axis": 0}
    r = http.post("/gradient", json=base)
    assert r.status_code == 200, r.text
    _close(np.array(r.json()["gradient"]), GRAD)
    r = http.post("/hvp", json={**base, "tangents": [T.tolist()]})
    assert r.status_code == 200, r.text
    _close(np.array(r.json()["hvps"][0]), HVP)
    r = http.post("/jacobian", json={**base, "function": "sin_cumsum"})
    assert r.status_code == 200, r.text
    _close(np.array(r.json()["jacobian"]), JAC)


@pytest.mark.parametrize("encoding", list(codec.ENCODINGS))
def test_client_in_every_encoding(http: TestClient, encoding: str) -> None:
    with _client(http, encoding) as client:
        _close(client.gradient("rosenbrock", "jax-reverse", X, batch_axis=0), GRAD)
        (hv,) = client.hvp("rosenbrock", "auto", X, (T,), batch_axis=0)
        _close(hv, HVP)
        _close(client.jacobian("rosenbrock", "auto", X, batch_axis=0), JAC_ROSEN)
        _close(client.jacobian("sin_cumsum", "auto", X, batch_axis=0), JAC)
        x, t = X[:6], T[:6]
        _close(client.value("rosenbrock", "auto", x, batch_axis=0), _ref(jax.vmap(rosenbrock), x))
        v, g = client.value_and_gradient("rosenbrock", "auto", x, batch_axis=0)
        _close((v, g), (_ref(jax.vmap(rosenbrock), x), GRAD[:6]))
        (p,) = client.pushforward("sin_cumsum", "auto", x, (t,), batch_axis=0)
        _close(p, _ref(jax.vmap(lambda u, s: jax.jvp(sin_cumsum, (u,), (s,))[1]), x, t))
        (q,) = client.pullback("sin_cumsum", "auto", x, (t,), batch_axis=0)
        _close(q, _ref(jax.vmap(lambda u, s: jax.vjp(sin_cumsum, u)[1](s)[0]), x, t))
        _close(client.hessian("rosenbrock", "auto", x, batch_axis=0),
               _ref(jax.vmap(jax.hessian(rosenbrock)), x))
        J = client.jacobian("tanh_layer", "auto", x, W, batch_axis=0)  # shared context
        _close(J, _ref(jax.vmap(jax.jacobian(lambda u: jnp.tanh(W @ u))), x), rtol=1e-9)
        prep = client.prepare_gradient("rosenbrock", "auto", X, batch_axis=0)
        _close(client.gradient("rosenbrock", "auto", X, prep=prep, batch_axis=0), GRAD)
        with pytest.raises(PreparationMismatchError) as err:
            client.gradient("rosenbrock", "auto", X, prep=prep)
        assert err.value.field == "batch_axis"


def test_repeated_calls_keep_batched_and_unbatched_apart(http: TestClient) -> None:
    # the same x shape and dtype, with and without batch_axis: the client's repeated-call
    # header, the server's memo of it and the prep cache must each tell them apart
    x = X[:5]
    whole = _ref(jax.grad(rosenbrock), x)
    with _client(http, "binary") as client:
        for _ in range(3):
            _close(client.gradient("rosenbrock", "auto", x), whole)
            _close(client.gradient("rosenbrock", "auto", x, batch_axis=0), GRAD[:5])


def test_async_client(http: TestClient) -> None:
    async def main() -> tuple:
        transport = httpx.ASGITransport(app=http.app)
        async with AsyncClient("http://dxserve.test", transport=transport) as client:
            g = await client.gradient("rosenbrock", "auto", X, batch_axis=0)
            (hv,) = await client.hvp("rosenbrock", "auto", X, (T,), batch_axis=0)
            J = await client.jacobian("sin_cumsum", "auto", X, batch_axis=0)
            return g, hv, J

    g, hv, J = asyncio.run(main())
    _close(g, GRAD)
    _close(hv, HVP)
    _close(J, JAC)


# --- hostile input ---------------------------------------------------------------
def _problem(r: httpx.Response, field: str) -> dict:
    assert 400 <= r.status_code < 500, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    problem = r.json()
    assert problem["field"] == field, problem
    return problem


def test_tangents_whose_batch_disagrees_with_x(http: TestClient) -> None:
    r = http.post("/hvp", json={
        "function": "rosenbrock", "x": X[:4].tolist(), "tangents": [T[:3].tolist()],
        "batch_axis": 0,
    })
    assert "batch_axis" in _problem(r, "tangents[0]")["detail"]
    r = http.post("/pushforward", json={  # a tangent with no axis of points at all
        "function": "sin_cumsum", "x": X[:4].tolist(), "tangents": [T[0].tolist()],
        "batch_axis": 0,
    })
    _problem(r, "tangents[0]")


def test_batch_over_the_result_limit(http: TestClient) -> None:
    # 5000 points * (10*10 + 10) numbers = 550,000 > 500,000; one point is 110
    x = np.ones((5000, N))
    r = http.post("/jacobian", json={"function": "sin_cumsum", "x": x.tolist(), "batch_axis": 0})
    problem = _problem(r, "x")
    assert r.status_code == 422 and "5,000 points" in problem["detail"]
    r = http.post("/jacobian", json={"function": "sin_cumsum", "x": x[:4000].tolist(), "batch_axis": 0})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("bad", [1, -1, 2, "0", True, 0.0, [0]])
def test_bad_batch_axis_values(http: TestClient, bad: Any) -> None:
    r = http.post("/gradient", json={"function": "rosenbrock", "x": X[:2].tolist(), "batch_axis": bad})
    assert r.status_code == 422
    assert "batch_axis" in _problem(r, "batch_axis")["detail"]


def test_other_bad_batches(http: TestClient) -> None:
    r = http.post("/gradient", json={"function": "rosenbrock", "x": 1.0, "batch_axis": 0})
    _problem(r, "x")  # a scalar has no axis of points
    r = http.post("/gradient", json={"function": "rosenbrock", "x": [], "batch_axis": 0})
    _problem(r, "x")  # no points
    r = http.post("/jacobian", json={
        "function": "sin_cumsum", "backend": "sparse", "x": X[:2].tolist(), "batch_axis": 0,
    })
    _problem(r, "batch_axis")
    with _client(http, "binary") as client, pytest.raises(DxError) as err:
        client.gradient("rosenbrock", "auto", X, batch_axis=1)
    assert err.value.field == "batch_axis"


def test_concurrent_batches_through_the_request_batcher(tmp_path: Any) -> None:
    # Concurrent requests of one prep may be merged into one call (request_batching);
    # a batch of points is then a batch of batches, and each answer must still be its own.
    from dxserve.server.service import Service

    service = Service(Settings(
        store=tmp_path, compilation_cache="", functions=["dxserve.examples"], warm_up=False,
        batch_wait=0.005, inline_below=0.0,
    ))
    parts = [X[i * 50:(i + 1) * 50] for i in range(8)]

    async def main() -> list:
        await service.gradient("rosenbrock", "auto", parts[0], batch_axis=0)  # prepare once
        return await asyncio.gather(*(
            service.gradient("rosenbrock", "auto", p, batch_axis=0) for p in parts
        ))

    try:
        results = asyncio.run(main())
    finally:
        service.close()
    for i, g in enumerate(results):
        _close(g, GRAD[i * 50:(i + 1) * 50])
