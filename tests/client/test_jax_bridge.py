"""dxclient.jax: a served function inside jax.jit, grad, jacfwd, hessian and vmap.

Runs against the real server (``server`` fixture); every transformation is compared
with the same transformation of the local function at rtol 1e-12, and the server's
per-route request counts show which operators answered (second order: ``/hvp``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dxclient import Client
from dxclient.jax import remote_function

RTOL = 1e-12


def rosenbrock(x):
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def least_squares(params, X, Y):
    residual = X @ params["w"] + params["b"] - Y
    return 0.5 * jnp.sum(residual**2) / X.shape[0]


@pytest.fixture(autouse=True)
def x64() -> Iterator[None]:
    with jax.enable_x64(True):
        yield


@pytest.fixture
def client(server) -> Iterator[Client]:
    with Client(server.url) as c:
        yield c


def counts(client: Client) -> dict[str, int]:
    """Requests answered per route, from the server's /metrics."""
    text = client.http.get("/metrics").text
    out: dict[str, int] = {}
    for route, n in re.findall(r'^dxserve_requests_total\{route="([^"]+)",status="200"\} (\S+)', text, re.M):
        out[route] = out.get(route, 0) + int(float(n))
    return out


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)
            and k != "/metrics"}


X = np.array([1.2, 0.7, -0.3, 2.0])
XS = np.stack([X, X + 0.5, -X])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_first_and_second_order_match_local(client: Client, jit: bool) -> None:
    g = remote_function(client, "rosenbrock")
    wrap = jax.jit if jit else (lambda f: f)
    cases = [(lambda f: f, X), (jax.grad, X), (jax.jacfwd, X), (jax.jacrev, X),
             (jax.hessian, X), (lambda f: jax.vmap(jax.grad(f)), XS)]
    for transform, x in cases:
        want = transform(rosenbrock)(x)
        got = wrap(transform(g))(x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL)


def test_vmap_of_grad(client: Client) -> None:
    g = remote_function(client, "rosenbrock")
    for f in (jax.vmap(jax.grad(g)), jax.jit(jax.vmap(jax.grad(g)))):
        np.testing.assert_allclose(f(XS), jax.vmap(jax.grad(rosenbrock))(XS), rtol=RTOL)
    np.testing.assert_allclose(
        jax.jit(jax.vmap(jax.hessian(g)))(XS), jax.vmap(jax.hessian(rosenbrock))(XS), rtol=RTOL
    )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_hessian_goes_through_hvp(client: Client, jit: bool) -> None:
    g = remote_function(client, "rosenbrock")
    hess = jax.jit(jax.hessian(g)) if jit else jax.hessian(g)
    g(X)  # learns the output's shape (one /value request per input signature)
    before = counts(client)
    H = hess(X)
    used = delta(before, counts(client))
    np.testing.assert_allclose(H, jax.hessian(rosenbrock)(X), rtol=RTOL)
    # all n Hessian columns travel as one batch of tangents in one /hvp request; under
    # jit XLA drops the unused value_and_gradient callback
    assert used == ({"/hvp": 1} if jit else {"/value_and_gradient": 1, "/hvp": 1}), used


def test_second_order_forms_reach_hvp(client: Client) -> None:
    g = remote_function(client, "rosenbrock")
    t = np.array([0.3, -1.0, 0.5, 2.0])
    g(X)
    before = counts(client)
    y, hv = jax.jvp(jax.grad(g), (X,), (t,))
    assert delta(before, counts(client)).get("/hvp") == 1
    np.testing.assert_allclose(hv, jax.hessian(rosenbrock)(X) @ t, rtol=RTOL)
    np.testing.assert_allclose(y, jax.grad(rosenbrock)(X), rtol=RTOL)

    def loss(f):
        return lambda x: jnp.sum(jnp.sin(jax.grad(f)(x)) ** 2)

    for wrap in (lambda f: f, jax.jit):
        before = counts(client)
        got = wrap(jax.grad(loss(g)))(X)
        assert delta(before, counts(client)).get("/hvp") == 1
        np.testing.assert_allclose(got, jax.grad(loss(rosenbrock))(X), rtol=RTOL)
    assert "/finite_differences" not in counts(client)


def test_jvp_and_vjp(client: Client) -> None:
    g = remote_function(client, "rosenbrock")
    t = np.array([0.3, -1.0, 0.5, 2.0])
    y, ty = jax.jvp(g, (X,), (t,))
    np.testing.assert_allclose(ty, jax.jvp(rosenbrock, (X,), (t,))[1], rtol=RTOL)
    y, pull = jax.vjp(g, X)
    np.testing.assert_allclose(pull(2.0)[0], 2.0 * jax.grad(rosenbrock)(X), rtol=RTOL)


def test_array_output_pushforward_and_pullback(client: Client) -> None:
    g = remote_function(client, "sin_cumsum")

    def local(x):
        return jnp.sin(x) * jnp.cumsum(x)

    g(X)
    before = counts(client)
    J = jax.jacfwd(g)(X)
    assert delta(before, counts(client)).get("/pushforward") == 1  # n tangents, one request
    np.testing.assert_allclose(J, jax.jacfwd(local)(X), rtol=RTOL)
    before = counts(client)
    np.testing.assert_allclose(jax.jit(jax.jacrev(g))(X), jax.jacrev(local)(X), rtol=RTOL)
    assert delta(before, counts(client)).get("/pullback") == 1
    y, pull = jax.vjp(g, X)
    np.testing.assert_allclose(pull(jnp.ones(4))[0], jax.vjp(local, X)[1](jnp.ones(4))[0], rtol=RTOL)
    np.testing.assert_allclose(jax.vmap(g)(XS), jax.vmap(local)(XS), rtol=RTOL)


def test_contexts_and_pytree_x(client: Client) -> None:
    g = remote_function(client, "least_squares")
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(3, 2)), "b": rng.normal(size=2)}
    Xd, Yd = rng.normal(size=(8, 3)), rng.normal(size=(8, 2))
    got = jax.jit(jax.grad(g))(params, Xd, Yd)
    want = jax.grad(least_squares)(params, Xd, Yd)
    for k in params:
        np.testing.assert_allclose(got[k], want[k], rtol=RTOL)
    t = {"w": np.ones((3, 2)), "b": -np.ones(2)}
    hv = jax.jvp(lambda p: jax.grad(g)(p, Xd, Yd), (params,), (t,))[1]
    hv_want = jax.jvp(lambda p: jax.grad(least_squares)(p, Xd, Yd), (params,), (t,))[1]
    for k in params:
        np.testing.assert_allclose(hv[k], hv_want[k], rtol=RTOL, atol=1e-14)


def test_third_order_is_refused(client: Client) -> None:
    g = remote_function(client, "rosenbrock")
    with pytest.raises(TypeError, match="third order"):
        jax.jacfwd(jax.hessian(g))(X)


def test_batched_reverse_through_the_gradient(client: Client) -> None:
    """vmap outside and inside a reverse pass through the HVP map (its transpose batched)."""
    g = remote_function(client, "rosenbrock")

    def loss(f):
        return lambda x: jnp.sum(jax.grad(f)(x) ** 2)

    np.testing.assert_allclose(
        jax.jit(jax.vmap(jax.grad(loss(g))))(XS), jax.vmap(jax.grad(loss(rosenbrock)))(XS), rtol=RTOL
    )

    def total(f):
        return lambda xs: jnp.sum(jax.vmap(jax.grad(f))(xs) ** 2)

    np.testing.assert_allclose(jax.grad(total(g))(XS), jax.grad(total(rosenbrock))(XS), rtol=RTOL)


POINTS = np.stack([X + 0.02 * k for k in range(50)])


def test_vmap_sends_one_request_for_all_points(client: Client) -> None:
    """50 points under vmap: one batched request per operator, not one per point."""
    g = remote_function(client, "rosenbrock")
    g(X)  # the output's shape is learnt once, outside the counted calls
    for transform, route in (
        (jax.vmap(g), "/value"),
        (jax.vmap(jax.grad(g)), "/value_and_gradient"),
        (jax.jit(jax.vmap(jax.grad(g))), "/value_and_gradient"),
    ):
        before = counts(client)
        got = transform(POINTS)
        assert delta(before, counts(client)) == {route: 1}
    np.testing.assert_allclose(jax.vmap(g)(POINTS), jax.vmap(rosenbrock)(POINTS), rtol=RTOL)
    np.testing.assert_allclose(got, jax.vmap(jax.grad(rosenbrock))(POINTS), rtol=RTOL)


def test_vmap_of_second_order_is_one_hvp_request(client: Client) -> None:
    """vmap(hessian): every (point, basis tangent) pair in one batched /hvp request."""
    g = remote_function(client, "rosenbrock")
    g(X)
    before = counts(client)
    H = jax.vmap(jax.hessian(g))(POINTS[:10])
    assert delta(before, counts(client)) == {"/value_and_gradient": 1, "/hvp": 1}
    np.testing.assert_allclose(H, jax.vmap(jax.hessian(rosenbrock))(POINTS[:10]), rtol=RTOL)


def test_nested_vmaps_go_flat(client: Client) -> None:
    """vmap(vmap(grad)) over a 5 x 10 grid of points: one request of 50 points."""
    g = remote_function(client, "rosenbrock")
    g(X)
    grid = POINTS.reshape(5, 10, 4)
    before = counts(client)
    got = jax.vmap(jax.vmap(jax.grad(g)))(grid)
    assert delta(before, counts(client)) == {"/value_and_gradient": 1}
    np.testing.assert_allclose(got, jax.vmap(jax.vmap(jax.grad(rosenbrock)))(grid), rtol=RTOL)


def test_vmap_of_array_output_derivatives_is_batched(client: Client) -> None:
    """jacfwd and jacrev of an array-valued function at 10 points: one request each."""
    g = remote_function(client, "sin_cumsum")

    def local(x):
        return jnp.sin(x) * jnp.cumsum(x)

    g(X)
    for transform, route in ((jax.jacfwd, "/pushforward"), (jax.jacrev, "/pullback")):
        before = counts(client)
        got = jax.vmap(transform(g))(POINTS[:10])
        used = delta(before, counts(client))
        # the linear map in one request, and the primal value (one batched /value) beside it
        assert used.get(route) == 1 and set(used) <= {route, "/value"} and sum(used.values()) <= 2, used
        np.testing.assert_allclose(got, jax.vmap(transform(local))(POINTS[:10]), rtol=RTOL)


def test_vmapped_contexts_fall_back_to_one_request_per_point(client: Client) -> None:
    """A batched request shares its contexts: contexts that differ per point cannot."""
    g = remote_function(client, "least_squares")
    rng = np.random.default_rng(1)
    params = {"w": rng.normal(size=(3, 2)), "b": rng.normal(size=2)}
    Xs, Ys = rng.normal(size=(4, 8, 3)), rng.normal(size=(4, 8, 2))
    g(params, Xs[0], Ys[0])
    before = counts(client)
    got = jax.vmap(jax.grad(g), in_axes=(None, 0, 0))(params, Xs, Ys)
    assert delta(before, counts(client)) == {"/value_and_gradient": 4}
    want = jax.vmap(jax.grad(least_squares), in_axes=(None, 0, 0))(params, Xs, Ys)
    for k in params:
        np.testing.assert_allclose(got[k], want[k], rtol=RTOL)
    before = counts(client)
    got = jax.vmap(jax.grad(g), in_axes=({"w": 0, "b": None}, None, None))(
        {"w": np.stack([params["w"], 2 * params["w"]]), "b": params["b"]}, Xs[0], Ys[0]
    )
    assert delta(before, counts(client)) == {"/value_and_gradient": 1}
    want = jax.vmap(jax.grad(least_squares), in_axes=({"w": 0, "b": None}, None, None))(
        {"w": np.stack([params["w"], 2 * params["w"]]), "b": params["b"]}, Xs[0], Ys[0]
    )
    for k in params:
        np.testing.assert_allclose(got[k], want[k], rtol=RTOL)
