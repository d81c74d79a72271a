"""A training loop whose state runs remotely: batch norm's running statistics carried
through 20 SGD steps as ``has_aux`` output, by the sync and async clients in every
encoding, against the same loop in process with ``jax.value_and_grad(has_aux=True)``
(float64, rtol 1e-10).

``bn_loss(ps, batch, st) -> (loss, new_st)`` is the served example
(``dxserve.examples``): st never reaches the loss, only the aux, so a state that was not
carried from step to step shows in the running statistics at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import jax
import numpy as np
import pytest

from dxclient import AsyncClient, Client, JaxReverse
from dxcontract.errors import NotScalarOutputError, PreparationMismatchError
from dxserve.examples import BN_MOMENTUM, bn_loss
from dxserve.frameworks.jax.precision import float64_scope

STEPS, LR = 20, 0.05


def data() -> tuple[dict, list[dict], dict]:
    """Initial parameters, one batch per step (N=16, d=3, k=2), and the initial state."""
    rng = np.random.default_rng(7)
    ps = {"w": rng.normal(size=(3, 2)), "scale": np.ones(2), "shift": np.zeros(2)}
    batches = []
    for _ in range(STEPS):
        x = rng.normal(size=(16, 3)) * np.array([1.0, 2.0, 0.5]) + np.array([0.5, -1.0, 2.0])
        batches.append({"x": x, "y": np.tanh(x @ np.array([[1.0, -1.0], [0.5, 0.2], [0.0, 1.0]]))})
    return ps, batches, {"mean": np.zeros(2), "var": np.ones(2)}


def sgd(ps: dict, g: dict) -> dict:
    return {k: np.asarray(ps[k]) - LR * np.asarray(g[k]) for k in ps}


def in_process() -> list[tuple[float, dict, dict]]:
    """(loss, state after the step, parameters after the step) of each step, in JAX."""
    ps, batches, st = data()
    step = jax.jit(jax.value_and_grad(bn_loss, has_aux=True))
    out = []
    with float64_scope():
        for batch in batches:
            (loss, st), g = step(ps, batch, st)
            ps = sgd(ps, g)
            out.append((float(loss), jax.tree_util.tree_map(np.asarray, st), ps))
    return out


@pytest.fixture(scope="module")
def reference() -> list[tuple[float, dict, dict]]:
    return in_process()


def check(history: list[tuple[float, dict, dict]], reference: list) -> None:
    assert len(history) == len(reference) == STEPS
    for i, ((loss, st, ps), (loss_ref, st_ref, ps_ref)) in enumerate(
        zip(history, reference, strict=True)
    ):
        assert loss == pytest.approx(loss_ref, rel=1e-10), i
        for k in ("mean", "var"):
            assert st[k].dtype == np.float64
            np.testing.assert_allclose(st[k], st_ref[k], rtol=1e-10, err_msg=f"step {i} {k}")
        for k in ps_ref:
            np.testing.assert_allclose(ps[k], ps_ref[k], rtol=1e-10, err_msg=f"step {i} {k}")
    # the state was carried: after 20 steps the running mean is far from its start
    assert np.all(np.abs(history[-1][1]["mean"]) > 0.1)
    assert history[-1][0] < history[0][0]  # and the loss went down


def loop_sync(client: Client, prep: Any = None) -> list[tuple[float, dict, dict]]:
    ps, batches, st = data()
    history = []
    for batch in batches:
        (loss, st), g = client.value_and_gradient(
            "bn_loss", JaxReverse(), ps, batch, st, prep=prep, has_aux=True
        )
        ps = sgd(ps, g)
        history.append((float(loss), st, ps))
    return history


async def loop_async(client: AsyncClient) -> list[tuple[float, dict, dict]]:
    ps, batches, st = data()
    history = []
    for batch in batches:
        (loss, st), g = await client.value_and_gradient(
            "bn_loss", JaxReverse(), ps, batch, st, has_aux=True
        )
        ps = sgd(ps, g)
        history.append((float(loss), st, ps))
    return history


@pytest.mark.parametrize("encoding", ["binary", "json", "b64"])
def test_sync_client_training_loop(server: Any, reference: list, encoding: str) -> None:
    with Client(server.url, encoding=encoding) as client:
        check(loop_sync(client), reference)


@pytest.mark.parametrize("encoding", ["binary", "json"])
def test_async_client_training_loop(server: Any, reference: list, encoding: str) -> None:
    async def run() -> list:
        async with AsyncClient(server.url, encoding=encoding) as client:
            return await loop_async(client)

    check(asyncio.run(run()), reference)


def test_prepared_training_loop(server: Any, reference: list) -> None:
    ps, batches, st = data()
    with Client(server.url) as client:
        prep = client.prepare_value_and_gradient(
            "bn_loss", JaxReverse(), ps, batches[0], st, has_aux=True
        )
        check(loop_sync(client, prep), reference)
        with pytest.raises(PreparationMismatchError, match="has_aux"):
            client.value_and_gradient("bn_loss", JaxReverse(), ps, batches[0], st, prep=prep)


def test_jax_shapes_of_other_operators(server: Any) -> None:
    ps, batches, st = data()
    batch = batches[0]
    with float64_scope():
        (loss, new_st), g = jax.value_and_grad(bn_loss, has_aux=True)(ps, batch, st)
        H, _ = jax.hessian(bn_loss, has_aux=True)(ps, batch, st)
    with Client(server.url) as client:
        g2, aux = client.gradient("bn_loss", ps, batch, st, has_aux=True)  # backend left out
        np.testing.assert_allclose(g2["w"], g["w"], rtol=1e-10)
        np.testing.assert_allclose(aux["mean"], new_st["mean"], rtol=1e-12)
        value, aux = client.value("bn_loss", ps, batch, st, has_aux=True)
        assert float(value) == pytest.approx(float(loss), rel=1e-12)
        H2, aux = client.hessian("bn_loss", ps, batch, st, has_aux=True)
        np.testing.assert_allclose(H2["w"]["scale"], H["w"]["scale"], rtol=1e-9, atol=1e-12)
        (pulled,), aux = client.pullback("bn_loss", ps, (np.array(2.0),), batch, st,
                                         has_aux=True)
        np.testing.assert_allclose(pulled["shift"], 2 * np.asarray(g["shift"]), rtol=1e-10)
        # streamed with progress: the result event carries aux as the plain answer does
        seen: list[tuple[int, int]] = []
        (v3, aux3), g3 = client.value_and_gradient(
            "bn_loss", ps, batch, st, has_aux=True, progress=lambda d, t: seen.append((d, t))
        )
        np.testing.assert_allclose(aux3["var"], new_st["var"], rtol=1e-12)
        np.testing.assert_allclose(g3["w"], g["w"], rtol=1e-10)


def test_forgetting_has_aux_names_the_fix_in_python(server: Any) -> None:
    ps, batches, st = data()
    with Client(server.url) as client, pytest.raises(NotScalarOutputError) as err:
        client.value_and_gradient("bn_loss", ps, batches[0], st)
    assert "has_aux=True" in str(err.value) and err.value.fix == {"has_aux": True}


def test_running_mean_follows_the_batches() -> None:
    """The reference itself: st moves by BN_MOMENTUM toward each batch's statistics."""
    ps, batches, st = data()
    with float64_scope():
        _, new = bn_loss(ps, batches[0], st)
        h = batches[0]["x"] @ ps["w"]
    np.testing.assert_allclose(new["mean"], BN_MOMENTUM * h.mean(axis=0), rtol=1e-12)
