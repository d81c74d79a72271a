"""has_aux through the ``Service`` (no HTTP): its operator methods return JAX's shapes,
and concurrent has_aux calls of one prep that the request batcher merges each get their
own aux (``bn_loss``'s new state), as JAX computes it alone.
"""

from __future__ import annotations

import asyncio
from typing import Any

import jax
import numpy as np

from dxserve.examples import bn_loss
from dxserve.frameworks.jax.precision import float64_scope
from dxserve.server.service import Service
from dxserve.settings import Settings


def _inputs(seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    ps = {"w": rng.normal(size=(3, 2)), "scale": rng.uniform(0.5, 1.5, 2), "shift": rng.normal(size=2)}
    batch = {"x": rng.normal(size=(8, 3)), "y": rng.normal(size=(8, 2))}
    return ps, batch, {"mean": rng.normal(size=2), "var": rng.uniform(0.5, 2.0, 2)}


def _close(got: Any, want: Any) -> None:
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-12, atol=1e-14)


def test_concurrent_has_aux_calls_each_get_their_own_aux(tmp_path: Any) -> None:
    service = Service(Settings(
        store=tmp_path, compilation_cache="", functions=["dxserve.examples"], warm_up=False,
        batch_wait=0.01, inline_below=0.0,
    ))
    inputs = [_inputs(seed) for seed in range(8)]

    async def main() -> list:
        await service.value_and_gradient("bn_loss", "jax-reverse", *inputs[0], has_aux=True)
        rounds = []
        for _ in range(5):  # until the batcher has merged a group (it usually does at once)
            rounds.append(await asyncio.gather(*(
                service.value_and_gradient("bn_loss", "jax-reverse", *args, has_aux=True)
                for args in inputs
            )))
            if service.batcher.compiles:
                break
        return rounds

    try:
        rounds = asyncio.run(main())
        plain = asyncio.run(service.call("value_and_gradient", "bn_loss", "auto", inputs[0][0],
                                         None, inputs[0][1:], has_aux=True))
        merged = service.batcher.compiles  # a batched executable was made for a merged group
    finally:
        service.close()
    with float64_scope():
        want = [jax.value_and_grad(bn_loss, has_aux=True)(*args) for args in inputs]
    for results in rounds:
        for got, ref in zip(results, want, strict=True):
            _close(got, ref)
    assert merged >= 1, "no batch formed: the merged path was not exercised"
    assert set(plain) == {"value", "gradient", "aux"}
    _close(plain["aux"], want[0][0][1])
