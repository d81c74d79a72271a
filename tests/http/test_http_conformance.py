"""The conformance scenarios through the client, over a real socket, in every encoding
(``make test``: one scenario of each kind, each case in one encoding, the encodings in
turn; the rest is marked slow and runs in ``make test-slow``, which CI runs).

For JAX backends the served result must equal the in-process library's to the last
bit (same executable, lossless wire formats), and both must match the analytic
references.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import scenarios as sc

import dxserve
from dxclient import AsyncClient, Client, JaxForward, JaxReverse, SecondOrder
from dxcontract.operators import OPERATORS

FIRST_ORDER = ["auto", JaxForward(), JaxReverse(batch_size=2)]
SECOND_ORDER = ["auto", SecondOrder(JaxReverse(), JaxReverse())]
ENCODINGS = ("binary", "b64", "json")


def _cases():
    cases = []
    for i, s in enumerate(sc.SCENARIOS):
        for j, op in enumerate(sc.DERIVATIVE_OPERATORS):
            if not sc.applies(s, op):
                continue
            backends = SECOND_ORDER if OPERATORS[op].order == 2 else FIRST_ORDER
            cases.append((s, op, backends[(i + j) % len(backends)]))
    return cases


CASES = _cases()
# One scenario of each kind runs in `make test`; the full sweep is marked slow (CI runs it).
_FIRST_OF_KIND = {s.kind: s.name for s in reversed(sc.SCENARIOS)}
CASES = [
    pytest.param(c, marks=() if _FIRST_OF_KIND[c[0].kind] == c[0].name else pytest.mark.slow)
    for c in CASES
]


def _identical(got, want, where):
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), where
        for g, w in zip(got, want, strict=True):
            _identical(g, w, where)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for k in want:
            _identical(got[k], want[k], f"{where}.{k}")
    else:
        want = np.asarray(want)
        got = np.asarray(got)
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert np.array_equal(got, want, equal_nan=True), f"{where}: not bit-identical"


def _call(api, f, s, op, backend):
    t = sc.tangents(s, op)
    args = (s.x,) if t is None else (s.x, t)
    return getattr(api, op)(f, backend, *args, *s.contexts)


def _encoded_cases() -> list:
    """Every case in every encoding; in ``make test`` each fast case in one encoding."""
    out, turn = [], 0
    for p in CASES:
        ((s, op, b),), fast_case = p.values, not p.marks
        ident = f"{s.name}-{op}-{getattr(b, 'type', b)}"
        for j, encoding in enumerate(ENCODINGS):
            fast = fast_case and j == turn % len(ENCODINGS)
            out.append(pytest.param(encoding, (s, op, b), id=f"{encoding}-{ident}",
                                    marks=() if fast else pytest.mark.slow))
        turn += fast_case
    return out


def test_every_scenario_is_served(server):
    with Client(server.url) as c:
        names = {f.name for f in c.functions()}
    assert {s.name for s in sc.SCENARIOS} <= names


@pytest.mark.parametrize(("encoding", "case"), _encoded_cases())
def test_served_equals_library_to_the_bit(server, encoding, case):
    s, op, backend = case
    with Client(server.url, encoding=encoding) as client:
        got = _call(client, s.name, s, op, backend)
    want = _call(dxserve, s.f, s, op, backend)
    _identical(got, want, f"{s.name} {op} via {encoding}")
    sc.assert_close(got, sc.expected(s, op, sc.tangents(s, op)), rtol=1e-8, atol=1e-10)


def test_async_client_matches(server):
    s = next(s for s in sc.SCENARIOS if s.name == "rosenbrock")

    async def both():
        async with AsyncClient(server.url) as c:
            return (
                await c.value_gradient_and_hessian("rosenbrock", "auto", s.x),
                await c.hvp("rosenbrock", "auto", s.x, (np.ones_like(s.x),)),
            )

    got, hv = asyncio.run(both())
    _identical(got, dxserve.value_gradient_and_hessian(s.f, "auto", s.x), "async vghess")
    _identical(hv, dxserve.hvp(s.f, "auto", s.x, (np.ones_like(s.x),)), "async hvp")
