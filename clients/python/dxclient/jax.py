"""Served functions inside JAX: ``remote_function(client, name)`` is a JAX-callable.

    g = remote_function(client, "rosenbrock")
    jax.jit(jax.grad(g))(x); jax.hessian(g)(x); jax.vmap(jax.grad(g))(xs)

Every call to the service goes through ``jax.pure_callback`` (``vmap_method=
"expand_dims"``), so ``g`` works under ``jit`` and ``vmap``. Under ``vmap``, nested or
not, all points travel in one request with ``batch_axis=0`` (the vmapped axes flattened
into one), unless contexts differ between points: a batched request shares its contexts,
so those go one request per point. Derivatives are custom rules, never JAX tracing the
served function. The rules are ``dxcontract.jax_rules`` (shared with dxserve's
``DifferentiateWith``); this module is their caller over a ``Client``:

* **scalar output** (the case of losses, log-densities, objectives). The JVP of ``g``
  is ``<∇g(x), t>`` with ``∇g(x)`` from one ``/value_and_gradient`` request: an ordinary
  JAX dot product, so JAX transposes it itself, and ``jax.grad``, ``jax.vjp`` and
  ``jax.jacfwd`` all cost that one request. The gradient is in turn a ``custom_jvp``
  function whose tangent rule is the service's ``/hvp`` (forward-over-reverse on the
  server), and that HVP is a linear map (a JAX primitive, transposable and batchable)
  whose transpose is ``/hvp`` again (the Hessian is symmetric). So ``jax.hessian(g)``,
  ``jax.jvp(jax.grad(g), ...)`` and
  ``jax.grad`` of any function of ``jax.grad(g)`` reach ``/hvp``; batched tangents
  (``jacfwd``, ``hessian``, ``vmap`` over tangents) travel in one ``/hvp`` request.
* **array output**. The JVP is ``/pushforward``, a linear map whose transpose is
  ``/pullback``: ``jax.jvp``, ``jax.jacfwd``, ``jax.vjp`` and ``jax.jacrev`` work.

Differentiating a JVP or HVP with respect to its point (third order of a scalar
function, second order of an array-valued one) raises a ``TypeError`` at trace time
rather than returning a wrong zero.

Every floating-point argument is differentiated, contexts too, as JAX's ``argnums``
asks: ``jax.grad(g, argnums=1)(w, data)`` sends ``/value_and_gradient`` with
``"wrt": 1`` and returns the real cotangent, ``argnums=(0, 1)`` a request with
``"wrt": [0, 1]`` and a tuple; a derivative of the gradient in another argument (a
mixed block) is one ``/hvp`` over both. Integer and key contexts are held fixed; typed
PRNG keys travel as keys. ``x`` may be a pytree (a dict of arrays) for scalar
functions, as on the server. ``client`` must be a synchronous ``Client``: an
``AsyncClient`` is refused (``TypeError``), since JAX's callbacks cannot await.

The output's shape and dtype come from ``result_shape`` if given, else from one
``/value`` request per input signature at trace time (at ``x``'s value if concrete,
else at zeros), remembered per signature.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    import jax
except ImportError as exc:
    from dxcontract.extras import install_hint

    raise ImportError(f"dxclient.jax needs JAX: {install_hint('jax')}") from exc

import numpy as np

from dxcontract.backends import Backend
from dxcontract.jax_rules import Function

from ._client import Client
from ._models import RemoteFunction, function_name

__all__ = ["remote_function"]


def remote_function(
    client: Client,
    f: RemoteFunction | str,
    backend: Backend | str = "auto",
    *,
    result_shape: jax.ShapeDtypeStruct | None = None,
) -> Callable[..., Any]:
    """A JAX-callable ``g(x, *contexts)`` evaluating and differentiating ``f`` on the server.

    ``client`` is a synchronous ``dxclient.Client`` (callbacks run synchronously).
    ``result_shape``: ``f``'s output as a ``jax.ShapeDtypeStruct``; by default learnt
    from one ``/value`` request per input signature.
    """
    if not isinstance(client, Client):
        kind = type(client).__name__
        raise TypeError(
            f"remote_function needs a synchronous dxclient.Client, got {kind}: JAX runs "
            "its callbacks synchronously, and an AsyncClient's calls are coroutines it "
            "cannot await; open a Client(url) for the JAX bridge (an AsyncClient can "
            "share the server, not the callbacks)"
        )
    name = function_name(f)
    return Function(
        _Served(client, name, backend), result_shape, name=name,
        label=f"remote_function({name!r}, backend={backend!r})",
    )


class _Served:
    """The service's operators on numpy arguments (inside callbacks): the caller of
    ``dxcontract.jax_rules``."""

    traces = False
    value_traces = False
    fixed = (
        "dxclient.jax: a mixed second derivative of an array-valued served function (its "
        "pushforward or pullback in one argument, differentiated in another) is not "
        "available; differentiate with respect to all of those arguments at once "
        "(argnums=(0, 1)), which is served"
    )
    #: second order of an array-valued function: the linear maps' derivatives in x,
    #: HVPs of ``<c, f>`` (``/hvp`` with a ``cotangent``)
    derivatives: dict[str, tuple[str, str]] = {  # noqa: RUF012 - read only
        "pullback": ("pullback_derivative", "pullback_derivative"),
        "pushforward": ("pushforward_derivative", "pushforward_derivative_transpose"),
    }
    #: the server composes wrt and a cotangent: second order in any arguments
    derivatives_take_wrt = True
    beyond = (
        "dxclient.jax: derivatives of a served function's HVP, or of the second "
        "derivatives of an array-valued one, with respect to its point (third order) "
        "are not available: the service serves up to Hessian-vector products"
    )

    def __init__(self, client: Client, name: str, backend: Backend | str) -> None:
        self.client, self.name, self.backend = client, name, backend

    def value(
        self, x: Any, contexts: tuple, batch_axis: int | None = None, wrt: Any = None
    ) -> Any:
        return self.client.value(
            self.name, self.backend, x, *contexts, batch_axis=batch_axis, **_wrt(wrt)
        )

    def value_and_gradient(
        self, x: Any, contexts: tuple, batch_axis: int | None = None, wrt: Any = None
    ) -> Any:
        return self.client.value_and_gradient(
            self.name, self.backend, x, *contexts, batch_axis=batch_axis, **_wrt(wrt)
        )

    def batch_op(
        self, op: str, x: Any, tangents: list, contexts: tuple, batch_axis: int | None = None,
        wrt: Any = None,
    ) -> list:
        """``op`` (hvp, pushforward, pullback) at one point for a list of tangents; with
        ``batch_axis=0``, at B points (x's leading axis) for tangents that lead with B too.
        ``wrt``: the arguments differentiated (tangents and results: tuples over them)."""
        if not tangents:
            return []
        if op in ("hvp", "pushforward", "pullback"):
            return list(getattr(self.client, op)(
                self.name, self.backend, x, tuple(tangents), *contexts, batch_axis=batch_axis,
                **_wrt(wrt),
            ))
        if batch_axis is not None and wrt is not None and wrt != 0:
            raise TypeError(self.beyond)  # the points are the named arguments': not split here
        if batch_axis is not None:  # the map's own tangent differs per point: point by point
            count = np.shape(jax.tree.leaves(x)[0])[0]
            at = [
                self.batch_op(
                    op, jax.tree.map(lambda v, i=i: v[i], x),
                    [jax.tree.map(lambda v, i=i: v[i], t) for t in tangents],
                    (jax.tree.map(lambda v, i=i: v[i], contexts[0]), *contexts[1:]),
                )
                for i in range(count)
            ]
            return [
                jax.tree.map(lambda *vs: np.stack([np.asarray(v) for v in vs]), *column)
                for column in zip(*at, strict=True)
            ]
        head, rest = contexts[0], tuple(contexts[1:])
        named = _wrt(wrt)
        if op == "pullback_derivative":  # s -> H s, H the Hessian of <c, f> (c: head)
            return list(self.client.hvp(
                self.name, self.backend, x, tuple(tangents), *rest, cotangent=head, **named
            ))
        if op == "pushforward_derivative_transpose":  # w -> H t, H the Hessian of <w, f>
            return [
                self.client.hvp(
                    self.name, self.backend, x, (head,), *rest, cotangent=w, **named
                )[0]
                for w in tangents
            ]
        if op == "pushforward_derivative":  # s -> d/ds (J t): one HVP per output entry
            return self._second_pushforwards(x, head, list(tangents), rest, named)
        raise ValueError(f"no operator {op!r}")

    def _second_pushforwards(
        self, x: Any, t: Any, tangents: list, contexts: tuple, named: dict[str, Any]
    ) -> list:
        """``(∂²f(x)[t, s] for s in tangents)``, each shaped like f(x): entry i is
        ``<t, H_i s>``, H_i the Hessian of f's entry i (``/hvp`` with its unit
        cotangent), so it costs one request per entry of f(x)."""
        y = np.asarray(self.client.value(self.name, self.backend, x, *contexts))
        if not np.issubdtype(y.dtype, np.floating):
            raise TypeError(f"{self.beyond} (for an output of dtype {y.dtype})")
        flat = np.zeros((len(tangents), y.size), y.dtype)
        for i in range(y.size):
            unit = np.zeros(y.size, y.dtype)
            unit[i] = 1
            rows = self.client.hvp(
                self.name, self.backend, x, tuple(tangents), *contexts,
                cotangent=unit.reshape(y.shape), **named,
            )
            for k, h in enumerate(rows):
                flat[k, i] = sum(
                    np.sum(np.asarray(a) * np.asarray(b))
                    for a, b in zip(jax.tree.leaves(t), jax.tree.leaves(h), strict=True)
                )
        return [row.reshape(y.shape) for row in flat]


def _wrt(wrt: Any) -> dict[str, Any]:
    """``wrt`` as a keyword, left out for x alone (the request a server of any version
    answers)."""
    return {} if wrt is None or wrt == 0 else {"wrt": wrt}
