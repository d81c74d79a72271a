"""Custom pytree nodes keep their type: ``NamedTuple``s, ``flax.struct`` dataclasses,
``equinox.Module``s, in x and in contexts, in process and through the client.

A Lux-style ``Layer(weight, bias)`` read by attribute (``p.weight``) once failed in
process (``'tuple' object has no attribute 'weight'``: rebuilt as a plain tuple) and
through the client ("unsupported pytree node"). Every operator is checked here against
JAX's own transformation of the same function in float64, rtol 1e-10; the results keep
the caller's type. Over HTTP (a real server), a node travels as
``{"__node__": {"type": name, "fields": {...}}}`` and comes back as the client's type.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import equinox as eqx
import flax.struct
import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dxserve
from dxclient import Client
from dxcontract.encodings import nodes
from tests.conftest import ServerProcess, start_server, stop_server
from tests.node_functions import Layer, layer_loss, layer_map, layer_out, through_layer

jax.config.update("jax_enable_x64", True)


class ELayer(eqx.Module):
    weight: jax.Array
    bias: jax.Array


@flax.struct.dataclass
class FLayer:
    weight: jax.Array
    bias: jax.Array


TYPES = [Layer, ELayer, FLayer]
W0, B0 = np.array([[1.0, 2.0], [3.0, -4.0]]), np.array([0.5, -0.5])
DATA = np.array([[1.0, -1.0], [0.5, 2.0]])
RTOL = 1e-10


def _close(got: Any, want: Any, rtol: float = RTOL) -> None:
    assert type(got) is type(want), (type(got), type(want))
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("cls", TYPES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("backend", ["auto", "jax-forward", "jax-reverse"])
def test_every_operator_keeps_the_node_in_process(cls: type, backend: str) -> None:
    p = cls(W0, B0)
    t = cls(np.array([[0.3, -0.1], [1.0, 0.2]]), np.array([-1.0, 0.4]))
    _close(dxserve.gradient(layer_loss, backend, p, DATA), jax.grad(layer_loss)(p, DATA))
    y, g = dxserve.value_and_gradient(layer_loss, backend, p, DATA)
    _close(g, jax.grad(layer_loss)(p, DATA))
    (hv,) = dxserve.hvp(layer_loss, backend, p, (t,), DATA)
    _close(hv, jax.jvp(lambda u: jax.grad(layer_loss)(u, DATA), (p,), (t,))[1])
    _close(dxserve.hessian(layer_loss, backend, p, DATA), jax.hessian(layer_loss)(p, DATA))
    _close(dxserve.jacobian(layer_out, backend, p, DATA), jax.jacobian(layer_out)(p, DATA))
    (pushed,) = dxserve.pushforward(layer_map, backend, p, (t,))
    _close(pushed, jax.jvp(layer_map, (p,), (t,))[1])
    (pulled,) = dxserve.pullback(layer_map, backend, p, (t,))
    _close(pulled, jax.vjp(layer_map, p)[1](t)[0])
    _close(dxserve.jacobian(layer_map, backend, p), jax.jacobian(layer_map)(p))
    # in a context: the node is read by attribute as the caller wrote it
    w = np.array([0.2, -0.7])
    np.testing.assert_allclose(
        dxserve.gradient(through_layer, backend, w, p), jax.grad(through_layer)(w, p), rtol=RTOL
    )
    np.testing.assert_allclose(
        dxserve.hessian(through_layer, backend, w, p), jax.hessian(through_layer)(w, p), rtol=RTOL
    )


def test_a_node_inside_other_nodes_keeps_its_type() -> None:
    params = {"layers": [Layer(W0, B0), Layer(W0.T, -B0)], "scale": np.asarray(2.0)}

    def f(q):
        h = DATA
        for layer in q["layers"]:
            h = jnp.tanh(h @ layer.weight + layer.bias)
        return q["scale"] * jnp.sum(h**2)

    _close(dxserve.gradient(f, "auto", params), jax.grad(f)(params))


# --- through the client, with a real server --------------------------------------------
@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("nodes"), modules=("tests.node_functions",))
    try:
        yield server
    finally:
        stop_server(server)


@pytest.mark.parametrize("encoding", ["json", "b64", "binary"])
@pytest.mark.parametrize("cls", [Layer, FLayer], ids=lambda c: c.__name__)
def test_nodes_travel_with_their_field_names(srv: ServerProcess, cls: type, encoding: str) -> None:
    p = cls(W0, B0)
    t = cls(np.array([[0.3, -0.1], [1.0, 0.2]]), np.array([-1.0, 0.4]))
    with Client(srv.url, encoding=encoding) as client:
        _close(client.gradient("layer_loss", "auto", p, DATA), jax.grad(layer_loss)(p, DATA))
        _close(client.hessian("layer_loss", "auto", p, DATA), jax.hessian(layer_loss)(p, DATA))
        (hv,) = client.hvp("layer_loss", "auto", p, (t,), DATA)
        _close(hv, jax.jvp(lambda u: jax.grad(layer_loss)(u, DATA), (p,), (t,))[1])
        _close(client.jacobian("layer_map", "auto", p), jax.jacobian(layer_map)(p))
        (pulled,) = client.pullback("layer_map", "auto", p, (t,))
        _close(pulled, jax.vjp(layer_map, p)[1](t)[0])
        w = np.array([0.2, -0.7])
        np.testing.assert_allclose(
            client.gradient("through_layer", "auto", w, p), jax.grad(through_layer)(w, p), rtol=RTOL
        )


def test_the_wire_form_and_an_unknown_type(srv: ServerProcess) -> None:
    """Without the client: a node is its type's name and its fields; a reader that does
    not know the type gets a NamedTuple of that name and fields."""
    x = {"__node__": {"type": "Lux", "fields": {"weight": W0.tolist(), "bias": B0.tolist()}}}
    r = httpx.post(f"{srv.url}/gradient", json={
        "function": "layer_loss", "x": x, "contexts": [DATA.tolist()]})
    assert r.status_code == 200, r.text
    g = r.json()["gradient"]["__node__"]
    assert g["type"] == "Lux" and list(g["fields"]) == ["weight", "bias"]
    want = jax.grad(layer_loss)(Layer(W0, B0), DATA)
    np.testing.assert_allclose(g["fields"]["weight"], want.weight, rtol=RTOL)
    np.testing.assert_allclose(g["fields"]["bias"], want.bias, rtol=RTOL)
    made = nodes.build("Lux", ["weight", "bias"], [1, 2])
    assert made.weight == 1 and type(made).__name__ == "Lux"
    assert type(nodes.build("Lux", ["weight", "bias"], [3, 4])) is type(made)  # one class


@pytest.mark.parametrize(
    ("node", "field"),
    [({"type": "no name", "fields": {"w": [1.0]}}, "x"),
     ({"type": "L", "fields": {"_w": [1.0]}}, "x"),
     ({"type": "L", "fields": {"class": [1.0]}}, "x"),
     ({"type": "L", "fields": [[1.0]]}, "x"),
     ({"type": "L"}, "x"),
     ({"type": "L", "fields": {"w": {"__node__": {"type": 3, "fields": {}}}}}, "x.w")],
)
def test_malformed_nodes_are_problems_naming_the_field(srv: ServerProcess, node: dict,
                                                       field: str) -> None:
    r = httpx.post(f"{srv.url}/gradient", json={
        "function": "layer_loss", "x": {"__node__": node}, "contexts": [DATA.tolist()]})
    assert 400 <= r.status_code < 500, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["field"] == field
