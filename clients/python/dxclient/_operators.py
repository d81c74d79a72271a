"""Operator methods shared by ``Client`` and ``AsyncClient``.

Generated once from the operator table so the names and argument order match the
library exactly (``op(f, backend, x, [tangents], *contexts, prep=None)``). Each
method returns whatever ``self._operator`` returns: results for ``Client``, an
awaitable for ``AsyncClient``. Regenerate with ``python -m dxclient._gen`` if the
table changes (a test checks they agree).
"""

from __future__ import annotations

from typing import Any

from ._models import RemoteFunction, RemotePrep
from .backends import Backend

F = RemoteFunction | str
B = Backend | str


class OperatorMethods:
    """``op(f, backend, x, [tangents], *contexts, prep=None)`` for every operator."""

    def _operator(self, operator: str, f: F, backend: B, x: Any, tangents: Any,
                  contexts: tuple, prep: RemotePrep | None) -> Any:
        raise NotImplementedError

    def _prepare(self, operator: str, f: F, backend: B, x: Any, tangents: Any,
                 contexts: tuple) -> Any:
        raise NotImplementedError

    def value(self, f: F, backend: B, x: Any, *contexts: Any,
                 prep: RemotePrep | None = None) -> Any:
        """f(x, *contexts)."""
        return self._operator("value", f, backend, x, None, contexts, prep)

    def prepare_value(self, f: F, backend: B, x: Any, *contexts: Any) -> Any:
        """Compile ``value`` on the server for this signature; returns a RemotePrep."""
        return self._prepare("value", f, backend, x, None, contexts)

    def derivative(self, f: F, backend: B, x: Any, *contexts: Any,
                      prep: RemotePrep | None = None) -> Any:
        """f'(x) for scalar x."""
        return self._operator("derivative", f, backend, x, None, contexts, prep)

    def prepare_derivative(self, f: F, backend: B, x: Any, *contexts: Any) -> Any:
        """Compile ``derivative`` on the server for this signature; returns a RemotePrep."""
        return self._prepare("derivative", f, backend, x, None, contexts)

    def value_and_derivative(self, f: F, backend: B, x: Any, *contexts: Any,
                                prep: RemotePrep | None = None) -> Any:
        """(f(x), f'(x))."""
        return self._operator("value_and_derivative", f, backend, x, None, contexts, prep)

    def prepare_value_and_derivative(self, f: F, backend: B, x: Any, *contexts: Any) -> Any:
        """Compile ``value_and_derivative`` on the server for this signature; returns a RemotePrep."""
        return self._prepare("value_and_derivative", f, backend, x, None, contexts)

    def second_derivative(self, f: F, backend: B, x: Any, *contexts: Any,
                             prep: RemotePrep | None = None) -> Any:
        """f''(x) for scalar x."""
        return self._operator("second_derivative", f, backend, x, None, contexts, prep)

    def prepare_second_derivative(self, f: F, backend: B, x: Any, *contexts: Any) -> Any:
        """Compile ``second_derivative`` on the server for this signature; returns a RemotePrep."""
        return self._prepare("second_derivative", f, backend, x, None, contexts)

    def value_derivative_and_second_derivative(self, f: F, backend: B, x: Any, *contexts: Any,
                                                  prep: RemotePrep | None = None) -> Any:
        """(f(x), f'(x), f''(x))."""
        return self._operator("value_derivative_and_second_derivative", f, backend, x, None, contexts, prep)

    def prepare_value_derivative_and_second_derivative(self, f: F, backend: B, x: Any, *contexts: Any) -> Any:
        """Compile ``value_derivative_and_second_derivative`` on the server for this signature; returns a RemotePrep."""
        return self._prepare("value_derivative_and_second_derivative", f, backend, x, None, contexts)

    def gradient(self, f: F, backend: B, x: Any, *contexts: Any,
                    prep: RemotePrep | None = None) -> Any:
        """∇f(x), shaped like x."""
        return self._operator("gradient", f, backend, x, None, contexts, prep)

    def prepare_gradient(self, f: F, backend: B, x: Any, *contexts: Any) -> Any:
        """Compile ``gradient`` on the server for this signature; returns a RemotePrep."""
        return self._prepare("gradient", f, backend, x, None, contexts)

    def value_and_gradient(self, f: F, backend: B, x: Any, *contexts: Any,
                              prep: RemotePrep | None = None) -> Any:
        """(f(x), ∇f(x))."""
        return self._operator("value_and_gradient", f, backend, x, None, contexts, prep)

    def prepare_value_and_gradient(self, f: F, backend: B, x: Any, *contexts: Any) -> Any:
        """Compile ``value_and_gradient`` on the server for this signature; returns a RemotePrep."""
        return self._prepare("value_and_gradient", f, backend, x, None, contexts)

    def jacobian(self, f: F, backend: B, x: Any, *contexts: Any,
                    prep: RemotePrep | None = None) -> Any:
        """∂f/∂x, shape y.shape + x.shape."""
        return self._operator("jacobian", f, backend, x, None, contexts, prep)

    def prepare_jacobian(self, f: F, backend: B, x: Any, *contexts: Any) -> Any:
        """Compile ``jacobian`` on the server for this signature; returns a RemotePrep."""
        return self._prepare("jacobian", f, backend, x, None, contexts)

    def value_and_jacobian(self, f: F, backend: B, x: Any, *contexts: Any,
                              prep: RemotePrep | None = None) -> Any:
        """(f(x), ∂f/∂x)."""
        return self._operator("value_and_jacobian", f, backend, x, None, contexts, prep)

    def prepare_value_and_jacobian(self, f: F, backend: B, x: Any, *contexts: Any) -> Any:
        """Compile ``value_and_jacobian`` on the server for this signature; returns a RemotePrep."""
        return self._prepare("value_and_jacobian", f, backend, x, None, contexts)

    def hessian(self, f: F, backend: B, x: Any, *contexts: Any,
                   prep: RemotePrep | None = None) -> Any:
        """∇²f(x), shape x.shape + x.shape."""
        return self._operator("hessian", f, backend, x, None, contexts, prep)

    def prepare_hessian(self, f: F, backend: B, x: Any, *contexts: Any) -> Any:
        """Compile ``hessian`` on the server for this signature; returns a RemotePrep."""
        return self._prepare("hessian", f, backend, x, None, contexts)

    def value_gradient_and_hessian(self, f: F, backend: B, x: Any, *contexts: Any,
                                      prep: RemotePrep | None = None) -> Any:
        """(f(x), ∇f(x), ∇²f(x))."""
        return self._operator("value_gradient_and_hessian", f, backend, x, None, contexts, prep)

    def prepare_value_gradient_and_hessian(self, f: F, backend: B, x: Any, *contexts: Any) -> Any:
        """Compile ``value_gradient_and_hessian`` on the server for this signature; returns a RemotePrep."""
        return self._prepare("value_gradient_and_hessian", f, backend, x, None, contexts)

    def pushforward(self, f: F, backend: B, x: Any, tangents: tuple, *contexts: Any,
                       prep: RemotePrep | None = None) -> Any:
        """(J t for t in tangents)."""
        return self._operator("pushforward", f, backend, x, tangents, contexts, prep)

    def prepare_pushforward(self, f: F, backend: B, x: Any, tangents: tuple, *contexts: Any) -> Any:
        """Compile ``pushforward`` on the server for this signature; returns a RemotePrep."""
        return self._prepare("pushforward", f, backend, x, tangents, contexts)

    def value_and_pushforward(self, f: F, backend: B, x: Any, tangents: tuple, *contexts: Any,
                                 prep: RemotePrep | None = None) -> Any:
        """(f(x), (J t for t in tangents))."""
        return self._operator("value_and_pushforward", f, backend, x, tangents, contexts, prep)

    def prepare_value_and_pushforward(self, f: F, backend: B, x: Any, tangents: tuple, *contexts: Any) -> Any:
        """Compile ``value_and_pushforward`` on the server for this signature; returns a RemotePrep."""
        return self._prepare("value_and_pushforward", f, backend, x, tangents, contexts)

    def pullback(self, f: F, backend: B, x: Any, tangents: tuple, *contexts: Any,
                    prep: RemotePrep | None = None) -> Any:
        """(Jᵀ c for c in tangents)."""
        return self._operator("pullback", f, backend, x, tangents, contexts, prep)

    def prepare_pullback(self, f: F, backend: B, x: Any, tangents: tuple, *contexts: Any) -> Any:
        """Compile ``pullback`` on the server for this signature; returns a RemotePrep."""
        return self._prepare("pullback", f, backend, x, tangents, contexts)

    def value_and_pullback(self, f: F, backend: B, x: Any, tangents: tuple, *contexts: Any,
                              prep: RemotePrep | None = None) -> Any:
        """(f(x), (Jᵀ c for c in tangents))."""
        return self._operator("value_and_pullback", f, backend, x, tangents, contexts, prep)

    def prepare_value_and_pullback(self, f: F, backend: B, x: Any, tangents: tuple, *contexts: Any) -> Any:
        """Compile ``value_and_pullback`` on the server for this signature; returns a RemotePrep."""
        return self._prepare("value_and_pullback", f, backend, x, tangents, contexts)

    def hvp(self, f: F, backend: B, x: Any, tangents: tuple, *contexts: Any,
               prep: RemotePrep | None = None) -> Any:
        """(∇²f(x) t for t in tangents)."""
        return self._operator("hvp", f, backend, x, tangents, contexts, prep)

    def prepare_hvp(self, f: F, backend: B, x: Any, tangents: tuple, *contexts: Any) -> Any:
        """Compile ``hvp`` on the server for this signature; returns a RemotePrep."""
        return self._prepare("hvp", f, backend, x, tangents, contexts)

    def gradient_and_hvp(self, f: F, backend: B, x: Any, tangents: tuple, *contexts: Any,
                            prep: RemotePrep | None = None) -> Any:
        """(∇f(x), (∇²f(x) t for t in tangents))."""
        return self._operator("gradient_and_hvp", f, backend, x, tangents, contexts, prep)

    def prepare_gradient_and_hvp(self, f: F, backend: B, x: Any, tangents: tuple, *contexts: Any) -> Any:
        """Compile ``gradient_and_hvp`` on the server for this signature; returns a RemotePrep."""
        return self._prepare("gradient_and_hvp", f, backend, x, tangents, contexts)

    jvp = pushforward
    vjp = pullback
