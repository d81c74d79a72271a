"""The scenarios of ``tests/scenarios.py`` rewritten in PyTorch, with the same references.

Each function here computes what its JAX namesake computes, in ``torch``, and is marked
``@dxserve.function(framework="torch")`` under the name ``torch_<scenario>`` (so one
server can serve both modules: ``--functions tests.scenarios,tests.torch_scenarios``).
``SCENARIOS`` holds the scenarios with ``f`` and ``name`` replaced: x, contexts and the
hand-written numpy references are the JAX scenarios' own.

Importing this module imports torch: the tests that use it skip without torch.
"""

from __future__ import annotations

import dataclasses

import torch

import dxserve

try:  # imported as a top-level module by pytest (tests/ has no __init__.py)
    import scenarios as sc
except ImportError:  # pragma: no cover - imported as tests.scenarios
    from tests import scenarios as sc

_FUNCTIONS: dict = {}


def _torch(fn):
    """Mark ``fn`` (named like its scenario) as ``torch_<name>``, a torch function."""
    name = f"torch_{fn.__name__}"
    marked = dxserve.function(name=name, framework="torch", description=f"{fn.__doc__} (torch)")(fn)
    _FUNCTIONS[fn.__name__] = marked
    return marked


@_torch
def ss_sin_exp(x):
    """sin(x) exp(x)"""
    return torch.sin(x) * torch.exp(x)


@_torch
def ss_exp_log(x):
    """exp(x) log(x)"""
    return torch.exp(x) * torch.log(x)


@_torch
def ss_tanh(x):
    """tanh(2x)"""
    return torch.tanh(2 * x)


@_torch
def ss_abs(x):
    """x |x|"""
    return x * torch.abs(x)


@_torch
def ss_where(x):
    """where(x > 0, x^3, -x)"""
    return torch.where(x > 0, x**3, -x)


@_torch
def ss_poly_ctx(x, a):
    """a x^3 + log(1 + x^2)"""
    return a * x**3 + torch.log1p(x**2)


@_torch
def sv_powers(x):
    """(x, x^2, x^3, sin x)"""
    return torch.stack([x, x**2, x**3, torch.sin(x)])


@_torch
def sv_maximum_ctx(x, a):
    """maximum(x a, 0)"""
    return torch.clamp_min(x * a, 0.0)


@_torch
def sm_rotation(x):
    """[[cos, -sin], [sin, cos], [x^2, exp]] of x"""
    c, s = torch.cos(x), torch.sin(x)
    return torch.stack([torch.stack([c, -s]), torch.stack([s, c]), torch.stack([x**2, torch.exp(x)])])


@_torch
def rosenbrock(x):
    """extended Rosenbrock"""
    return torch.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)


@_torch
def vs_sin_sq(x):
    """sum(sin(x)^2)"""
    return torch.sum(torch.sin(x) ** 2)


@_torch
def vs_logsumexp(x):
    """log(sum(exp(x)))"""
    return torch.logsumexp(x, 0)


@_torch
def vs_norm(x):
    """Euclidean norm"""
    return torch.linalg.vector_norm(x)


@_torch
def vs_prod(x):
    """product of the entries"""
    return torch.prod(x)


@_torch
def vs_quadratic_ctx(x, A, b):
    """x.A x / 2 + b.x"""
    return 0.5 * x @ (A @ x) + b @ x


@_torch
def vs_abs_cube(x):
    """sum(|x|^3)"""
    return torch.sum(torch.abs(x) ** 3)


@_torch
def vs_where(x):
    """sum(where(x > 0, x^2, x / 2))"""
    return torch.sum(torch.where(x > 0, x**2, 0.5 * x))


@_torch
def vs_exp_dot_ctx(x, c):
    """exp(c.x)"""
    return torch.exp(c @ x)


@_torch
def vs_log1p_sq(x):
    """sum(log(1 + x^2))"""
    return torch.sum(torch.log(1 + x**2))


@_torch
def vs_tanh_layer_ctx(x, W):
    """sum(tanh(W x))"""
    return torch.sum(torch.tanh(W @ x))


@_torch
def ms_trace_quad_ctx(X, A):
    """trace(X^T A X)"""
    return torch.trace(X.T @ A @ X)


@_torch
def ms_logdet(X):
    """log|det X|, from the LU factors: torch's det and slogdet give wrong nested
    forward-mode derivatives (zero; torch 2.14), which forward-over-reverse HVPs take"""
    return torch.sum(torch.log(torch.abs(torch.diagonal(torch.linalg.lu_factor(X)[0]))))


@_torch
def ms_tanh_sum(X):
    """sum(tanh(X))"""
    return torch.sum(torch.tanh(X))


@_torch
def vv_sin_exp(x):
    """sin(x) exp(x), elementwise"""
    return torch.sin(x) * torch.exp(x)


@_torch
def vv_softmax(x):
    """softmax(x)"""
    return torch.softmax(x, 0)


@_torch
def vv_tanh_matvec_ctx(x, A):
    """tanh(A x)"""
    return torch.tanh(A @ x)


@_torch
def vv_cumprod(x):
    """cumulative product"""
    return torch.cumprod(x, 0)


@_torch
def vv_leaky_relu(x):
    """maximum(x, x / 10)"""
    return torch.maximum(x, 0.1 * x)


@_torch
def vv_normalize(x):
    """x / |x|"""
    return x / torch.linalg.vector_norm(x)


@_torch
def vv_shrink(x):
    """R^5 -> R^3: (x0 x1, x2 + x3^2, exp(x4) x0)"""
    return torch.stack([x[0] * x[1], x[2] + x[3] ** 2, torch.exp(x[4]) * x[0]])


@_torch
def vv_grow(x):
    """R^3 -> R^7: (x, x^2, sum(x) x0)"""
    return torch.cat([x, x**2, torch.sum(x)[None] * x[0]])


@_torch
def vv_diff_sq(x):
    """R^5 -> R^4: diff(x)^2"""
    return torch.diff(x) ** 2


@_torch
def vv_rect_matvec_ctx(x, B):
    """R^4 -> R^2: B exp(x)"""
    return B @ torch.exp(x)


@_torch
def vm_outer(x):
    """outer(x, x)"""
    return torch.outer(x, x)


@_torch
def vm_outer_ctx(x, c):
    """outer(sin(x), c)"""
    return torch.outer(torch.sin(x), c)


@_torch
def mv_row_norms(X):
    """norms of the rows of X"""
    return torch.linalg.vector_norm(X, dim=1)


@_torch
def mv_exp_matvec_ctx(X, v):
    """exp(X) v"""
    return torch.exp(X) @ v


@_torch
def mm_matmul_ctx(X, A):
    """X A"""
    return X @ A


@_torch
def mm_square(X):
    """X X"""
    return X @ X


@_torch
def mm_softmax_rows(X):
    """row-wise softmax"""
    return torch.softmax(X, dim=1)


@_torch
def mm_elu_transpose(X):
    """elu(X)^T"""
    return torch.where(X > 0, X, torch.exp(X) - 1).T


@_torch
def pytree_tanh_regression(p, X, y):
    """0.5 |tanh(X w + b) - y|^2 for p = {"w", "b"}"""
    r = torch.tanh(X @ p["w"] + p["b"]) - y
    return 0.5 * torch.sum(r**2)


assert set(_FUNCTIONS) == set(sc.BY_NAME), sorted(set(sc.BY_NAME) ^ set(_FUNCTIONS))

#: every scenario with its torch function (named ``torch_<name>``) and the JAX
#: scenario's inputs and references
SCENARIOS: list[sc.Scenario] = [
    dataclasses.replace(s, f=_FUNCTIONS[s.name], name=f"torch_{s.name}") for s in sc.SCENARIOS
]
BY_NAME: dict[str, sc.Scenario] = {s.name: s for s in SCENARIOS}
