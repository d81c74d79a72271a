"""client.scipy(...).constraint / .slsqp: a served constraint in scipy.optimize.

Rosenbrock (served) on R^3 under two served constraints c(x) = (|x|², x0 + x1), with
|x|² <= 1.5 and x0 + x1 >= 0.2, by ``trust-constr`` (``NonlinearConstraint``) and by
``SLSQP`` (``{"type": "ineq"}`` dicts): the same optimum and iteration count as the
same runs on the local JAX functions, the optimum on the disk's boundary.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dxclient import Client

optimize = pytest.importorskip("scipy.optimize")
X0 = np.array([-0.5, 0.9, 0.3])


def rosenbrock(x):
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def constraints(x):
    """(|x|², x0 + x1): R^n -> R^2."""
    return jnp.stack([jnp.sum(x**2), x[0] + x[1]])


def _local(fn):
    def run(x):
        with jax.enable_x64(True):
            return np.asarray(fn(jnp.asarray(x, jnp.float64)), np.float64)
    return run


@pytest.fixture(scope="module")
def client(server) -> Iterator[Client]:
    with Client(server.url) as c:
        with jax.enable_x64(True):
            c.register(constraints, np.zeros(3), name="scipy_test_constraints", replace=True)
        yield c


def _solve(method: str, fun, jac, c_fun, c_jac):
    if method == "trust-constr":
        cons = [optimize.NonlinearConstraint(c_fun, [-np.inf, 0.2], [1.5, np.inf], jac=c_jac)]
    else:  # SLSQP: c(x) >= 0
        cons = [{"type": "ineq", "fun": lambda x: np.array([1.5, -0.2]) + np.array([-1, 1]) * c_fun(x),
                 "jac": lambda x: np.array([[-1.0], [1.0]]) * c_jac(x)}]
    return optimize.minimize(fun, X0, jac=jac, method=method, constraints=cons,
                             options={"maxiter": 500})


@pytest.mark.parametrize("method", ["trust-constr", "SLSQP"])
def test_served_constraint_matches_local(client: Client, method: str) -> None:
    objective = client.scipy("rosenbrock")
    cons = client.scipy("scipy_test_constraints")
    if method == "trust-constr":
        nlc = cons.constraint([-np.inf, 0.2], [1.5, np.inf])
        assert isinstance(nlc, optimize.NonlinearConstraint)
        remote = optimize.minimize(objective.fun, X0, jac=objective.jac, method=method,
                                   constraints=[nlc], options={"maxiter": 500})
    else:
        # SLSQP's form of the same constraints, c(x) >= 0 each, from two served dicts
        d = cons.slsqp("ineq")
        assert d["type"] == "ineq"
        ineq = {"type": "ineq", "fun": lambda x: np.array([1.5, -0.2]) + np.array([-1, 1]) * d["fun"](x),
                "jac": lambda x: np.array([[-1.0], [1.0]]) * d["jac"](x)}
        remote = optimize.minimize(objective.fun, X0, jac=objective.jac, method=method,
                                   constraints=[ineq], options={"maxiter": 500})
    local = _solve(method, _local(rosenbrock), _local(jax.grad(rosenbrock)),
                   _local(constraints), _local(jax.jacobian(constraints)))
    assert remote.success and local.success, (remote.message, local.message)
    assert remote.nit == local.nit
    np.testing.assert_allclose(remote.x, local.x, rtol=1e-8, atol=1e-10)
    assert abs(np.sum(remote.x**2) - 1.5) < 1e-5  # on the disk's edge (barrier slack)
    # c and ∂c/∂x at one point cost one /value_and_jacobian
    np.testing.assert_allclose(cons.constraint_fun(remote.x), [np.sum(remote.x**2), remote.x[0] + remote.x[1]],
                               rtol=1e-12)
    before = cons.requests
    cons.constraint_jac(remote.x)
    assert cons.requests == before


def test_slsqp_kind_is_checked(client: Client) -> None:
    with pytest.raises(ValueError, match="ineq"):
        client.scipy("scipy_test_constraints").slsqp("greater")
