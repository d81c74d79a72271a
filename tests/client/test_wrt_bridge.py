"""``wrt`` over HTTP, through the client and the JAX bridge, against a real server.

One server (``tests.wrt_functions``) for the module: raw requests name ``wrt`` (and
the 422s name it), the client's methods and detached jobs take ``wrt=``, and
``remote_function`` differentiates its contexts under ``jax.grad``/``hessian``/
``jacrev``/``jacfwd``/``vmap``/``jit`` with ``argnums``, as JAX does on the local
function (float64, rtol 1e-10): never zeros. Typed PRNG key contexts cross the
bridge, an ``AsyncClient`` is refused naming ``Client``, and second order of an
array-valued served function (``jacfwd(jacrev(g))``) is exact.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dxclient import AsyncClient, Client
from dxclient.jax import remote_function
from dxcontract.errors import DtypeMismatchError, InvalidArgumentError
from tests import wrt_functions as m
from tests.conftest import ServerProcess, start_server, stop_server

RTOL = 1e-10
RNG = np.random.default_rng(7)
W = RNG.normal(size=(2, 2))
DATA = RNG.normal(size=(3, 2))
SCALE = np.asarray(1.5)
KEY = jax.random.key(3)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path_factory.mktemp("wrt"), modules=("tests.wrt_functions",))
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(autouse=True)
def x64() -> Iterator[None]:
    with jax.enable_x64(True):
        yield


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.url) as c:
        yield c


def near(got: Any, want: Any, rtol: float = RTOL) -> None:
    """Leaf by leaf, at the scale of the whole result (some blocks are zeros)."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    scale = max(float(np.max(np.abs(w))) for w in jax.tree.leaves(want))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=rtol * scale)


def counts(client: Client) -> dict[str, int]:
    text = client.http.get("/metrics").text
    out: dict[str, int] = {}
    for route, n in re.findall(
        r'^dxserve_requests_total\{route="([^"]+)",status="200"\} (\S+)', text, re.M
    ):
        out[route] = out.get(route, 0) + int(float(n))
    return out


def test_raw_requests_name_wrt(server: ServerProcess) -> None:
    body = {"function": "wrt_loss", "x": W.tolist(), "contexts": [DATA.tolist()], "wrt": 1}
    r = httpx.post(server.url + "/gradient", json=body)
    assert r.status_code == 200, r.text
    near(np.asarray(r.json()["gradient"]), jax.grad(m.wrt_loss, 1)(W, DATA))
    r = httpx.post(server.url + "/gradient", json={**body, "wrt": [1, 0]})
    assert r.status_code == 200, r.text
    items = r.json()["gradient"]["__tuple__"]
    near(tuple(np.asarray(v) for v in items), jax.grad(m.wrt_loss, (1, 0))(W, DATA))
    for wrt, field in ((2, "wrt"), ([0, 3], "wrt[1]"), ("x", "wrt"), ([0, 0], "wrt")):
        r = httpx.post(server.url + "/gradient", json={**body, "wrt": wrt})
        assert r.status_code == 422, r.text
        assert r.headers["content-type"].startswith("application/problem+json")
        assert r.json()["field"] == field
    body = {
        "function": "wrt_power",
        "x": [1.0, 2.0],
        "contexts": [{"__ndarray__": [3], "dtype": "int64", "shape": [1]}],
        "wrt": [0, 1],
    }
    r = httpx.post(server.url + "/gradient", json=body)
    assert r.status_code == 422 and r.json()["field"] == "wrt[1]", r.text
    assert "contexts[0]" in r.json()["detail"]


@pytest.mark.parametrize("encoding", ["json", "binary"])
def test_client_methods_take_wrt(server: ServerProcess, encoding: str) -> None:
    with Client(server.url, encoding=encoding) as c:
        near(c.gradient("wrt_loss", "auto", W, DATA, wrt=1), jax.grad(m.wrt_loss, 1)(W, DATA))
        near(
            c.hessian("wrt_loss", "auto", W, DATA, wrt=(0, 1)),
            jax.hessian(m.wrt_loss, (0, 1))(W, DATA),
        )
        near(
            c.jacobian("wrt_layer", "auto", W, DATA, SCALE, wrt=[2, 0]),
            jax.jacrev(m.wrt_layer, (2, 0))(W, DATA, SCALE),
        )
        t = (RNG.normal(size=W.shape), RNG.normal(size=DATA.shape))
        (push,) = c.pushforward("wrt_layer", "auto", W, (t,), DATA, SCALE, wrt=(0, 1))
        _, want = jax.jvp(lambda w, d: m.wrt_layer(w, d, SCALE), (W, DATA), t)
        near(push, want)
        prep = c.prepare_gradient("wrt_loss", "auto", W, DATA, wrt=1)
        near(
            c.gradient("wrt_loss", "auto", W, DATA, prep=prep, wrt=1),
            jax.grad(m.wrt_loss, 1)(W, DATA),
        )
        with pytest.raises(DtypeMismatchError) as info:
            c.gradient("wrt_noisy", "auto", W, DATA, KEY, wrt=2)
        assert info.value.field == "wrt"


def test_a_job_with_wrt(client: Client) -> None:
    job = client.submit.gradient("wrt_loss", "auto", W, DATA, wrt=[0, 1])
    near(job.result(progress=False), jax.grad(m.wrt_loss, (0, 1))(W, DATA))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_remote_function_argnums_scalar(client: Client, jit: bool) -> None:
    """The reported case: ``jax.grad(g, argnums=1)`` was zeros."""
    g = remote_function(client, "wrt_loss")
    wrap = jax.jit if jit else (lambda f: f)
    for argnums in (1, (0, 1), (1, 0)):
        near(wrap(jax.grad(g, argnums))(W, DATA), jax.grad(m.wrt_loss, argnums)(W, DATA))
        near(wrap(jax.hessian(g, argnums))(W, DATA), jax.hessian(m.wrt_loss, argnums)(W, DATA))
    datas = np.stack([DATA, 2 * DATA, -DATA])
    near(
        wrap(jax.vmap(jax.grad(g, 1), (None, 0)))(W, datas),
        jax.vmap(jax.grad(m.wrt_loss, 1), (None, 0))(W, datas),
    )
    # a derivative of the gradient in another argument: its mixed block
    near(
        jax.grad(lambda d: jnp.sum(jax.grad(g)(W, d) ** 2))(DATA),
        jax.grad(lambda d: jnp.sum(jax.grad(m.wrt_loss)(W, d) ** 2))(DATA),
    )


def test_remote_function_asks_with_wrt(client: Client) -> None:
    """``argnums=1`` is one /value_and_gradient request (with wrt), as argnums=0 is."""
    g = remote_function(client, "wrt_loss")
    g(W, DATA)  # its output's shape, learnt once
    before = counts(client)
    jax.grad(g, 1)(W, DATA)
    after = counts(client)
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert moved.get("/value_and_gradient") == 1
    assert sum(v for k, v in moved.items() if k != "/metrics") == 1


@pytest.mark.parametrize("argnums", [1, 2, (0, 1, 2)], ids=str)
def test_remote_function_argnums_array(client: Client, argnums) -> None:
    g = remote_function(client, "wrt_layer")
    for transform in (jax.jacrev, jax.jacfwd):
        near(
            transform(g, argnums)(W, DATA, SCALE),
            transform(m.wrt_layer, argnums)(W, DATA, SCALE),
        )


def test_remote_function_key_contexts(client: Client) -> None:
    g = remote_function(client, "wrt_noisy")
    near(g(W, DATA, KEY), m.wrt_noisy(W, DATA, KEY))
    near(jax.grad(g, (0, 1))(W, DATA, KEY), jax.grad(m.wrt_noisy, (0, 1))(W, DATA, KEY))
    near(jax.hessian(g)(W, DATA, KEY), jax.hessian(m.wrt_noisy)(W, DATA, KEY))
    keys = jax.random.split(KEY, 3)
    near(
        jax.jit(jax.vmap(jax.grad(g), (None, None, 0)))(W, DATA, keys),
        jax.vmap(jax.grad(m.wrt_noisy), (None, None, 0))(W, DATA, keys),
    )


def test_remote_function_refuses_an_async_client(server: ServerProcess) -> None:
    with pytest.raises(TypeError, match=r"AsyncClient.*Client\(url\)"):
        remote_function(AsyncClient(server.url), "wrt_loss")


def test_second_order_of_an_array_valued_served_function(client: Client) -> None:
    """``jacfwd(jacrev(g))``, Gauss-Newton's ``hessian(sum(g**2))`` and the other pairs:
    HVPs of ``<c, g>`` (``/hvp`` with a cotangent)."""
    layer = remote_function(client, "wrt_layer")

    def g(w):
        return layer(w, DATA, SCALE)

    def ref(w):
        return m.wrt_layer(w, DATA, SCALE)

    for outer in (jax.jacfwd, jax.jacrev):
        for inner in (jax.jacfwd, jax.jacrev):
            near(outer(inner(g))(W), outer(inner(ref))(W))
    near(
        jax.hessian(lambda w: jnp.sum(g(w) ** 2))(W), jax.hessian(lambda w: jnp.sum(ref(w) ** 2))(W)
    )
    with pytest.raises(TypeError, match="third order"):
        jax.jacfwd(jax.jacfwd(jax.jacrev(g)))(W)
    # and the request itself: the pullback's derivative
    c, s = RNG.normal(size=(3, 2)), RNG.normal(size=W.shape)
    (got,) = client.hvp("wrt_layer", "auto", W, (s,), DATA, SCALE, cotangent=c)
    _, want = jax.jvp(lambda w: jax.vjp(ref, w)[1](c)[0], (W,), (s,))
    near(got, want)
    with pytest.raises(InvalidArgumentError) as info:
        client.hvp("wrt_layer", "auto", W, (s,), DATA, SCALE, cotangent=np.ones(4))
    assert info.value.field == "cotangent"


@pytest.mark.parametrize("argnums", [1, (0, 1)], ids=str)
def test_second_order_of_an_array_valued_function_in_its_contexts(client: Client, argnums) -> None:
    """The server composes wrt and a cotangent: ``jacfwd(jacrev(g, argnums), argnums)``."""
    layer = remote_function(client, "wrt_layer")
    for outer in (jax.jacfwd, jax.jacrev):
        near(
            outer(jax.jacrev(layer, argnums), argnums)(W, DATA, SCALE),
            outer(jax.jacrev(m.wrt_layer, argnums), argnums)(W, DATA, SCALE),
        )
    near(
        jax.hessian(lambda w, d: jnp.sum(layer(w, d, SCALE) ** 2), argnums)(W, DATA),
        jax.hessian(lambda w, d: jnp.sum(m.wrt_layer(w, d, SCALE) ** 2), argnums)(W, DATA),
    )
    # a derivative of the pullback in x taken in another argument: refused, never zero
    with pytest.raises(TypeError, match="mixed second derivative"):
        jax.jacfwd(jax.jacrev(layer, 0), 1)(W, DATA, SCALE)
