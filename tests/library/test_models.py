"""Models as functions: Equinox and Flax NNX models through ``client.register``.

The client splits a model into its floating parameters (sent as ``x``, a list of
leaves) and the rest (folded into the export), and rebuilds x-shaped results into the
model's structure. References are Equinox's and Flax's own transforms in float64.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fastapi.testclient import TestClient

from dxclient import Client
from dxserve.http import create_app
from dxserve.settings import Settings

eqx = pytest.importorskip("equinox")

RTOL = 1e-10
tmap = jax.tree_util.tree_map


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    store = tmp_path_factory.mktemp("model-store")
    settings = Settings(store=store, compilation_cache="", functions=["dxserve.examples"])
    with TestClient(create_app(settings)) as http:
        yield Client(http=httpx.Client(transport=http._transport, base_url="http://testserver"))


def assert_close(got: Any, want: Any, rtol: float = RTOL) -> None:
    """Same tree structure (None nodes included) and leaves equal to ``rtol``."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=1e-14)


# --- an Equinox MLP with a static activation field ----------------------------------------
class MLP(eqx.Module):
    layers: list
    scale: np.ndarray  # an integer array: not differentiated, folded into the export
    act: Callable[[jax.Array], jax.Array] = eqx.field(static=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = self.act(jax.vmap(layer)(x))
        return jax.vmap(self.layers[-1])(x)[:, 0] * self.scale


def _f64(model: Any) -> Any:
    """The model with its floating leaves as float64 numpy arrays."""
    return tmap(lambda a: np.asarray(a, np.float64) if eqx.is_inexact_array(a) else a, model)


def make_mlp(seed: int = 0) -> MLP:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    layers = [eqx.nn.Linear(2, 8, key=k1), eqx.nn.Linear(8, 1, key=k2)]
    return _f64(MLP(layers, np.array(1, np.int32), jnp.tanh))


def mse(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (32, 2))
    return x, np.sin(2 * x[:, 0])


def adam(value_and_grad: Callable[[Any], tuple[Any, Any]], model: Any, steps: int = 50,
         lr: float = 0.05) -> tuple[float, Any]:
    """Numpy Adam on the gradient's leaves, applied with ``eqx.apply_updates``."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    m = v = None
    for k in range(1, steps + 1):
        _, g = value_and_grad(model)
        g = tmap(np.asarray, g)
        m = tmap(lambda g_: (1 - b1) * g_, g) if m is None else tmap(
            lambda m_, g_: b1 * m_ + (1 - b1) * g_, m, g)
        v = tmap(lambda g_: (1 - b2) * g_**2, g) if v is None else tmap(
            lambda v_, g_: b2 * v_ + (1 - b2) * g_**2, v, g)
        c1, c2 = 1 - b1**k, 1 - b2**k
        updates = tmap(lambda m_, v_, c1=c1, c2=c2: -lr * (m_ / c1) / (np.sqrt(v_ / c2) + eps),
                       m, v)
        model = eqx.apply_updates(model, updates)
    loss, _ = value_and_grad(model)
    return float(loss), model


def test_equinox_gradient_matches_filter_grad(client: Client) -> None:
    model, (x, y) = make_mlp(), _data()
    f = client.register(mse, model, x, y, name="eqx_mse")
    g = client.gradient(f, "jax-reverse", model, x, y)
    assert isinstance(g, MLP) and g.act is jnp.tanh and g.scale is None
    with jax.enable_x64(True):
        want = eqx.filter_grad(mse)(model, x, y)
        value = mse(model, x, y)
    assert_close(g, want)
    v, g2 = client.value_and_gradient(f, "auto", model, x, y)
    np.testing.assert_allclose(v, value, rtol=RTOL)
    assert_close(g2, want)


def test_equinox_adam_through_the_client_matches_in_process(client: Client) -> None:
    model, (x, y) = make_mlp(1), _data()
    f = client.register(mse, model, x, y, name="eqx_mse_train")
    remote, remote_model = adam(lambda m: client.value_and_gradient(f, "jax-reverse", m, x, y),
                                model)
    with jax.enable_x64(True):
        step = eqx.filter_jit(eqx.filter_value_and_grad(mse))
        local, local_model = adam(lambda m: step(m, x, y), model)
        start = float(mse(model, x, y))
    assert abs(remote - local) <= 1e-10
    assert remote < 0.5 * start  # it did train
    assert_close(eqx.filter(remote_model, eqx.is_inexact_array),
                 eqx.filter(local_model, eqx.is_inexact_array), rtol=1e-9)


def test_equinox_hvp_with_a_model_shaped_tangent(client: Client) -> None:
    model, (x, y) = make_mlp(2), _data()
    f = client.register(mse, model, x, y, name="eqx_mse_hvp")
    rng = np.random.default_rng(3)
    params = eqx.filter(model, eqx.is_inexact_array)
    t = tmap(lambda a: rng.normal(size=a.shape), params)
    tangent = eqx.combine(t, model)  # a whole model whose parameters are the direction
    (hv,) = client.hvp(f, "auto", model, (tangent,), x, y)
    assert isinstance(hv, MLP)
    with jax.enable_x64(True):
        static = eqx.filter(model, eqx.is_inexact_array, inverse=True)
        grad = eqx.filter_grad(lambda p: mse(eqx.combine(p, static), x, y))
        _, want = jax.jvp(grad, (params,), (t,))
    assert_close(hv, want)
    # the tangent may also be a parameters tree (e.g. a filter_grad result)
    (hv2,) = client.hvp(f, "auto", model, (t,), x, y)
    assert_close(hv2, want)


def test_equinox_nn_mlp(client: Client) -> None:
    model = _f64(eqx.nn.MLP(2, 1, 6, 2, activation=jax.nn.softplus, key=jax.random.PRNGKey(4)))
    x, y = _data()

    def loss(m: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean((jax.vmap(m)(x)[:, 0] - y) ** 2)

    f = client.register(loss, model, x, y)
    assert f.name == "loss"
    g = client.gradient(f, "jax-reverse", model, x, y)
    with jax.enable_x64(True):
        want = eqx.filter_grad(loss)(model, x, y)
    assert_close(g, want)


# --- Flax NNX ------------------------------------------------------------------------------
def test_flax_nnx_gradient_and_training(client: Client) -> None:
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.l1 = nnx.Linear(2, 8, rngs=rngs, param_dtype=jnp.float64)
            self.l2 = nnx.Linear(8, 1, rngs=rngs, param_dtype=jnp.float64)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.l2(jnp.tanh(self.l1(x)))[:, 0]

    with jax.enable_x64(True):
        model = Net(nnx.Rngs(0))
    x, y = _data()
    f = client.register(mse, model, x, y, name="nnx_mse")
    v, g = client.value_and_gradient(f, "jax-reverse", model, x, y)
    with jax.enable_x64(True):
        want_v, want = nnx.value_and_grad(mse)(model, x, y)
    np.testing.assert_allclose(v, want_v, rtol=RTOL)
    assert_close(g, want)
    # one SGD step applied the NNX way lowers the loss
    with jax.enable_x64(True):  # float64 parameters stay float64
        params = nnx.state(model, nnx.Param)
        nnx.update(model, tmap(lambda p, d: p - 0.1 * d, params, g))
    assert float(client.value(f, "auto", model, x, y)) < float(v)


# --- Flax Linen: the parameters are a plain dict pytree -------------------------------------
def test_flax_linen_parameter_tree(client: Client) -> None:
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return nn.Dense(1, param_dtype=jnp.float64)(jnp.tanh(nn.Dense(8)(x)))[:, 0]

    net, (x, y) = Net(), _data()
    with jax.enable_x64(True):
        params = tmap(np.asarray, net.init(jax.random.PRNGKey(0), x)["params"])
    params = tmap(lambda a: np.asarray(a, np.float64), params)

    def linen_loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean((net.apply({"params": p}, x) - y) ** 2)

    f = client.register(linen_loss, params, x, y)
    g = client.gradient(f, "jax-reverse", params, x, y)
    with jax.enable_x64(True):
        want = jax.grad(linen_loss)(params, x, y)
    assert_close(g, want)


def test_async_results_are_rebuilt_after_awaiting() -> None:
    import asyncio

    from dxclient import models

    model = make_mlp(5)
    call = models.model_call(model, None)
    assert call is not None and models.model_call(np.ones(3), None) is None

    async def answer() -> Any:
        return list(call.x)

    rebuilt = asyncio.run(call.finish("gradient", answer()))
    assert isinstance(rebuilt, MLP)
    assert_close(rebuilt, eqx.filter(model, eqx.is_inexact_array))
