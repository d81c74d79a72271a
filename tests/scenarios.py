"""Test scenarios with hand-written numpy references, after DifferentiationInterfaceTest.

Every scenario is a function ``f(x, *contexts)`` written in ``jax.numpy`` together with
its input ``x``, its contexts (constants that are not differentiated) and analytic
references computed by hand in numpy (never with JAX):

- ``value``: ``f(x, *contexts)``;
- ``jacobian``: ``y.shape + x.shape`` for every array-in/array-out scenario; it *is* the
  ``derivative`` when x is a scalar and the ``gradient`` when y is a scalar;
- ``hessian`` (``x.shape + x.shape``) for scalar-valued scenarios;
- ``second_derivative`` (``y.shape``) for scalar-input scenarios;
- for the pytree scenario (x a dict), ``gradient`` and a hand-derived ``hvp_ref``; its
  ``jacobian`` and ``hessian`` are ``jax.jacobian``'s and ``jax.hessian``'s blocks (dicts
  of dicts), built from those.

The module is reusable: the in-process conformance suite imports it, the HTTP tests
import it, and the server registers its functions with ``--functions tests.scenarios``
(each is marked with ``@dxserve.function`` under its scenario's unique name).

Helpers:
- ``applies(s, op)``: does operator ``op`` apply to scenario ``s``;
- ``expected_error(s, op)``: the error class the library raises when it does not;
- ``tangents(s, op)``: deterministic tangents ``(t, -t)`` (x's shape, or y's for pullback);
- ``expected(s, op, tangents)``: the reference result(s), in the library's return order
  (one value for single-result operators, a tuple otherwise; tangent results are tuples);
- ``assert_close(actual, expected, rtol, atol)``: compare nested tuples/dicts of arrays.

Piecewise functions (``abs``, ``maximum``, ``where``) are evaluated away from their kinks.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import dxserve
from dxcontract.errors import (
    DxError,
    NotScalarInputError,
    NotScalarOutputError,
)
from dxcontract.operators import OPERATORS

# --- the record ---------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Scenario:
    name: str
    kind: str  # e.g. "vector->scalar"; see KINDS
    f: Callable
    x: Any  # float64 numpy array (0-d for scalars) or a dict of them
    contexts: tuple
    value: Any
    jacobian: Any = None  # y.shape + x.shape (array x and y)
    derivative: Any = None  # y.shape, scalar x
    gradient: Any = None  # x's structure, scalar y
    hessian: Any = None  # x.shape + x.shape, scalar y, array x
    second_derivative: Any = None  # y.shape, scalar x
    hvp_ref: Callable | None = None  # t -> H t, for pytree x (no dense hessian)

    @property
    def x_is_tree(self) -> bool:
        return isinstance(self.x, dict)

    @property
    def x_is_scalar(self) -> bool:
        return not self.x_is_tree and np.ndim(self.x) == 0

    @property
    def y_is_scalar(self) -> bool:
        return np.ndim(self.value) == 0

    def __repr__(self) -> str:
        return f"Scenario({self.name}, {self.kind})"


KINDS = (
    "scalar->scalar",
    "scalar->vector",
    "scalar->matrix",
    "vector->scalar",
    "matrix->scalar",
    "vector->vector",
    "vector->vector (m != n)",
    "vector->matrix",
    "matrix->vector",
    "matrix->matrix",
    "pytree->scalar",
)

SCENARIOS: list[Scenario] = []


def _arr(v: Any) -> np.ndarray:
    return np.asarray(v, dtype=np.float64)


def _hessian_blocks(x: dict, hvp: Callable) -> dict:
    """``{p: {q: H[p][q]}}`` of shape ``x[p].shape + x[q].shape``, from ``t -> H t``."""
    blocks: dict = {p: {} for p in x}
    for q, xq in x.items():
        columns = []
        for j in range(xq.size):
            t = {k: np.zeros_like(v) for k, v in x.items()}
            t[q].reshape(-1)[j] = 1.0
            columns.append(hvp(t))
        for p, xp_ in x.items():
            stacked = np.stack([c[p] for c in columns], axis=-1)  # x[p].shape + (x[q].size,)
            blocks[p][q] = stacked.reshape(xp_.shape + xq.shape)
    return blocks


def _add(
    f: Callable,
    kind: str,
    x: Any,
    contexts: tuple = (),
    *,
    value: Any,
    jacobian: Any = None,
    derivative: Any = None,
    gradient: Any = None,
    hessian: Any = None,
    second_derivative: Any = None,
    hvp_ref: Callable | None = None,
) -> Scenario:
    """Register ``f`` and its references; fill the identical views of the Jacobian."""
    name = f.__name__
    assert kind in KINDS, kind
    assert all(s.name != name for s in SCENARIOS), f"duplicate scenario {name}"
    assert getattr(f, "__dxserve__", None) is not None and f.__dxserve__.name == name, name
    tree = isinstance(x, dict)
    x = {k: _arr(v) for k, v in x.items()} if tree else _arr(x)
    contexts = tuple(_arr(c) for c in contexts)
    value = _arr(value)
    x_scalar = not tree and x.ndim == 0
    y_scalar = value.ndim == 0
    if not tree:
        if jacobian is None:
            jacobian = derivative if x_scalar else gradient
        jacobian = _arr(jacobian)
        assert jacobian.shape == value.shape + x.shape, (name, jacobian.shape)
        if x_scalar:
            derivative = jacobian
        if y_scalar:
            gradient = jacobian
        if x_scalar and y_scalar:
            if hessian is None:
                hessian = second_derivative
            if second_derivative is None:
                second_derivative = hessian
    if hessian is not None and not tree:
        hessian = _arr(hessian)
        assert hessian.shape == x.shape + x.shape, (name, hessian.shape)
    if second_derivative is not None:
        second_derivative = _arr(second_derivative)
        assert second_derivative.shape == value.shape, (name, second_derivative.shape)
    if tree and y_scalar:
        # jax.jacobian's blocks of a scalar f are the gradient's leaves; jax.hessian's
        # block [p][q] (x[p].shape + x[q].shape) is H applied to q's basis tangents
        jacobian = gradient
        if hessian is None and hvp_ref is not None:
            hessian = _hessian_blocks(x, hvp_ref)
    if y_scalar:
        assert gradient is not None and (hessian is not None or hvp_ref is not None), name
    if x_scalar:
        assert second_derivative is not None, name
    s = Scenario(
        name, kind, f, x, contexts, value, jacobian,
        None if derivative is None else _arr(derivative),
        gradient, hessian, second_derivative, hvp_ref,
    )
    SCENARIOS.append(s)
    return s


# --- scalar -> scalar -------------------------------------------------------------


@dxserve.function
def ss_sin_exp(x):
    """sin(x) exp(x)"""
    return jnp.sin(x) * jnp.exp(x)


_x = 0.7
_add(ss_sin_exp, "scalar->scalar", _x,
     value=np.sin(_x) * np.exp(_x),
     derivative=np.exp(_x) * (np.sin(_x) + np.cos(_x)),
     second_derivative=2 * np.exp(_x) * np.cos(_x))


@dxserve.function
def ss_exp_log(x):
    """exp(x) log(x)"""
    return jnp.exp(x) * jnp.log(x)


_x = 1.3
_add(ss_exp_log, "scalar->scalar", _x,
     value=np.exp(_x) * np.log(_x),
     derivative=np.exp(_x) * (np.log(_x) + 1 / _x),
     second_derivative=np.exp(_x) * (np.log(_x) + 2 / _x - 1 / _x**2))


@dxserve.function
def ss_tanh(x):
    """tanh(2x)"""
    return jnp.tanh(2 * x)


_x = 0.4
_t = np.tanh(2 * _x)
_add(ss_tanh, "scalar->scalar", _x,
     value=_t, derivative=2 * (1 - _t**2), second_derivative=-8 * _t * (1 - _t**2))


@dxserve.function
def ss_abs(x):
    """x |x| (piecewise; evaluated at x < 0)"""
    return x * jnp.abs(x)


_x = -0.7
_add(ss_abs, "scalar->scalar", _x, value=-(_x**2), derivative=-2 * _x, second_derivative=-2.0)


@dxserve.function
def ss_where(x):
    """where(x > 0, x^3, -x) (piecewise; evaluated at x > 0)"""
    return jnp.where(x > 0, x**3, -x)


_x = 0.8
_add(ss_where, "scalar->scalar", _x, value=_x**3, derivative=3 * _x**2, second_derivative=6 * _x)


@dxserve.function
def ss_poly_ctx(x, a):
    """a x^3 + log(1 + x^2), a a scalar context"""
    return a * x**3 + jnp.log1p(x**2)


_x, _a = 0.6, 2.5
_add(ss_poly_ctx, "scalar->scalar", _x, (_a,),
     value=_a * _x**3 + np.log1p(_x**2),
     derivative=3 * _a * _x**2 + 2 * _x / (1 + _x**2),
     second_derivative=6 * _a * _x + 2 * (1 - _x**2) / (1 + _x**2) ** 2)


# --- scalar -> vector / matrix ------------------------------------------------------


@dxserve.function
def sv_powers(x):
    """(x, x^2, x^3, sin x)"""
    return jnp.stack([x, x**2, x**3, jnp.sin(x)])


_x = 0.9
_add(sv_powers, "scalar->vector", _x,
     value=[_x, _x**2, _x**3, np.sin(_x)],
     derivative=[1.0, 2 * _x, 3 * _x**2, np.cos(_x)],
     second_derivative=[0.0, 2.0, 6 * _x, -np.sin(_x)])


@dxserve.function
def sv_maximum_ctx(x, a):
    """maximum(x a, 0) for a context vector a (piecewise, away from kinks)"""
    return jnp.maximum(x * a, 0.0)


_x, _a = 0.9, _arr([1.0, -2.0, 3.0, -0.5])
_add(sv_maximum_ctx, "scalar->vector", _x, (_a,),
     value=np.maximum(_x * _a, 0.0),
     derivative=np.where(_x * _a > 0, _a, 0.0),
     second_derivative=np.zeros(4))


@dxserve.function
def sm_rotation(x):
    """[[cos, -sin], [sin, cos], [x^2, exp]] of x"""
    c, s = jnp.cos(x), jnp.sin(x)
    return jnp.stack([jnp.stack([c, -s]), jnp.stack([s, c]), jnp.stack([x**2, jnp.exp(x)])])


_x = 0.5
_c, _s, _e = np.cos(_x), np.sin(_x), np.exp(_x)
_add(sm_rotation, "scalar->matrix", _x,
     value=[[_c, -_s], [_s, _c], [_x**2, _e]],
     derivative=[[-_s, -_c], [_c, -_s], [2 * _x, _e]],
     second_derivative=[[-_c, _s], [-_s, -_c], [2.0, _e]])


# --- vector -> scalar ---------------------------------------------------------------


@dxserve.function(description="extended Rosenbrock, R^n -> R")
def rosenbrock(x):
    """extended Rosenbrock"""
    return jnp.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)


def _rosenbrock_refs(x: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    n = x.size
    a, b = x[:-1], x[1:]
    value = np.sum(100 * (b - a**2) ** 2 + (1 - a) ** 2)
    g = np.zeros(n)
    g[:-1] += -400 * a * (b - a**2) - 2 * (1 - a)
    g[1:] += 200 * (b - a**2)
    h = np.zeros((n, n))
    for i in range(n):
        if i < n - 1:
            h[i, i] += 1200 * x[i] ** 2 - 400 * x[i + 1] + 2
            h[i, i + 1] = h[i + 1, i] = -400 * x[i]
        if i > 0:
            h[i, i] += 200
    return value, g, h


_x = _arr([0.5, -0.3, 1.2, 0.8, -1.1])
_v, _g, _h = _rosenbrock_refs(_x)
_add(rosenbrock, "vector->scalar", _x, value=_v, gradient=_g, hessian=_h)


@dxserve.function
def vs_sin_sq(x):
    """sum(sin(x)^2)"""
    return jnp.sum(jnp.sin(x) ** 2)


_x = _arr([0.3, -1.2, 2.0, 0.7])
_add(vs_sin_sq, "vector->scalar", _x,
     value=np.sum(np.sin(_x) ** 2), gradient=np.sin(2 * _x), hessian=np.diag(2 * np.cos(2 * _x)))


@dxserve.function
def vs_logsumexp(x):
    """log(sum(exp(x)))"""
    return jax.scipy.special.logsumexp(x)


_x = _arr([0.1, -0.4, 1.5, 0.9, -2.0])
_p = np.exp(_x) / np.sum(np.exp(_x))
_add(vs_logsumexp, "vector->scalar", _x,
     value=np.log(np.sum(np.exp(_x))), gradient=_p, hessian=np.diag(_p) - np.outer(_p, _p))


@dxserve.function
def vs_norm(x):
    """Euclidean norm"""
    return jnp.linalg.norm(x)


_x = _arr([1.0, -2.0, 0.5, 3.0])
_r = np.sqrt(np.sum(_x**2))
_add(vs_norm, "vector->scalar", _x,
     value=_r, gradient=_x / _r, hessian=(np.eye(4) - np.outer(_x, _x) / _r**2) / _r)


@dxserve.function
def vs_prod(x):
    """product of the entries"""
    return jnp.prod(x)


_x = _arr([1.5, -0.8, 2.0, 0.6])
_P = np.prod(_x)
_h = _P / np.outer(_x, _x)
np.fill_diagonal(_h, 0.0)
_add(vs_prod, "vector->scalar", _x, value=_P, gradient=_P / _x, hessian=_h)


@dxserve.function
def vs_quadratic_ctx(x, A, b):
    """x.A x / 2 + b.x for context A (not symmetric) and b"""
    return 0.5 * x @ (A @ x) + b @ x


_x = _arr([0.5, -1.0, 2.0, 0.3])
_A = _arr([[2.0, 0.5, -1.0, 0.0], [1.5, 3.0, 0.2, -0.7], [0.0, -0.4, 1.0, 0.9],
           [0.3, 0.0, -2.0, 4.0]])
_b = _arr([1.0, -2.0, 0.5, 0.25])
_S = 0.5 * (_A + _A.T)
_add(vs_quadratic_ctx, "vector->scalar", _x, (_A, _b),
     value=0.5 * _x @ _A @ _x + _b @ _x, gradient=_S @ _x + _b, hessian=_S)


@dxserve.function
def vs_abs_cube(x):
    """sum(|x|^3) (piecewise)"""
    return jnp.sum(jnp.abs(x) ** 3)


_x = _arr([0.5, -1.0, 2.0, -0.3])
_add(vs_abs_cube, "vector->scalar", _x,
     value=np.sum(np.abs(_x) ** 3), gradient=3 * _x * np.abs(_x), hessian=np.diag(6 * np.abs(_x)))


@dxserve.function
def vs_where(x):
    """sum(where(x > 0, x^2, x / 2)) (piecewise, away from 0)"""
    return jnp.sum(jnp.where(x > 0, x**2, 0.5 * x))


_x = _arr([0.7, -1.3, 2.1, -0.4, 0.2])
_add(vs_where, "vector->scalar", _x,
     value=np.sum(np.where(_x > 0, _x**2, 0.5 * _x)),
     gradient=np.where(_x > 0, 2 * _x, 0.5),
     hessian=np.diag(np.where(_x > 0, 2.0, 0.0)))


@dxserve.function
def vs_exp_dot_ctx(x, c):
    """exp(c.x) for a context vector c"""
    return jnp.exp(c @ x)


_x = _arr([0.2, -0.5, 0.3])
_c = _arr([1.0, 0.5, -2.0])
_e = np.exp(_c @ _x)
_add(vs_exp_dot_ctx, "vector->scalar", _x, (_c,),
     value=_e, gradient=_e * _c, hessian=_e * np.outer(_c, _c))


@dxserve.function
def vs_log1p_sq(x):
    """sum(log(1 + x^2))"""
    return jnp.sum(jnp.log(1 + x**2))


_x = _arr([0.5, -1.5, 2.0, 0.1])
_add(vs_log1p_sq, "vector->scalar", _x,
     value=np.sum(np.log(1 + _x**2)),
     gradient=2 * _x / (1 + _x**2),
     hessian=np.diag(2 * (1 - _x**2) / (1 + _x**2) ** 2))


@dxserve.function
def vs_tanh_layer_ctx(x, W):
    """sum(tanh(W x)) for a context matrix W (3, 4)"""
    return jnp.sum(jnp.tanh(W @ x))


_x = _arr([0.3, -0.2, 0.5, 0.1])
_W = _arr([[1.0, -0.5, 0.3, 2.0], [0.2, 0.8, -1.0, 0.0], [-0.6, 0.4, 0.9, -0.3]])
_t = np.tanh(_W @ _x)
_add(vs_tanh_layer_ctx, "vector->scalar", _x, (_W,),
     value=np.sum(_t),
     gradient=_W.T @ (1 - _t**2),
     hessian=_W.T @ np.diag(-2 * _t * (1 - _t**2)) @ _W)


# --- matrix -> scalar ---------------------------------------------------------------


@dxserve.function
def ms_trace_quad_ctx(X, A):
    """trace(X^T A X) for a context matrix A (3, 3); X is (3, 2)"""
    return jnp.trace(X.T @ A @ X)


_X = _arr([[0.5, -1.0], [2.0, 0.3], [-0.7, 1.1]])
_A = _arr([[1.0, 0.4, -0.2], [0.1, 2.0, 0.5], [0.3, -0.6, 1.5]])
_S = _A + _A.T
_add(ms_trace_quad_ctx, "matrix->scalar", _X, (_A,),
     value=np.trace(_X.T @ _A @ _X),
     gradient=_S @ _X,
     hessian=np.einsum("kl,ij->kilj", _S, np.eye(2)))


@dxserve.function
def ms_logdet(X):
    """log|det X| of a (3, 3) matrix"""
    return jnp.linalg.slogdet(X)[1]


_X = _arr([[2.0, 0.3, -0.5], [0.1, 1.5, 0.4], [-0.2, 0.6, 3.0]])
_Xi = np.linalg.inv(_X)
_add(ms_logdet, "matrix->scalar", _X,
     value=np.log(abs(np.linalg.det(_X))),
     gradient=_Xi.T,
     hessian=-np.einsum("jk,li->ijkl", _Xi, _Xi))


@dxserve.function
def ms_tanh_sum(X):
    """sum(tanh(X)) of a (2, 3) matrix"""
    return jnp.sum(jnp.tanh(X))


_X = _arr([[0.2, -0.5, 1.0], [0.7, -1.2, 0.1]])
_t = np.tanh(_X)
_add(ms_tanh_sum, "matrix->scalar", _X,
     value=np.sum(_t),
     gradient=1 - _t**2,
     hessian=np.einsum("ik,jl,ij->ijkl", np.eye(2), np.eye(3), -2 * _t * (1 - _t**2)))


# --- vector -> vector ---------------------------------------------------------------


@dxserve.function
def vv_sin_exp(x):
    """sin(x) exp(x), elementwise"""
    return jnp.sin(x) * jnp.exp(x)


_x = _arr([0.3, -0.8, 1.4, 0.0])
_add(vv_sin_exp, "vector->vector", _x,
     value=np.sin(_x) * np.exp(_x),
     jacobian=np.diag(np.exp(_x) * (np.sin(_x) + np.cos(_x))))


@dxserve.function
def vv_softmax(x):
    """softmax(x)"""
    return jax.nn.softmax(x)


_x = _arr([0.5, -1.0, 2.0, 0.3, 0.0])
_p = np.exp(_x) / np.sum(np.exp(_x))
_add(vv_softmax, "vector->vector", _x, value=_p, jacobian=np.diag(_p) - np.outer(_p, _p))


@dxserve.function
def vv_tanh_matvec_ctx(x, A):
    """tanh(A x) for a context matrix A (4, 4)"""
    return jnp.tanh(A @ x)


_x = _arr([0.4, -0.3, 0.8, 0.1])
_A = _arr([[1.0, 0.2, -0.4, 0.5], [-0.3, 0.7, 0.1, 0.0], [0.6, -0.8, 0.9, 0.2],
           [0.0, 0.5, -0.2, 1.1]])
_t = np.tanh(_A @ _x)
_add(vv_tanh_matvec_ctx, "vector->vector", _x, (_A,),
     value=_t, jacobian=np.diag(1 - _t**2) @ _A)


@dxserve.function
def vv_cumprod(x):
    """cumulative product"""
    return jnp.cumprod(x)


_x = _arr([1.5, -0.5, 2.0, 0.8])
_cp = np.cumprod(_x)
_J = np.zeros((4, 4))
for _i in range(4):
    for _j in range(_i + 1):
        _J[_i, _j] = _cp[_i] / _x[_j]
_add(vv_cumprod, "vector->vector", _x, value=_cp, jacobian=_J)


@dxserve.function
def vv_leaky_relu(x):
    """maximum(x, x / 10) (piecewise, away from 0)"""
    return jnp.maximum(x, 0.1 * x)


_x = _arr([0.5, -1.5, 2.0, -0.2, 0.9])
_add(vv_leaky_relu, "vector->vector", _x,
     value=np.maximum(_x, 0.1 * _x), jacobian=np.diag(np.where(_x > 0, 1.0, 0.1)))


@dxserve.function
def vv_normalize(x):
    """x / |x|"""
    return x / jnp.linalg.norm(x)


_x = _arr([1.0, -2.0, 0.5])
_r = np.sqrt(np.sum(_x**2))
_u = _x / _r
_add(vv_normalize, "vector->vector", _x, value=_u, jacobian=(np.eye(3) - np.outer(_u, _u)) / _r)


# --- vector -> vector, m != n ------------------------------------------------------------


@dxserve.function
def vv_shrink(x):
    """R^5 -> R^3: (x0 x1, x2 + x3^2, exp(x4) x0)"""
    return jnp.stack([x[0] * x[1], x[2] + x[3] ** 2, jnp.exp(x[4]) * x[0]])


_x = _arr([0.5, -1.2, 0.3, 2.0, -0.4])
_e = np.exp(_x[4])
_add(vv_shrink, "vector->vector (m != n)", _x,
     value=[_x[0] * _x[1], _x[2] + _x[3] ** 2, _e * _x[0]],
     jacobian=[[_x[1], _x[0], 0, 0, 0], [0, 0, 1, 2 * _x[3], 0], [_e, 0, 0, 0, _x[0] * _e]])


@dxserve.function
def vv_grow(x):
    """R^3 -> R^7: (x, x^2, sum(x) x0)"""
    return jnp.concatenate([x, x**2, jnp.sum(x)[None] * x[0]])


_x = _arr([0.5, -1.0, 1.5])
_J = np.zeros((7, 3))
_J[:3] = np.eye(3)
_J[3:6] = np.diag(2 * _x)
_J[6] = [np.sum(_x) + _x[0], _x[0], _x[0]]
_add(vv_grow, "vector->vector (m != n)", _x,
     value=np.concatenate([_x, _x**2, [np.sum(_x) * _x[0]]]), jacobian=_J)


@dxserve.function
def vv_diff_sq(x):
    """R^5 -> R^4: diff(x)^2"""
    return jnp.diff(x) ** 2


_x = _arr([0.1, 0.7, -0.4, 1.2, 2.0])
_d = np.diff(_x)
_J = np.zeros((4, 5))
for _i in range(4):
    _J[_i, _i], _J[_i, _i + 1] = -2 * _d[_i], 2 * _d[_i]
_add(vv_diff_sq, "vector->vector (m != n)", _x, value=_d**2, jacobian=_J)


@dxserve.function
def vv_rect_matvec_ctx(x, B):
    """R^4 -> R^2: B exp(x) for a context matrix B (2, 4)"""
    return B @ jnp.exp(x)


_x = _arr([0.2, -0.5, 0.8, 0.0])
_B = _arr([[1.0, -2.0, 0.5, 0.3], [0.0, 1.5, -1.0, 2.0]])
_add(vv_rect_matvec_ctx, "vector->vector (m != n)", _x, (_B,),
     value=_B @ np.exp(_x), jacobian=_B * np.exp(_x)[None, :])


# --- vector -> matrix ------------------------------------------------------------------


@dxserve.function
def vm_outer(x):
    """outer(x, x)"""
    return jnp.outer(x, x)


_x = _arr([0.5, -1.0, 2.0])
_I = np.eye(3)
_add(vm_outer, "vector->matrix", _x,
     value=np.outer(_x, _x),
     jacobian=np.einsum("ik,j->ijk", _I, _x) + np.einsum("i,jk->ijk", _x, _I))


@dxserve.function
def vm_outer_ctx(x, c):
    """outer(sin(x), c) for a context vector c (2,)"""
    return jnp.outer(jnp.sin(x), c)


_x = _arr([0.3, -0.9, 1.4])
_c = _arr([2.0, -0.5])
_add(vm_outer_ctx, "vector->matrix", _x, (_c,),
     value=np.outer(np.sin(_x), _c),
     jacobian=np.einsum("ik,i,j->ijk", np.eye(3), np.cos(_x), _c))


# --- matrix -> vector ------------------------------------------------------------------


@dxserve.function
def mv_row_norms(X):
    """norms of the rows of X (3, 2)"""
    return jnp.linalg.norm(X, axis=1)


_X = _arr([[1.0, -2.0], [0.5, 0.5], [-3.0, 1.0]])
_r = np.sqrt(np.sum(_X**2, axis=1))
_add(mv_row_norms, "matrix->vector", _X,
     value=_r, jacobian=np.einsum("ik,kl->ikl", np.eye(3), _X / _r[:, None]))


@dxserve.function
def mv_exp_matvec_ctx(X, v):
    """exp(X) v for a context vector v (2,); X is (3, 2)"""
    return jnp.exp(X) @ v


_X = _arr([[0.1, -0.5], [0.7, 0.2], [-1.0, 0.4]])
_v = _arr([1.5, -2.0])
_add(mv_exp_matvec_ctx, "matrix->vector", _X, (_v,),
     value=np.exp(_X) @ _v,
     jacobian=np.einsum("ik,kl,l->ikl", np.eye(3), np.exp(_X), _v))


# --- matrix -> matrix ------------------------------------------------------------------


@dxserve.function
def mm_matmul_ctx(X, A):
    """X A for a context matrix A (2, 3); X is (3, 2)"""
    return X @ A


_X = _arr([[0.5, -1.0], [2.0, 0.3], [-0.7, 1.1]])
_A = _arr([[1.0, -0.5, 2.0], [0.3, 0.8, -1.2]])
_add(mm_matmul_ctx, "matrix->matrix", _X, (_A,),
     value=_X @ _A, jacobian=np.einsum("ik,lj->ijkl", np.eye(3), _A))


@dxserve.function
def mm_square(X):
    """X X for a (2, 2) matrix"""
    return X @ X


_X = _arr([[0.5, -1.0], [2.0, 0.3]])
_I = np.eye(2)
_add(mm_square, "matrix->matrix", _X,
     value=_X @ _X,
     jacobian=np.einsum("ik,lj->ijkl", _I, _X) + np.einsum("ik,jl->ijkl", _X, _I))


@dxserve.function
def mm_softmax_rows(X):
    """row-wise softmax of X (2, 3)"""
    return jax.nn.softmax(X, axis=1)


_X = _arr([[0.5, -1.0, 2.0], [0.3, 0.0, -0.7]])
_p = np.exp(_X) / np.sum(np.exp(_X), axis=1, keepdims=True)
_add(mm_softmax_rows, "matrix->matrix", _X,
     value=_p,
     jacobian=np.einsum("ik,ij,jl->ijkl", np.eye(2), _p, np.eye(3))
     - np.einsum("ik,ij,il->ijkl", np.eye(2), _p, _p))


@dxserve.function
def mm_elu_transpose(X):
    """elu(X)^T for X (2, 3) (piecewise, away from 0)"""
    return jnp.where(X > 0, X, jnp.exp(X) - 1).T


_X = _arr([[0.5, -1.0, 2.0], [-0.3, 0.8, -1.5]])
_dX = np.where(_X > 0, 1.0, np.exp(_X))
_add(mm_elu_transpose, "matrix->matrix", _X,
     value=np.where(_X > 0, _X, np.exp(_X) - 1).T,
     jacobian=np.einsum("jk,il,ji->ijkl", np.eye(2), np.eye(3), _dX))


# --- pytree -> scalar ------------------------------------------------------------------


@dxserve.function
def pytree_tanh_regression(p, X, y):
    """0.5 |tanh(X w + b) - y|^2 for p = {"w": (3, 2), "b": (2,)}, data X (5, 3), y (5, 2)"""
    r = jnp.tanh(X @ p["w"] + p["b"]) - y
    return 0.5 * jnp.sum(r**2)


def _regression_refs(p: dict, X: np.ndarray, y: np.ndarray) -> tuple:
    # z = X w + b, a = tanh z, r = a - y, s = 1 - a^2 = da/dz, L = sum(r^2) / 2
    a = np.tanh(X @ p["w"] + p["b"])
    r = a - y
    s = 1 - a**2
    delta = r * s  # dL/dz
    grad = {"w": X.T @ delta, "b": delta.sum(axis=0)}

    def hvp(t: dict) -> dict:
        # dz = X V + u; d(delta) = (s^2 + r ds/dz) dz with ds/dz = -2 a s
        dz = X @ t["w"] + t["b"]
        ddelta = (s**2 - 2 * r * a * s) * dz
        return {"w": X.T @ ddelta, "b": ddelta.sum(axis=0)}

    return 0.5 * np.sum(r**2), grad, hvp


_p = {"w": _arr([[0.5, -0.3], [0.1, 0.8], [-0.6, 0.2]]), "b": _arr([0.1, -0.2])}
_Xd = _arr([[1.0, 0.5, -0.3], [0.2, -1.0, 0.7], [-0.5, 0.3, 1.2], [0.9, -0.4, 0.0],
            [0.1, 0.6, -0.8]])
_yd = _arr([[0.3, -0.1], [-0.5, 0.4], [0.2, 0.6], [0.7, -0.3], [-0.2, 0.1]])
_v, _g, _hvp = _regression_refs(_p, _Xd, _yd)
_add(pytree_tanh_regression, "pytree->scalar", _p, (_Xd, _yd),
     value=_v, gradient=_g, hvp_ref=_hvp)

BY_NAME: dict[str, Scenario] = {s.name: s for s in SCENARIOS}
del _x, _t, _a, _c, _s, _e, _v, _g, _h, _p, _r, _u, _A, _b, _S, _W, _X, _Xi, _I, _J, _B, _d
del _cp, _dX, _P, _Xd, _yd, _hvp, _i, _j


# --- pytree-aware numpy helpers -------------------------------------------------------


def tree_map(fn: Callable, tree: Any, *rest: Any) -> Any:
    """Map over dicts and tuples of arrays (plain Python, no JAX)."""
    if isinstance(tree, dict):
        return {k: tree_map(fn, v, *(r[k] for r in rest)) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return tuple(tree_map(fn, *items) for items in zip(tree, *rest, strict=True))
    return fn(tree, *rest)


def tree_leaves(tree: Any) -> list:
    if isinstance(tree, dict):
        return [leaf for k in sorted(tree) for leaf in tree_leaves(tree[k])]
    if isinstance(tree, (tuple, list)):
        return [leaf for item in tree for leaf in tree_leaves(item)]
    return [tree]


def jvp_ref(s: Scenario, t: Any) -> Any:
    """``J t`` from the references."""
    if s.jacobian is not None and not s.x_is_tree:
        return np.tensordot(s.jacobian, t, axes=np.ndim(t))
    # scalar-valued pytree: <grad, t>
    return _arr(sum(np.vdot(g, v) for g, v in
                    zip(tree_leaves(s.gradient), tree_leaves(t), strict=True)))


def vjp_ref(s: Scenario, c: Any) -> Any:
    """``Jᵀ c`` from the references."""
    if s.jacobian is not None and not s.x_is_tree:
        return np.tensordot(c, s.jacobian, axes=np.ndim(c))
    return tree_map(lambda g: c * g, s.gradient)


def hvp_ref(s: Scenario, t: Any) -> Any:
    """``H t`` from the references."""
    if s.hessian is not None and not s.x_is_tree:
        return np.tensordot(s.hessian, t, axes=np.ndim(t))
    return s.hvp_ref(t)


# --- operators --------------------------------------------------------------------------


#: The operators the conformance grids sweep: every derivative operator. ``sparsity``
#: returns a pattern, not a derivative, and has its own suite (test_sparse.py).
DERIVATIVE_OPERATORS = tuple(op for op, spec in OPERATORS.items() if spec.family != "sparsity")


def applies(s: Scenario, operator: str) -> bool:
    """Does ``operator`` (a name in OPERATORS) apply to scenario ``s``."""
    return expected_error(s, operator) is None


def expected_error(s: Scenario, operator: str) -> type[DxError] | None:
    """The error the library raises for ``operator`` on ``s`` (None when it applies)."""
    family = OPERATORS[operator].family
    if family in ("derivative", "second_derivative") and not s.x_is_scalar:
        return NotScalarInputError
    if family in ("gradient", "hvp", "hessian") and not s.y_is_scalar:
        return NotScalarOutputError
    return None  # pytree x included: jacobian and hessian give jax's blocks


def _seed(*parts: str) -> int:
    return zlib.crc32("/".join(parts).encode())


def tangent(s: Scenario, like: str = "x") -> Any:
    """One deterministic tangent with x's structure (``like="x"``) or y's (``"y"``)."""
    rng = np.random.default_rng(_seed(s.name, like))
    base = s.x if like == "x" else s.value
    return tree_map(lambda leaf: _arr(rng.uniform(-1, 1, np.shape(leaf)) + 0.25), base)


def tangents(s: Scenario, operator: str) -> tuple | None:
    """``(t, -t)`` for operators that take tangents (y-shaped for pullbacks), else None."""
    spec = OPERATORS[operator]
    if not spec.takes_tangents:
        return None
    t = tangent(s, "y" if spec.family == "pullback" else "x")
    return (t, tree_map(np.negative, t))


def expected(s: Scenario, operator: str, tangents: tuple | None = None) -> Any:
    """The reference result(s) of ``operator`` in the library's return order.

    Single-result operators give the result itself; others a tuple. Tangent results
    (``pushforwards``, ``pullbacks``, ``hvps``) are tuples as long as ``tangents``.
    """
    spec = OPERATORS[operator]
    if not applies(s, operator):
        raise ValueError(f"{operator} does not apply to {s.name}")
    if spec.takes_tangents and tangents is None:
        raise ValueError(f"{operator} needs tangents")
    refs = {
        "value": lambda: s.value,
        "derivative": lambda: s.derivative,
        "second_derivative": lambda: s.second_derivative,
        "gradient": lambda: s.gradient,
        "jacobian": lambda: s.jacobian,
        "hessian": lambda: s.hessian,
        "pushforwards": lambda: tuple(jvp_ref(s, t) for t in tangents),
        "pullbacks": lambda: tuple(vjp_ref(s, c) for c in tangents),
        "hvps": lambda: tuple(hvp_ref(s, t) for t in tangents),
    }
    out = tuple(refs[name]() for name in spec.results)
    return out[0] if len(out) == 1 else out


def expected_results(s: Scenario, operator: str, tangents: tuple | None = None) -> dict:
    """The references keyed by result name (how HTTP responses name them)."""
    out = expected(s, operator, tangents)
    names = OPERATORS[operator].results
    return dict(zip(names, (out,) if len(names) == 1 else out, strict=True))


# --- comparison -------------------------------------------------------------------------


def assert_close(actual: Any, expected: Any, *, rtol: float, atol: float,
                 scaled: bool = False, path: str = "result") -> None:
    """Compare nested tuples/dicts of arrays: structure, shapes, then values.

    ``scaled=False``: elementwise ``|a - e| <= atol + rtol |e|``.
    ``scaled=True`` (for finite differences, whose error is relative to the size of
    the whole result, not to each entry): ``max|a - e| <= atol + rtol max|e|``.
    """
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: expected a dict, got {type(actual).__name__}"
        assert sorted(actual) == sorted(expected), f"{path}: keys {sorted(actual)}"
        for k in expected:
            assert_close(actual[k], expected[k], rtol=rtol, atol=atol, scaled=scaled,
                         path=f"{path}[{k!r}]")
        return
    if isinstance(expected, tuple):
        assert isinstance(actual, (tuple, list)), (
            f"{path}: expected a tuple, got {type(actual).__name__}")
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_close(a, e, rtol=rtol, atol=atol, scaled=scaled, path=f"{path}[{i}]")
        return
    a = np.asarray(actual)
    e = np.asarray(expected)
    assert a.shape == e.shape, f"{path}: shape {a.shape} != expected {e.shape}"
    if scaled:
        err = float(np.max(np.abs(a - e))) if e.size else 0.0
        bound = atol + rtol * (float(np.max(np.abs(e))) if e.size else 0.0)
        assert err <= bound, f"{path}: max error {err:.3g} > {bound:.3g}\n{a}\n!=\n{e}"
    else:
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=path)


def max_relative_error(actual: Any, expected: Any) -> float:
    """``max|a - e| / max(max|e|, 1e-300)`` over all leaves (for measuring tolerances)."""
    worst = 0.0
    for a, e in zip(tree_leaves(actual), tree_leaves(expected), strict=True):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        if e.size:
            worst = max(worst, float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-300)))
    return worst
