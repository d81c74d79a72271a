"""Functions of structured inputs for ``tests/library/test_pytrees.py`` (and its server).

Each is a ``@dxserve.function`` of a pytree: dicts, tuples, lists, nestings, None nodes,
pytree outputs and pytree contexts. ``SCENARIOS`` gives each one's example ``x`` and
contexts; the references are JAX's own (``jax.grad``, ``jax.jacobian``, ``jax.hessian``
of the same function, run in float64 by the tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import dxserve


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


# --- scalar-valued: gradient, hessian, hvp ---------------------------------------------
@dxserve.function
def pt_dict_scalar(p: dict) -> jax.Array:
    """{"w": (3, 2), "b": (2,)} -> sum(tanh(1 @ w + b)^2) + |w|^2 / 10"""
    z = jnp.ones(3) @ p["w"] + p["b"]
    return jnp.sum(jnp.tanh(z) ** 2) + 0.1 * jnp.sum(p["w"] ** 2)


@dxserve.function
def pt_tuple_scalar(p: tuple) -> jax.Array:
    """(a (3,), s ()) -> s * sum(sin(a)) + s^3"""
    a, s = p
    return s * jnp.sum(jnp.sin(a)) + s**3


@dxserve.function
def pt_list_scalar(p: list) -> jax.Array:
    """[u (2,), M (2, 2)] -> u' M u + sum(exp(u) / 2)"""
    u, m = p
    return u @ m @ u + 0.5 * jnp.sum(jnp.exp(u))


@dxserve.function
def pt_nested_scalar(p: dict) -> jax.Array:
    """{"layers": [(W1 (2, 3), b1 (3,)), (W2 (3, 1), b2 (1,))], "scale": ()} -> scalar"""
    h = jnp.array([0.3, -0.7])
    for w, b in p["layers"]:
        h = jnp.tanh(h @ w + b)
    return p["scale"] ** 2 * jnp.sum(h**2) + jnp.sum(p["layers"][0][0] ** 2)


@dxserve.function
def pt_none_scalar(p: dict) -> jax.Array:
    """{"w": (3,), "frozen": None} -> sum(w^4); None is an empty pytree node"""
    return jnp.sum(p["w"] ** 4)


@dxserve.function
def pt_context_tree(x: jax.Array, ctx: tuple) -> jax.Array:
    """x (3,), ctx ({"A": (3, 3)}, [c (3,)]) -> x' A x + c . sin(x); contexts are pytrees"""
    a, (c,) = ctx[0]["A"], ctx[1]
    return x @ a @ x + c @ jnp.sin(x)


# --- pytree-valued: jacobian blocks -----------------------------------------------------
@dxserve.function
def pt_dict_to_dict(p: dict) -> dict:
    """{"u": (3,), "v": (2,)} -> {"a": sin(u) v0 (3,), "b": |u|^2 + v1 ()}"""
    return {"a": jnp.sin(p["u"]) * p["v"][0], "b": jnp.sum(p["u"] ** 2) + p["v"][1]}


@dxserve.function
def pt_tuple_to_tuple(p: tuple) -> tuple:
    """(a (2,), M (2, 2)) -> (M a (2,), outer(a, a) * M (2, 2))"""
    a, m = p
    return m @ a, jnp.outer(a, a) * m


@dxserve.function
def pt_array_to_list(x: jax.Array) -> list:
    """x (3,) -> [cumsum(x) (3,), {"s": sum(x^3) ()}]"""
    return [jnp.cumsum(x), {"s": jnp.sum(x**3)}]


@dxserve.function
def pt_list_to_array(p: list) -> jax.Array:
    """[u (2,), v (3,)] -> (4,) mixing both"""
    u, v = p
    return jnp.concatenate([u * v[:2], jnp.array([jnp.sum(v**2) * u[0], jnp.prod(v)])])


# --- a 2-layer MLP whose parameters are a list of layer dicts --------------------------
def mlp(params: list, x: jax.Array) -> jax.Array:
    """params [{"W": (2, 8), "b": (8,)}, {"W": (8, 1), "b": (1,)}], x (N, 2) -> (N,)"""
    h = jnp.tanh(x @ params[0]["W"] + params[0]["b"])
    return (h @ params[1]["W"] + params[1]["b"])[:, 0]


@dxserve.function
def pt_mlp_loss(params: list, x: jax.Array, y: jax.Array) -> jax.Array:
    """mean squared error of the 2-layer MLP on (x (N, 2), y (N,))"""
    return jnp.mean((mlp(params, x) - y) ** 2)


def mlp_params(seed: int = 0) -> list:
    r = _rng(seed)
    return [
        {"W": r.normal(size=(2, 8)) * 0.5, "b": np.zeros(8)},
        {"W": r.normal(size=(8, 1)) * 0.5, "b": np.zeros(1)},
    ]


def mlp_data(n: int = 32, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    r = _rng(seed)
    x = r.uniform(-1, 1, size=(n, 2))
    return x, np.sin(2 * x[:, 0]) * x[:, 1]


# --- the scenarios ------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    name: str
    f: Any
    x: Any
    contexts: tuple = ()

    @property
    def scalar(self) -> bool:
        y = jax.eval_shape(self.f, self.x, *self.contexts)
        return not isinstance(y, dict | list | tuple) and y.shape == ()


_r = _rng(7)
SCENARIOS: list[Scenario] = [
    Scenario("pt_dict_scalar", pt_dict_scalar,
             {"w": _r.normal(size=(3, 2)), "b": _r.normal(size=2)}),
    Scenario("pt_tuple_scalar", pt_tuple_scalar, (_r.normal(size=3), np.array(0.7))),
    Scenario("pt_list_scalar", pt_list_scalar, [_r.normal(size=2), _r.normal(size=(2, 2))]),
    Scenario("pt_nested_scalar", pt_nested_scalar, {
        "layers": [(_r.normal(size=(2, 3)), _r.normal(size=3)),
                   (_r.normal(size=(3, 1)), _r.normal(size=1))],
        "scale": np.array(1.3),
    }),
    Scenario("pt_none_scalar", pt_none_scalar, {"w": _r.normal(size=3), "frozen": None}),
    Scenario("pt_context_tree", pt_context_tree, _r.normal(size=3),
             (({"A": _r.normal(size=(3, 3))}, [_r.normal(size=3)]),)),
    Scenario("pt_dict_to_dict", pt_dict_to_dict, {"u": _r.normal(size=3), "v": _r.normal(size=2)}),
    Scenario("pt_tuple_to_tuple", pt_tuple_to_tuple, (_r.normal(size=2), _r.normal(size=(2, 2)))),
    Scenario("pt_array_to_list", pt_array_to_list, _r.normal(size=3)),
    Scenario("pt_list_to_array", pt_list_to_array, [_r.normal(size=2), _r.normal(size=3)]),
    Scenario("pt_mlp_loss", pt_mlp_loss, mlp_params(), mlp_data()),
]
BY_NAME = {s.name: s for s in SCENARIOS}
del _r
