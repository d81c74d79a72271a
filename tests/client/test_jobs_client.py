"""Detached jobs through ``dxclient`` against a real server: ``client.submit.<op>``
returns a ``Job`` whose ``result()`` is the plain call's result bit for bit (with
progress as the operator's ``progress=``), reattached by id from another process;
``AsyncClient`` alike; cancelled, failed, unknown and unfinished jobs raise typed errors.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import numpy as np
import pytest

from dxclient import AsyncClient, AsyncJob, Client, Job
from dxcontract.errors import JobCancelledError, NotScalarOutputError, UnknownJobError
from tests.conftest import REPO, REQUEST_DEADLINE
from tests.http.test_jobs_http import HEAVY
from tests.references import rosenbrock_hessian


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory: pytest.TempPathFactory):
    from tests.conftest import start_server, stop_server

    srv = start_server(tmp_path_factory.mktemp("jobs-client"), env={
        "DXSERVE_WARM_UP": "false", "DXSERVE_JOB_POLL_INTERVAL": "0.2",
    }, modules=("dxserve.examples", "tests.slow_functions"))
    yield srv
    stop_server(srv)


def test_a_job_result_is_the_plain_calls_with_progress(slow_server) -> None:
    x = np.linspace(0.1, 1.3, 1500)
    with Client(slow_server.url) as client:
        job = client.submit.hessian("rosenbrock", "jax-forward", x)
        assert isinstance(job, Job) and job.operator == "hessian"
        assert job.status()["status"] in ("queued", "running", "succeeded")
        seen: list[tuple[int, int]] = []
        H = job.result(progress=lambda done, total: seen.append((done, total)))
        plain = client.hessian("rosenbrock", "jax-forward", x)
        np.testing.assert_array_equal(H, plain)
        np.testing.assert_allclose(H, rosenbrock_hessian(x), rtol=1e-10, atol=1e-9)
        assert [t for _, t in seen] == [1500] * len(seen) and seen[-1][0] == 1500
        assert [d for d, _ in seen] == sorted(d for d, _ in seen) and len(seen) >= 10
        # tangents and several results, positional backend left out
        t = np.ones_like(x)
        g, hvps = client.submit.gradient_and_hvp("rosenbrock", x, (t, -t)).result(progress=False)
        g0, hvps0 = client.gradient_and_hvp("rosenbrock", x, (t, -t))
        np.testing.assert_array_equal(g, g0)
        assert len(hvps) == 2 and all(np.array_equal(a, b) for a, b in zip(hvps, hvps0, strict=True))
        assert job.id in {doc["id"] for doc in client.jobs()}
        assert job.cancel() is None  # ended: removed
        with pytest.raises(UnknownJobError):
            job.status()


_SUBMIT = """
import numpy as np, dxclient
client = dxclient.Client({url!r})
job = client.submit.jacobian("sin_cumsum", "jax-reverse", np.linspace(0.1, 1.3, 7))
print(job.id)
"""


def test_reattach_from_another_process(slow_server) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    out = subprocess.run([sys.executable, "-c", _SUBMIT.format(url=slow_server.url)],
                         capture_output=True, text=True, timeout=120, env=env, check=True)
    job_id = out.stdout.strip().splitlines()[-1]
    with Client(slow_server.url, encoding="json") as client:
        job = client.job(job_id)
        assert job.operator == "jacobian"
        J = job.result(timeout=REQUEST_DEADLINE, progress=False)
        np.testing.assert_array_equal(
            J, client.jacobian("sin_cumsum", "jax-reverse", np.linspace(0.1, 1.3, 7)))


def test_cancelled_failed_unfinished_and_unknown_jobs_raise(slow_server) -> None:
    with Client(slow_server.url) as client:
        job = client.submit.hessian(HEAVY["function"], HEAVY["backend"], np.asarray(HEAVY["x"]))
        with pytest.raises(TimeoutError):  # the job is far from done after 0.3 s
            job.result(timeout=0.3, progress=False)
        assert job.cancel()["id"] == job.id
        with pytest.raises(JobCancelledError):
            job.result()
        failed = client.submit.hessian("sin_cumsum", np.array([1.0, 2.0]))
        with pytest.raises(NotScalarOutputError) as err:
            failed.result()
        assert err.value.status == 422
        assert failed.status()["error"]["status"] == 422
        with pytest.raises(UnknownJobError):
            client.job("no-such-job-0000")


def test_async_client_jobs(slow_server) -> None:
    x = np.linspace(0.1, 1.3, 1100)

    async def run() -> None:
        async with AsyncClient(slow_server.url, encoding="b64") as client:
            job = await client.submit.value_gradient_and_hessian("rosenbrock", "jax-forward", x)
            assert isinstance(job, AsyncJob)
            seen: list[int] = []
            v, g, H = await job.result(progress=lambda done, total: seen.append(done))
            v0, g0, H0 = await client.value_gradient_and_hessian("rosenbrock", "jax-forward", x)
            np.testing.assert_array_equal(H, H0)
            np.testing.assert_array_equal(g, g0)
            assert float(v) == float(v0) and seen[-1] == 1100
            again = await client.job(job.id)
            assert (await again.status())["status"] == "succeeded"
            assert await again.cancel() is None
            with pytest.raises(UnknownJobError):
                await job.status()

    asyncio.run(run())


def _same_bits(a, b) -> None:
    """Equal trees of arrays, bit for bit (dicts, tuples and lists alike)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            _same_bits(a[key], b[key])
    elif isinstance(a, tuple | list):
        assert isinstance(b, tuple | list) and len(a) == len(b)
        for u, v in zip(a, b, strict=True):
            _same_bits(u, v)
    else:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_job_with_has_aux_returns_the_aux_as_the_call_does(slow_server) -> None:
    rng = np.random.default_rng(1)
    ps = {"w": rng.normal(size=(3, 2)), "scale": np.ones(2), "shift": np.zeros(2)}
    batch = {"x": rng.normal(size=(4, 3)), "y": rng.normal(size=(4, 2))}
    st = {"mean": np.zeros(2), "var": np.ones(2)}
    with Client(slow_server.url) as client:
        job = client.submit.value_and_gradient("bn_loss", ps, batch, st, has_aux=True)
        got = job.result(progress=False)
        plain = client.value_and_gradient("bn_loss", ps, batch, st, has_aux=True)
        _same_bits(got, plain)
        (loss, new_st), grads = got
        assert set(new_st) == {"mean", "var"} and set(grads) == {"w", "scale", "shift"}
        again = client.job(job.id)  # reattached: the status says has_aux
        assert again.has_aux and job.status()["has_aux"] is True
        _same_bits(again.result(progress=False), plain)
