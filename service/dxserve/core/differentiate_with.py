"""``DifferentiateWith(f, backend)``: a function whose derivatives come from ``backend``.

DifferentiationInterface's wrapper: ``g = DifferentiateWith(f, backend)`` is called
like ``f`` (``g(x, *contexts)``), and inside any JAX transformation (``grad``, ``jvp``,
``vjp``, ``jacfwd``, ``jacrev``, ``hessian``, ``jit``, ``vmap``) its derivatives are
dxserve's operators with ``backend``, not JAX's differentiation of ``f``:

* ``f`` that JAX cannot trace (numpy, SciPy): its value comes through
  ``jax.pure_callback``, its first derivatives from ``value_and_gradient`` (scalar
  output) or ``pushforward`` / ``pullback`` (array output), its second from ``hvp``
  and second-order pushforwards with the same backend, all on concrete arrays. Under
  ``vmap`` the points go in one call with ``batch_axis=0`` (a loop where the backend
  cannot vectorize a black box). The same holds for a JAX ``f`` with a backend other
  than JAX's modes (finite differences), except that its value is ``f`` itself.
* ``f`` that traces with JAX's modes (``jax-forward`` to force forward mode on a
  piece): ``f``'s value directly, its derivatives the operators' own JAX expressions
  on the traced values, so ``jit`` compiles them with the rest and JAX batches them.

Outside a transformation ``g(x, *contexts)`` is ``f(x, *contexts)``. Every
floating-point argument is differentiated as JAX's ``argnums`` asks
(``jax.grad(g, argnums=(0, 1))``): the backend is asked with ``wrt`` for the arguments
a transformation moves, never a zero in their place. The rules serve up to second
order of ``f`` when it runs outside JAX (for an array-valued ``f``, second order in x
alone); past that they raise a ``TypeError`` naming the wrapper and its backend.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from dxcontract.backends import Backend, JaxForward, JaxReverse, SecondOrder, backend_from_json
from dxserve.core.backends import engines_for, resolve_backend
from dxserve.core.nesting import BackendCaller, concrete_zeros
from dxserve.core.preparation import normalize, probe
from dxserve.frameworks import framework_of


class DifferentiateWith:
    """``f`` whose derivatives inside JAX transformations come from ``backend``.

    ``backend``: a descriptor or its JSON form (``"finite-differences"``,
    ``{"type": "jax-forward"}``, ...), checked here; a ``SecondOrder`` one takes first
    derivatives with its inner backend and second derivatives with both. Calls return
    what ``f`` returns.
    """

    def __init__(self, f: Callable, backend: Backend | str | dict) -> None:
        if not callable(f):
            raise TypeError(f"DifferentiateWith needs a function, got {type(f).__name__}")
        self.f = f
        self.backend = backend_from_json(backend)
        self.__name__ = getattr(f, "__name__", type(f).__name__)
        self.__doc__ = getattr(f, "__doc__", None)

    def __repr__(self) -> str:
        return f"DifferentiateWith({self.__name__}, {self.backend.to_json()})"

    def __call__(self, x: Any, *contexts: Any) -> Any:
        framework = framework_of(self.f)
        if not framework.is_traced((x, contexts)):
            return self.f(x, *contexts)
        x, _, contexts = normalize(x, None, contexts)
        traced, y = probe(
            self.f, concrete_zeros(framework, x), concrete_zeros(framework, contexts), framework
        )
        leaves = framework.leaves(y)
        scalar = len(leaves) == 1 and leaves[0] is y and tuple(y.shape) == ()
        sizes = [sum(math.prod(v.shape) for v in framework.leaves(t)) for t in (x, y)]
        # a SecondOrder backend differentiates first order with its inner one, as in DI
        first = self.backend.inner if isinstance(self.backend, SecondOrder) else self.backend
        resolved = resolve_backend(
            first, "gradient" if scalar else "pushforward", traced=traced, n=sizes[0],
            m=sizes[1],
        )
        engines_for(resolved, traced=traced)  # a JAX mode on a black box: named here
        second = resolve_backend(self.backend, "hvp", traced=traced, n=sizes[0], m=sizes[1])
        # JAX transposes and differentiates its own modes' expressions; other backends'
        # (finite differences are not linear in the tangent as JAX sees them) go through
        # the linear maps, their transposes the backend's paired operators
        inline = traced and _jax_modes(resolved) and _jax_modes(second)
        backend = self.backend
        if (
            inline and (_forward(resolved) or _forward(second))
            and not _reverses(self.f, concrete_zeros(framework, x),
                              concrete_zeros(framework, contexts))
        ):
            # forward mode forced on a piece JAX cannot reverse-differentiate (a
            # lax.while_loop). Its gradient is forward mode's (basis pushforwards), so
            # its second order forward-over-forward; and JAX cannot transpose the JVP
            # expressions of a vector piece, whose pullbacks then come from the
            # backend's own operator (J^T c from basis pushforwards), outside the trace
            if isinstance(backend, JaxForward):
                backend = SecondOrder(backend, JaxForward())
            inline = scalar
        caller = BackendCaller(
            self.f, backend, framework, repr(self), traces=inline, value_traces=traced
        )
        return framework.substitute("value", caller, x, None, contexts, y)[0]


def _forward(backend: Backend) -> bool:
    """Is any engine of the concrete ``backend`` JAX's forward mode?"""
    if isinstance(backend, SecondOrder):
        return _forward(backend.outer) or _forward(backend.inner)
    return isinstance(backend, JaxForward)


def _reverses(f: Callable, x: Any, contexts: tuple) -> bool:
    """Does JAX's reverse mode trace ``f`` at (abstract) ``x``?"""
    from dxserve.frameworks.jax.framework import reverse_traces

    return reverse_traces(f, x, contexts)


def _jax_modes(backend: Backend) -> bool:
    """Is every engine of the concrete ``backend`` one of JAX's own modes?"""
    if isinstance(backend, SecondOrder):
        return _jax_modes(backend.outer) and _jax_modes(backend.inner)
    return isinstance(backend, JaxForward | JaxReverse)
