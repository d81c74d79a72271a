"""SciPy adapters: a served function shaped for ``scipy.optimize.minimize``.

    problem = client.scipy("rosenbrock", backend="auto")
    minimize(problem.fun, x0, jac=problem.jac, hessp=problem.hessp, method="trust-ncg")

``fun`` and ``jac`` share one ``/value_and_gradient`` request per point: the last
point and its answer are kept, so SciPy asking for both at the same ``x`` costs one
round trip. ``hessp(x, p)`` is one ``/hvp``; ``hess(x)`` one ``/hessian``.

A served (vector- or scalar-valued) ``c(x)`` is a constraint the same way:

    disk = client.scipy("disk")
    minimize(..., constraints=[disk.constraint(-np.inf, 1.0)], method="trust-constr")
    minimize(..., constraints=[disk.slsqp("ineq")], method="SLSQP")   # c(x) >= 0

``constraint_fun`` and ``constraint_jac`` share one ``/value_and_jacobian`` request per
point; the Jacobian is (m, n) dense, or a ``scipy.sparse`` array with a ``Sparse``
backend (which ``trust-constr`` takes as it is).

Synchronous only: ``scipy.optimize`` calls ``fun``/``jac`` as plain functions, so an
``AsyncClient`` adapter would need its own event loop thread to block on; with a sync
``Client`` at hand that adds a thread hop per call and nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dxcontract.backends import Backend

from ._models import RemoteFunction, function_name

if TYPE_CHECKING:
    from ._client import Client


class ScipyProblem:
    """``fun``, ``jac``, ``hessp`` and ``hess`` of ``f(x, *contexts)`` for flat float64 ``x``."""

    def __init__(
        self, client: Client, f: RemoteFunction | str, backend: Backend | str = "auto",
        *contexts: Any,
    ) -> None:
        self.client, self.name, self.backend, self.contexts = client, function_name(f), backend, contexts
        self._x: np.ndarray | None = None
        self._value: float = 0.0
        self._gradient: np.ndarray = np.empty(0)
        self._cx: np.ndarray | None = None
        self._c_value: np.ndarray = np.empty(0)
        self._c_jacobian: Any = np.empty((0, 0))
        #: service requests made (value_and_gradient, value_and_jacobian, hvp, hessian)
        self.requests = 0

    def _at(self, x: Any) -> None:
        x = np.asarray(x, dtype=np.float64)
        if self._x is not None and self._x.shape == x.shape and np.array_equal(self._x, x):
            return
        value, gradient = self.client.value_and_gradient(self.name, self.backend, x, *self.contexts)
        self.requests += 1
        # copy: scipy may change its array in place after the call
        self._x, self._value, self._gradient = x.copy(), float(value), np.asarray(gradient, np.float64)

    def fun(self, x: Any) -> float:
        """f(x)."""
        self._at(x)
        return self._value

    def jac(self, x: Any) -> np.ndarray:
        """∇f(x) (from the same request as ``fun`` at this x)."""
        self._at(x)
        return self._gradient.copy()

    def hessp(self, x: Any, p: Any) -> np.ndarray:
        """∇²f(x) @ p, one ``/hvp`` request."""
        x = np.asarray(x, dtype=np.float64)
        (hv,) = self.client.hvp(self.name, self.backend, x, (np.asarray(p, np.float64),), *self.contexts)
        self.requests += 1
        return np.asarray(hv, np.float64)

    def hess(self, x: Any) -> np.ndarray:
        """∇²f(x), dense, one ``/hessian`` request."""
        H = self.client.hessian(self.name, self.backend, np.asarray(x, np.float64), *self.contexts)
        self.requests += 1
        return np.asarray(H, np.float64)

    # --- constraints: c(x) for scipy's NonlinearConstraint or SLSQP's dicts ---------
    def _constraint_at(self, x: Any) -> None:
        x = np.asarray(x, dtype=np.float64)
        if self._cx is not None and self._cx.shape == x.shape and np.array_equal(self._cx, x):
            return
        value, jacobian = self.client.value_and_jacobian(self.name, self.backend, x, *self.contexts)
        self.requests += 1
        value = np.atleast_1d(np.asarray(value, np.float64))
        if not hasattr(jacobian, "tocsr"):  # dense: (m, n) even for a scalar c
            jacobian = np.asarray(jacobian, np.float64).reshape(value.size, x.size)
        self._cx, self._c_value, self._c_jacobian = x.copy(), value, jacobian

    def constraint_fun(self, x: Any) -> np.ndarray:
        """c(x) as a 1-D float64 array (m,)."""
        self._constraint_at(x)
        return self._c_value.copy()

    def constraint_jac(self, x: Any) -> Any:
        """∂c/∂x (m, n): float64, or a scipy.sparse array with a ``Sparse`` backend
        (one ``/value_and_jacobian`` with ``constraint_fun`` at this x)."""
        self._constraint_at(x)
        return self._c_jacobian.copy()

    def constraint(self, lb: Any = -np.inf, ub: Any = np.inf, **options: Any) -> Any:
        """``scipy.optimize.NonlinearConstraint(c, lb, ub, jac=∂c/∂x, **options)``
        (``trust-constr``, ``COBYQA``, ``SLSQP``...; ``hess`` defaults to scipy's BFGS)."""
        from scipy.optimize import NonlinearConstraint

        return NonlinearConstraint(self.constraint_fun, lb, ub, jac=self.constraint_jac, **options)

    def slsqp(self, kind: str = "ineq") -> dict[str, Any]:
        """SLSQP's (and COBYLA's) form: ``{"type": kind, "fun": c, "jac": ∂c/∂x}``;
        ``"ineq"`` means c(x) >= 0, ``"eq"`` c(x) = 0. ``jac`` is dense here."""
        if kind not in ("ineq", "eq"):
            raise ValueError(f"kind must be 'ineq' or 'eq', got {kind!r}")

        def jac(x: Any) -> np.ndarray:
            J = self.constraint_jac(x)
            return J.toarray() if hasattr(J, "toarray") else J

        return {"type": kind, "fun": self.constraint_fun, "jac": jac}
