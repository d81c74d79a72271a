"""client.scipy: trust-ncg and L-BFGS-B through the service match the local JAX runs."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dxclient import Client

optimize = pytest.importorskip("scipy.optimize")


def rosenbrock(x):
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


X0 = np.array([-1.2, 1.0, -0.5, 0.8, 1.3, -0.7])


@pytest.fixture
def client(server) -> Iterator[Client]:
    with Client(server.url) as c:
        yield c


def local_problem() -> dict:
    with jax.enable_x64(True):
        grad = jax.jit(jax.grad(rosenbrock))

        def hvp(x, p):
            return jax.jvp(jax.grad(rosenbrock), (x,), (p,))[1]

    def wrap(fn):
        def run(*args):
            with jax.enable_x64(True):
                return np.asarray(fn(*(np.asarray(a, np.float64) for a in args)), np.float64)
        return run

    return {"fun": lambda x: float(wrap(rosenbrock)(x)), "jac": wrap(grad), "hessp": wrap(hvp)}


@pytest.mark.parametrize("method", ["trust-ncg", "L-BFGS-B"])
def test_same_optimum_and_iterations_as_local(client: Client, method: str) -> None:
    problem = client.scipy("rosenbrock", "auto")
    local = local_problem()
    extra = {"hessp": problem.hessp} if method == "trust-ncg" else {}
    extra_local = {"hessp": local["hessp"]} if method == "trust-ncg" else {}
    remote = optimize.minimize(problem.fun, X0, jac=problem.jac, method=method, **extra)
    mine = optimize.minimize(local["fun"], X0, jac=local["jac"], method=method, **extra_local)
    assert remote.success and mine.success, (remote.message, mine.message)
    assert remote.nit == mine.nit
    np.testing.assert_allclose(remote.x, mine.x, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(remote.x, np.ones_like(X0), atol=1e-4)
    # fun and jac at the same point cost one request
    value_and_gradient = problem.requests - getattr(remote, "nhev", 0)
    assert value_and_gradient <= max(remote.nfev, remote.njev)


def test_fun_and_jac_share_one_request_and_hess(client: Client) -> None:
    problem = client.scipy("rosenbrock")
    x = X0.copy()
    problem.fun(x)
    problem.jac(x)
    assert problem.requests == 1
    x[0] += 1.0  # scipy may mutate its array: the cache compares values, not identity
    problem.jac(x)
    assert problem.requests == 2
    with jax.enable_x64(True):
        H = np.asarray(jax.hessian(rosenbrock)(x))
    np.testing.assert_allclose(problem.hess(x), H, rtol=1e-12)
    np.testing.assert_allclose(problem.hessp(x, np.ones(6)), H @ np.ones(6), rtol=1e-12)
    r = optimize.minimize(problem.fun, X0, jac=problem.jac, hess=problem.hess, method="trust-exact")
    assert r.success
