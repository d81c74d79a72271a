"""Static trip counts read from StableHLO: what ``DXSERVE_EXPORT_UNBOUNDED_LOOPS`` refuses.

``lax.fori_loop`` with int bounds and ``lax.scan`` lower to a ``stablehlo.while`` whose
trip count is known (and so do their derivatives); a ``lax.while_loop`` on data, or a
``fori_loop`` whose bound is traced, has none. Anything not recognised counts as
unbounded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import export, lax

from dxserve.frameworks.jax.loops import trip_counts, unbounded_loops
from tests.trace_functions import newton_sqrt


def module_text(f) -> str:
    with jax.enable_x64(True):
        spec = jax.ShapeDtypeStruct((3,), jnp.float64)
        return export.export(jax.jit(f))(spec).mlir_module()


CASES = [
    ("fori", lambda x: lax.fori_loop(0, 5, lambda i, c: c * 1.1 + i, x).sum(), [5]),
    ("fori_from_2_step_1", lambda x: lax.fori_loop(2, 9, lambda i, c: jnp.sin(c), x).sum(), [7]),
    ("scan", lambda x: lax.scan(lambda c, xi: (c + xi, c), 0.0, x)[0], [3]),
    (
        "nested",
        lambda x: lax.fori_loop(
            0, 4, lambda i, c: lax.fori_loop(0, 3, lambda j, d: d * 1.1, c), x
        ).sum(),
        [4, 3],
    ),
    (
        "grad_of_fori",
        lambda x: jax.grad(lambda y: lax.fori_loop(0, 4, lambda i, c: jnp.sin(c), y).sum())(
            x
        ).sum(),
        [4, 4],
    ),
    (
        "while_on_data",
        lambda x: lax.while_loop(lambda c: c[0] > 1.0, lambda c: c + 1.0, x).sum(),
        [None],
    ),
    (
        "traced_bound",
        lambda x: lax.fori_loop(0, jnp.int32(x[0]), lambda i, c: c * 1.1, x).sum(),
        [None],
    ),
    (
        "static_around_unbounded",
        lambda x: lax.fori_loop(
            0, 3, lambda i, c: lax.while_loop(lambda d: d[0] < 10.0, lambda d: d * 2, c), x
        ).sum(),
        [3, None],
    ),
    ("newton", lambda x: newton_sqrt(x).sum(), [None]),
    ("no_loop", lambda x: jnp.sin(x).sum(), []),
]


@pytest.mark.parametrize("name,f,want", CASES, ids=[c[0] for c in CASES])
def test_trip_counts(name, f, want):
    text = module_text(f)
    assert trip_counts(text) == want
    assert unbounded_loops(text) == sum(n is None for n in want)


def test_a_loop_in_an_unknown_form_counts_as_unbounded():
    text = (
        module_text(CASES[0][1])
        .replace("compare  LT", "compare LT")
        .replace("compare LT", "compare LE")
    )
    assert trip_counts(text) == [None]
    generic = '%0 = "stablehlo.while"(%arg0) ({ ... })'
    assert unbounded_loops(generic) == 1
