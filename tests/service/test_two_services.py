"""Two ``Service``s in one process, built from different settings, each keep their own
limits, functions, caches and budgets: nothing one is configured with, registers or
holds reaches the other (no module-global state between them)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from dxcontract.errors import BudgetExceededError, InvalidArgumentError, UnknownFunctionError
from dxserve.server.service import Service
from dxserve.settings import Settings

X = np.array([1.0, 2.0, 3.0])
ROSENBROCK_GRADIENT = np.array([-400.0, 1002.0, -200.0])


def _settings(tmp_path: Path, name: str, **limits: object) -> Settings:
    return Settings(store=tmp_path / name, compilation_cache="", warm_up=False, **limits)


def test_two_services_keep_their_own_limits_functions_and_caches(tmp_path: Path) -> None:
    strict = _settings(tmp_path, "strict", max_tangents=2, max_request_flops=1e3,
                       max_functions=8, cache_size=1)
    loose = _settings(tmp_path, "loose")

    async def drive() -> None:
        a, b = Service(strict), Service(loose)
        try:
            # both compute, at once, the same answer
            ga, gb = await asyncio.gather(a.gradient("rosenbrock", "jax-reverse", X),
                                          b.gradient("rosenbrock", "jax-reverse", X))
            np.testing.assert_allclose(ga, ROSENBROCK_GRADIENT, rtol=1e-12)
            np.testing.assert_array_equal(ga, gb)

            # request shapes: three tangents are past the strict one's limit only
            tangents = tuple(np.eye(3))
            with pytest.raises(InvalidArgumentError, match="tangents"):
                await a.call("hvp", "rosenbrock", "auto", X, tangents)
            out = await b.call("hvp", "rosenbrock", "auto", X, tangents)
            np.testing.assert_allclose(out["hvps"][0], [402.0, -400.0, 0.0], rtol=1e-12)

            # compute budgets: a Hessian at n = 200 is over 1e3 flops, not over 1e11
            x = np.linspace(0.1, 1.0, 200)
            with pytest.raises(BudgetExceededError):
                await a.call("hessian", "rosenbrock", "auto", x)
            h = (await b.call("hessian", "rosenbrock", "auto", x))["hessian"]
            assert np.shape(h) == (200, 200)

            # functions: each has its own store, and its own cap
            body = {"name": "sq", "expression": "jnp.sum(x ** 2)", "args": ["x"]}
            await b.register(body)
            np.testing.assert_allclose(await b.gradient("sq", "auto", X), 2 * X, rtol=1e-14)
            with pytest.raises(UnknownFunctionError):
                await a.gradient("sq", "auto", X)
            for i in range(8):  # stored functions count, the built-in examples do not
                await a.register({**body, "name": f"sq{i}"})
            with pytest.raises(Exception, match="8"):  # at its cap of 8; b is far from its
                await a.register({**body, "name": "one_too_many"})
            await b.register({**body, "name": "one_too_many"})

            # caches: the strict one keeps one prep, the loose one what it prepared
            assert len(a.cache) == 1
            assert len(b.cache) >= 3 and b.cache.nbytes > a.cache.nbytes
            assert a.budget is not b.budget
        finally:
            a.close()
            b.close()

    asyncio.run(drive())
