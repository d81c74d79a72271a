"""A property-based conformance grid: random ``jnp`` compositions x dtypes x backends x operators.

Hypothesis writes a function as a whitelisted expression (``dxserve.frameworks.jax.expressions``): a
random composition of ``sin``, ``cos``, ``tanh``, ``exp``, ``square``, ``cumsum``, ``flip``,
``+``, ``-``, ``*`` on a vector ``x`` of 1 to 6 entries, in float16, bfloat16, float32,
float64, complex64 or complex128, sometimes scaled by an int32 context ``k``. Scalar functions are ``sum`` of it (real dtypes) or
``sum(abs(.)**2)`` (complex: real-valued, not holomorphic); array functions are the
composition itself (holomorphic for complex x). Every operator that applies is checked,
on every backend, against JAX's own transformation of the same function in the same
dtype: ``jax.grad``, ``jax.jacfwd`` (``holomorphic=True`` for complex), ``jax.jvp``,
``jax.vjp``, ``jax.hessian`` and ``jax.jvp(jax.grad)``; in process, and over a real server
through the client (``tests/client/test_dtype_grid_wire.py``).

The same function text runs in both places, so the server and the reference compute
exactly the same thing. Errors are measured as ``max|got - want| / max(1, max|want|)``
over each result; the bounds (``TOL``) are per dtype and kind of backend. Refused by
design, and checked to be refused with ``UnsupportedOperatorError`` (HTTP 422): finite
differences (also inside ``SecondOrder``) for float16 and bfloat16, whose steps would be
a tenth of x. ``jax.hessian`` of a real function of complex x is not a JAX
transformation (JAX refuses it), so complex Hessians are not in the grid; HVPs are.

Profiles: the default run (``make test``) draws ``FAST`` examples; ``-m slow``
(``make test-slow``) draws ``LONG``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dxserve
from dxcontract.errors import UnsupportedOperatorError
from dxserve import FiniteDifferences, JaxForward, JaxReverse, SecondOrder
from dxserve.frameworks.jax.expressions import compile_expression

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64),
          np.dtype(np.complex64), np.dtype(np.complex128)]
LOW = {np.dtype(np.float16), BF16}

FIRST = {"jax-forward": "jax-forward", "jax-reverse": "jax-reverse", "auto": "auto",
         "finite-differences": "finite-differences"}
SECOND = {
    "auto": "auto",
    "fwd-over-rev": SecondOrder(JaxForward(), JaxReverse()),
    "rev-over-rev": SecondOrder(JaxReverse(), JaxReverse()),
    "fwd-over-fwd": SecondOrder(JaxForward(), JaxForward()),
    "fd-over-rev": SecondOrder(FiniteDifferences(), JaxReverse()),
}

#: max|got - want| / max(1, max|want|), per real dtype (complex: its parts' dtype) and kind
#: of backend: "exact" is JAX's maths associated perhaps differently (a few roundings of the
#: dtype over at most ~10 operations), "fd" a central difference (h ~ eps^(1/3) of x)
TOL = {
    ("float64", "exact"): 1e-10, ("float32", "exact"): 1e-4,
    ("float16", "exact"): 3e-2, ("bfloat16", "exact"): 2e-1,
    ("float64", "fd"): 1e-5, ("float32", "fd"): 5e-2,
}
FAST, LONG = 6, 100  # make test: 6 derandomized examples (each compiles a grid)
#: a whole profile is one pytest test: its timeout covers every example drawn
FAST_TIMEOUT, LONG_TIMEOUT = 1200, 3000

UNARY = ["jnp.sin({})", "jnp.cos({})", "jnp.tanh({})", "jnp.exp(0.5 * {})", "jnp.square({})",
         "jnp.cumsum({})", "jnp.flip({})", "(0.5 * {})"]
BINARY = ["({} + {})", "({} - {})", "({} * {})"]

COUNTS: Counter = Counter()  # examples drawn per (place, dtype), printed at the end


def _compositions() -> st.SearchStrategy[str]:
    def grow(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        unary = st.tuples(st.sampled_from(UNARY), children).map(lambda p: p[0].format(p[1]))
        binary = st.tuples(st.sampled_from(BINARY), children, children).map(
            lambda p: p[0].format(p[1], p[2])
        )
        return unary | binary

    return st.recursive(st.just("x"), grow, max_leaves=4)


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(1, 6))
    body = draw(_compositions())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    complex_ = dtype.kind == "c"

    def sample() -> np.ndarray:
        v = rng.uniform(-1, 1, n)
        if complex_:
            v = v + 1j * rng.uniform(-1, 1, n)
        return v.astype(dtype)

    counts = draw(st.booleans())  # an integer context k: every term scaled by k
    if counts:
        body = f"({body} * k)"
    scalar = draw(st.booleans())
    if scalar:
        text = f"jnp.sum(jnp.square(jnp.abs({body})))" if complex_ else f"jnp.sum({body})"
    else:
        text = body
    contexts = (rng.integers(1, 4, n).astype(np.int32),) if counts else ()
    return {"dtype": dtype, "text": text, "scalar": scalar, "x": sample(), "t": sample(),
            "w": sample(), "args": ["x", "k"] if counts else ["x"], "contexts": contexts}


def _real_name(dtype: np.dtype) -> str:
    return {"complex64": "float32", "complex128": "float64"}.get(dtype.name, dtype.name)


def _is_fd(backend: Any) -> bool:
    return backend == "finite-differences" or (
        isinstance(backend, SecondOrder) and FiniteDifferences() in (backend.outer, backend.inner)
    )


def _declared(holomorphic: bool) -> dict[str, bool]:
    return {"holomorphic": True} if holomorphic else {}


def _checks(case: dict[str, Any], fc: Callable) -> Iterator[tuple[str, str, Any, Callable, Any]]:
    """(operator, backend name, backend, call(operator function, backend), JAX reference)."""
    x, t, w, c = case["x"], case["t"], case["w"], case["contexts"]

    def f(x):
        return fc(x, *c)

    holo = case["dtype"].kind == "c"
    if case["scalar"]:
        for name, b in FIRST.items():
            yield "gradient", name, b, lambda op, b: op(b, x, *c), jax.grad(f)(x)
        for name, b in SECOND.items():
            yield ("hvp", name, b, lambda op, b: op(b, x, (t,), *c)[0],
                   jax.jvp(jax.grad(f), (x,), (t,))[1])
            if not holo:
                yield "hessian", name, b, lambda op, b: op(b, x, *c), jax.hessian(f)(x)
    else:
        for name, b in FIRST.items():
            # complex x: a holomorphic composition, declared so as jax.jacfwd needs it
            yield ("jacobian", name, b, lambda op, b: op(b, x, *c, **_declared(holo)),
                   jax.jacfwd(f, holomorphic=holo)(x))
            yield "pushforward", name, b, lambda op, b: op(b, x, (t,), *c)[0], jax.jvp(f, (x,), (t,))[1]
            yield "pullback", name, b, lambda op, b: op(b, x, (w,), *c)[0], jax.vjp(f, x)[1](w)[0]


def _check(case: dict[str, Any], op: str, name: str, backend: Any, got: Any, want: Any) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == case["dtype"], (op, name, got.dtype)
    kind = "fd" if _is_fd(backend) else "exact"
    tol = TOL[_real_name(case["dtype"]), kind]
    g, e = got.astype(np.complex128), want.astype(np.complex128)
    err = np.max(np.abs(g - e), initial=0.0) / max(1.0, np.max(np.abs(e), initial=0.0))
    assert err <= tol, f"{op} on {name}, {case['dtype']}: error {err:.2e} > {tol:g}\n{case['text']}"


def _refused(case: dict[str, Any], backend: Any) -> bool:
    return case["dtype"] in LOW and _is_fd(backend)


def run_grid(case: dict[str, Any], operators: Callable[[str], Callable], place: str) -> None:
    """Every check of ``case`` through ``operators(op)(backend, x, ...)``."""
    COUNTS[place, case["dtype"].name] += 1
    f = compile_expression(case["text"], case["args"])
    with jax.enable_x64(True):
        for op, name, backend, call, want in _checks(case, f):
            if _refused(case, backend):
                with pytest.raises(UnsupportedOperatorError, match="finite"):
                    call(operators(op), backend)
                continue
            _check(case, op, name, backend, call(operators(op), backend), want)


def _in_process(case: dict[str, Any]) -> None:
    f = compile_expression(case["text"], case["args"])
    run_grid(case, lambda op: lambda b, *a, **k: getattr(dxserve, op)(f, b, *a, **k), "in process")


@pytest.mark.timeout(FAST_TIMEOUT)
@settings(max_examples=FAST, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_dtype_grid_in_process(case: dict[str, Any]) -> None:
    _in_process(case)


@pytest.mark.slow
@pytest.mark.timeout(LONG_TIMEOUT)
@settings(max_examples=LONG, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_dtype_grid_in_process_long(case: dict[str, Any]) -> None:
    _in_process(case)


def teardown_module() -> None:
    print("\nexamples per (place, dtype):", dict(sorted(COUNTS.items())))
