"""Property: no JSON body, however odd, makes an operator route answer 5xx.

Hypothesis builds request bodies from plausible and hostile pieces (names that
exist and not, backends well- and ill-formed, arrays, ragged lists, pytrees,
typed-array objects with lying fields) and posts them in process.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from dxserve.http import create_app
from dxserve.settings import Settings

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
    st.sampled_from(["NaN", "Infinity", "-Infinity"]),
)
JSONISH = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
NUMBERS = st.lists(st.floats(-3, 3), min_size=1, max_size=5)
TYPED = st.fixed_dictionaries(
    {
        "__ndarray__": st.one_of(st.text(max_size=12), NUMBERS, JSONISH),
        "dtype": st.one_of(st.sampled_from(["float64", "float32", "int64", "bool", "complex128", "f8"]), JSONISH),
        "shape": st.one_of(st.lists(st.integers(-2, 4), max_size=3), JSONISH),
    }
)
ARRAY = st.one_of(NUMBERS, st.floats(-3, 3), TYPED, JSONISH, st.dictionaries(st.sampled_from(["w", "b", "__x"]), NUMBERS, max_size=2))
BACKEND = st.one_of(
    st.sampled_from(["auto", "jax-forward", "jax-reverse", "finite-differences", "nope"]),
    st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["jax-forward", "second-order", "finite-differences"]), JSONISH)},
                          optional={"batch_size": JSONISH, "step": JSONISH, "method": JSONISH,
                                    "outer": JSONISH, "inner": JSONISH}),
    JSONISH,
)
BODY = st.fixed_dictionaries(
    {},
    optional={
        "function": st.one_of(st.sampled_from(["rosenbrock", "sin_cumsum", "tanh_layer", "least_squares", "normal_logpdf"]), JSONISH),
        "backend": BACKEND,
        "x": ARRAY,
        "tangents": st.one_of(st.lists(ARRAY, max_size=3), JSONISH),
        "contexts": st.one_of(st.lists(ARRAY, max_size=3), JSONISH),
        "prep": JSONISH,
        "extra": JSONISH,
    },
)
OPERATORS = st.sampled_from(["gradient", "hvp", "jacobian", "pullback", "derivative", "value", "hessian", "pushforward"])


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    app = create_app(Settings(store=tmp_path_factory.mktemp("fuzz"), compilation_cache=""))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(op=OPERATORS, body=BODY)
def test_no_body_makes_an_operator_fail_with_5xx(http, op, body):
    r = http.post(f"/{op}", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code < 500, (op, body, r.text)
    if r.status_code >= 400:
        assert r.headers["content-type"] == "application/problem+json"
        assert "field" in r.json() or r.status_code == 404, r.text
