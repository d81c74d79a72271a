"""SciPy adapters: a served function shaped for ``scipy.optimize.minimize``.

    problem = client.scipy("rosenbrock", backend="auto")
    minimize(problem.fun, x0, jac=problem.jac, hessp=problem.hessp, method="trust-ncg")

``fun`` and ``jac`` share one ``/value_and_gradient`` request per point: the last
point and its answer are kept, so SciPy asking for both at the same ``x`` costs one
round trip. ``hessp(x, p)`` is one ``/hvp``; ``hess(x)`` one ``/hessian``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ._models import RemoteFunction, function_name
from .backends import Backend

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
        #: service requests made (value_and_gradient, hvp, hessian), for inspection
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
