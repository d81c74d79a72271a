"""Conformance: every scenario x every applicable operator x every backend.

Results are checked against the hand-written numpy references of ``scenarios.py``:
exact (JAX) backends at ``rtol=1e-8`` in float64, finite differences at the looser
tolerances below. Tangents are always the batch ``(t, -t)``, so every tangent operator
also checks that a batch of two gives ``(r, -r)``. A ``SecondOrder`` backend asked for
a first-order operator (or ``value``: second-order backends serve only the second-order
operators, as ``GET /backends`` lists) must raise ``UnsupportedOperatorError``.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import dxserve
from dxcontract.errors import (
    DtypeMismatchError,
    NotScalarInputError,
    NotScalarOutputError,
    ShapeMismatchError,
    UnsupportedOperatorError,
)
from dxcontract.operators import OPERATORS
from dxserve import FiniteDifferences, JaxForward, JaxReverse, SecondOrder

try:  # imported as a top-level module by pytest (tests/ has no __init__.py)
    import scenarios as sc
except ImportError:  # pragma: no cover - imported as tests.scenarios
    from tests import scenarios as sc

# --- tolerances -----------------------------------------------------------------------
# Exact (JAX) backends: elementwise |a - e| <= ATOL + RTOL |e| in float64.
RTOL = 1e-8
ATOL = 1e-10

# Finite differences: max|a - e| <= FD_RTOL * max(1, max|e|) over each result (the error of
# a difference quotient scales with the size of the whole result, not with each entry).
# Measured worst case of max|a - e| / max(1, max|e|) over every scenario and operator here
# (float64, default steps), and the bound used (headroom 20-100x):
#   central          h = eps^(1/3) max(1,|x|)     worst 1.2e-10 (mv_row_norms pullback)  -> 1e-8
#   forward          h = eps^(1/2) max(1,|x|)     worst 4.5e-8  (vs_log1p_sq gradient)   -> 1e-6
#   central FD over an exact JAX gradient         worst 1.4e-10 (vs_log1p_sq hessian)    -> 1e-8
#   central over central, h = eps^(1/4) both      worst 1.1e-7  (vs_log1p_sq hessian)    -> 1e-5
#   forward over forward, h = eps^(1/3) both      worst 2.7e-5  (vs_sin_sq hessian)      -> 1e-3
FD_RTOL = {
    "central": 1e-8,
    "forward": 1e-6,
    "central-over-exact": 1e-8,
    "central-over-central": 1e-5,
    "forward-over-forward": 1e-3,
}

# --- backends -------------------------------------------------------------------------
FWD_REV = SecondOrder(JaxForward(), JaxReverse())
EXACT_BACKENDS = {
    "jax-forward": "jax-forward",
    "jax-reverse": "jax-reverse",
    "auto": "auto",
    "so(fwd,rev)": FWD_REV,
    "so(rev,rev)": SecondOrder(JaxReverse(), JaxReverse()),
    "so(rev,fwd)": SecondOrder(JaxReverse(), JaxForward()),
    "so(fwd,fwd)": SecondOrder(JaxForward(), JaxForward()),
    "fwd-bs2": JaxForward(batch_size=2),
    "rev-bs3": JaxReverse(batch_size=3),
}
# id -> (backend, FD_RTOL key for first-order operators, key for second-order operators)
FD_BACKENDS = {
    "fd-central": ("finite-differences", "central", "central-over-central"),
    "fd-forward": (FiniteDifferences("forward"), "forward", "forward-over-forward"),
    "so(fd,rev)": (SecondOrder(FiniteDifferences(), JaxReverse()), None, "central-over-exact"),
    "so(fd,fd)": (SecondOrder(FiniteDifferences(), FiniteDifferences()), None,
                  "central-over-central"),
}
BACKENDS = {**EXACT_BACKENDS, **{k: v[0] for k, v in FD_BACKENDS.items()}}


def _is_second_order(backend) -> bool:
    return isinstance(backend, SecondOrder)


def _tolerance(backend_id: str, operator: str) -> tuple[float, float, bool]:
    """``(rtol, atol, scaled)`` for this backend and operator."""
    order = OPERATORS[operator].order
    if backend_id in EXACT_BACKENDS or order == 0:
        return RTOL, ATOL, False
    _, first, second = FD_BACKENDS[backend_id]
    rtol = FD_RTOL[second if order == 2 else first]
    return rtol, rtol, True


# --- the grid -------------------------------------------------------------------------
# XLA compilation dominates this file (~0.1-0.25 s per executable on 2 CPU cores, even for
# these tiny functions) and every (function, operator, backend, signature) compiles its own
# executable: the full product below would compile ~3900. So the grid is chosen to cover
# every axis and every pair of axes at ~1/5 of the cost (checked by ``test_grid_coverage``):
#   1. every scenario x every applicable operator, with the core exact backends: both JAX
#      modes for first-order families (each native and transposed; the two operators of a
#      family, e.g. gradient and value_and_gradient, take one mode each, alternating between
#      scenarios), forward-over-reverse ("auto") for second-order ones, "jax-reverse" for value;
#   2. every backend x every applicable family on one representative scenario of each kind
#      (scalar/vector/matrix/pytree in and out), including the UnsupportedOperatorError of
#      SecondOrder on first-order operators; the operators of a family alternate between
#      backends and representatives, so every (operator, backend) pair runs somewhere.
# ``value`` ignores first-order backends (SecondOrder raises): it takes every backend on
# three scenarios only.
# ``_cases(full=True)`` is the whole product; the FD tolerances above were measured on it.
# The rest of the product (every scenario x operator x backend) runs too, marked slow:
# ``make test-slow`` and CI run it.
CORE = {0: ("jax-reverse",), 1: ("jax-forward", "jax-reverse"), 2: ("auto",)}
REPRESENTATIVES = tuple(
    next(s.name for s in sc.SCENARIOS if s.kind == kind) for kind in sc.KINDS
)
VALUE_EVERY_BACKEND = ("ss_sin_exp", "rosenbrock", "pytree_tanh_regression")
FAMILY_OPERATORS: dict[str, list[str]] = {}
for _op, _spec in OPERATORS.items():
    FAMILY_OPERATORS.setdefault(_spec.family, []).append(_op)


def _selected(si: int, s: sc.Scenario, bi: int, bid: str, op: str) -> bool:
    spec = OPERATORS[op]
    ops = FAMILY_OPERATORS[spec.family]
    if s.name in REPRESENTATIVES and (spec.order > 0 or s.name in VALUE_EVERY_BACKEND):
        return ops[(REPRESENTATIVES.index(s.name) + bi) % len(ops)] == op
    if bid in CORE[spec.order]:
        return spec.order != 1 or ops[(si + bi) % len(ops)] == op
    return False


def _cases(full: bool = False) -> list:
    """Ordered scenario -> backend -> operator."""
    cases = []
    for si, s in enumerate(sc.SCENARIOS):
        for bi, (bid, backend) in enumerate(BACKENDS.items()):
            for op in sc.DERIVATIVE_OPERATORS:
                if not sc.applies(s, op):
                    continue
                if not (full or _selected(si, s, bi, bid, op)):
                    continue
                raises = _is_second_order(backend) and OPERATORS[op].order <= 1
                cases.append(pytest.param(s, op, bid, raises, id=f"{s.name}-{op}-{bid}"))
    return cases


_SELECTED = {p.id for p in _cases()}
# The selection runs in `make test`; the rest of the full product is marked slow (CI runs it).
GRID = [
    p if p.id in _SELECTED else pytest.param(*p.values, id=p.id, marks=pytest.mark.slow)
    for p in _cases(full=True)
]


def test_grid_coverage() -> None:
    """The grid covers every (scenario, operator), every (scenario, family, core backend),
    every (representative, family, backend) and every (operator, backend) pair."""
    full = {tuple(p.values[:3]) for p in _cases(full=True)}
    grid = {tuple(p.values[:3]) for p in GRID}
    assert grid <= full
    family = {(s.name, OPERATORS[op].family, b) for s, op, b in grid}
    for s, op, b in full:
        spec = OPERATORS[op]
        assert any(g[0] is s and g[1] == op for g in grid), (s.name, op)
        assert any(g[1] == op and g[2] == b for g in grid), (op, b)
        if b in CORE[spec.order] or (s.name in REPRESENTATIVES and spec.order > 0):
            assert (s.name, spec.family, b) in family, (s.name, spec.family, b)


@pytest.fixture(autouse=True, scope="module")
def _fast_compiles():
    """Compile with XLA's cheap pipeline in this module (same maths, ~40% less compile time).

    The executables it makes differ in the last bits from optimized ones, so the shared
    prep cache is emptied on the way out: later modules compare bits with the server.
    """
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    dxserve.CACHE.clear()
    yield
    jax.config.update("jax_disable_most_optimizations", before)
    dxserve.CACHE.clear()


@pytest.mark.parametrize(("s", "op", "bid", "raises"), GRID)
def test_operator(s: sc.Scenario, op: str, bid: str, raises: bool) -> None:
    backend = BACKENDS[bid]
    fn = getattr(dxserve, op)
    tangents = sc.tangents(s, op)
    args = (s.x,) if tangents is None else (s.x, tangents)
    if raises:
        with pytest.raises(UnsupportedOperatorError) as info:
            fn(s.f, backend, *args, *s.contexts)
        assert info.value.field == "backend"
        return
    got = fn(s.f, backend, *args, *s.contexts)
    want = sc.expected(s, op, tangents)
    rtol, atol, scaled = _tolerance(bid, op)
    sc.assert_close(got, want, rtol=rtol, atol=atol, scaled=scaled, path=op)
    for leaf in sc.tree_leaves(got):
        assert np.asarray(leaf).dtype == np.float64, f"{op} returned {np.asarray(leaf).dtype}"
    if tangents is not None:  # the batch (t, -t) gives (r, -r)
        results = got[-1] if isinstance(got, tuple) and len(OPERATORS[op].results) > 1 else got
        assert len(results) == 2
        sc.assert_close(results[1], sc.tree_map(np.negative, results[0]),
                        rtol=max(rtol, 1e-12), atol=1e-12, scaled=scaled, path=f"{op}[1]")


def _not_applicable() -> list:
    return [
        pytest.param(s, op, id=f"{s.name}-{op}")
        for s in sc.SCENARIOS
        for op in sc.DERIVATIVE_OPERATORS
        if not sc.applies(s, op)
    ]


@pytest.mark.parametrize(("s", "op"), _not_applicable())
def test_not_applicable_raises(s: sc.Scenario, op: str) -> None:
    """Operators that do not apply raise the typed error the scenarios module predicts."""
    tangents = sc.tangents(s, op)
    args = (s.x,) if tangents is None else (s.x, tangents)
    with pytest.raises(sc.expected_error(s, op)):
        getattr(dxserve, op)(s.f, "auto", *args, *s.contexts)


# --- dtypes ---------------------------------------------------------------------------
F32_CASES = ["jax-forward", "jax-reverse", "auto", "fd-central"]


@pytest.mark.parametrize("bid", F32_CASES)
def test_float32_in_float32_out(bid: str) -> None:
    s = sc.BY_NAME["vs_sin_sq"]
    x32 = s.x.astype(np.float32)
    backend = BACKENDS[bid]
    value, grad = dxserve.value_and_gradient(s.f, backend, x32)
    assert np.asarray(value).dtype == np.float32
    assert np.asarray(grad).dtype == np.float32
    rtol = 1e-5 if bid in EXACT_BACKENDS else 1e-3  # float32: eps ~1.2e-7, FD h ~5e-3
    np.testing.assert_allclose(np.asarray(grad), s.gradient, rtol=rtol, atol=rtol)
    (hv,) = dxserve.hvp(s.f, backend, x32, (np.ones(x32.shape, np.float32),))
    assert np.asarray(hv).dtype == np.float32
    j = dxserve.jacobian(sc.BY_NAME["vv_softmax"].f, backend,
                         sc.BY_NAME["vv_softmax"].x.astype(np.float32))
    assert np.asarray(j).dtype == np.float32


def test_float32_pytree_keeps_leaf_dtypes() -> None:
    s = sc.BY_NAME["pytree_tanh_regression"]
    p32 = {k: v.astype(np.float32) for k, v in s.x.items()}
    g = dxserve.gradient(s.f, "jax-reverse", p32, *s.contexts)
    assert {k: np.asarray(v).dtype for k, v in g.items()} == {"w": np.float32, "b": np.float32}


# --- errors ---------------------------------------------------------------------------
def test_gradient_of_vector_function_is_not_scalar_output() -> None:
    s = sc.BY_NAME["vv_softmax"]
    with pytest.raises(NotScalarOutputError) as info:
        dxserve.gradient(s.f, "jax-reverse", s.x)
    assert info.value.field == "function"


def test_derivative_of_vector_input_is_not_scalar_input() -> None:
    s = sc.BY_NAME["rosenbrock"]
    with pytest.raises(NotScalarInputError) as info:
        dxserve.derivative(s.f, "jax-forward", s.x)
    assert info.value.field == "x"


def test_pushforward_wrong_tangent_shape_names_the_tangent() -> None:
    s = sc.BY_NAME["rosenbrock"]
    good = np.ones_like(s.x)
    with pytest.raises(ShapeMismatchError) as info:
        dxserve.pushforward(s.f, "jax-forward", s.x, (good, np.ones(s.x.size + 1)))
    assert info.value.field == "tangents[1]"


def test_integer_x_to_gradient_is_a_dtype_mismatch() -> None:
    s = sc.BY_NAME["rosenbrock"]
    with pytest.raises(DtypeMismatchError) as info:
        dxserve.gradient(s.f, "jax-reverse", np.arange(4))
    assert info.value.field == "x"


def test_jacobian_and_hessian_of_pytree_x_are_jax_blocks() -> None:
    s = sc.BY_NAME["pytree_tanh_regression"]  # more in tests/library/test_pytrees.py
    J = dxserve.jacobian(s.f, "jax-forward", s.x, *s.contexts)
    sc.assert_close(J, s.gradient, rtol=RTOL, atol=ATOL)  # scalar f: blocks of shape x[k]
    H = dxserve.hessian(s.f, "auto", s.x, *s.contexts)
    assert H["w"]["b"].shape == (3, 2, 2)
    sc.assert_close(H, s.hessian, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    "op", ["value", "gradient", "jacobian", "derivative", "pushforward", "pullback"]
)
def test_second_order_backend_on_first_order_operator(op: str) -> None:
    s = sc.BY_NAME["ss_sin_exp"]  # every first-order operator applies to scalar -> scalar
    tangents = sc.tangents(s, op)
    args = (s.x,) if tangents is None else (s.x, tangents)
    for backend in (FWD_REV, SecondOrder(FiniteDifferences(), JaxReverse())):
        with pytest.raises(UnsupportedOperatorError):
            getattr(dxserve, op)(s.f, backend, *args)
