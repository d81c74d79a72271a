"""``auto`` over HTTP on a function whose reverse mode does not trace (a while_loop).

A real server serves ``tests.trace_functions``: ``auto`` answers with forward mode
(forward-over-forward at second order), ``POST /prepare/{operator}`` says why beside
the ``resolved`` backend, the client's prep handle carries it, and an explicit
``jax-reverse`` is still a 422 problem naming itself and what works instead.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from dxclient import Client
from dxcontract.backends import JaxForward, SecondOrder
from dxcontract.errors import UnsupportedOperatorError
from tests.conftest import start_server, stop_server
from tests.references import cbrt_derivative, cbrt_second_derivative

X = [0.5, 2.0, 8.0]
XA = np.array(X)
RTOL = 1e-8
WHILE = "Reverse-mode differentiation does not work for lax.while_loop"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("autotrace"), modules=("dxserve.examples", "tests.trace_functions")
    )
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.url) as client:
        yield client


def post(http: httpx.Client, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_auto_answers_every_operator_by_forward_mode(http):
    d, d2 = cbrt_derivative(XA), cbrt_second_derivative(XA)
    got = post(http, "/gradient", {"function": "cbrt_sum", "x": X})  # backend: auto
    np.testing.assert_allclose(got["gradient"], d, rtol=RTOL)
    got = post(http, "/hessian", {"function": "cbrt_sum", "backend": "auto", "x": X})
    np.testing.assert_allclose(got["hessian"], np.diag(d2), rtol=RTOL, atol=0)
    got = post(http, "/hvp", {"function": "cbrt_sum", "x": X, "tangents": [[1.0, -1.0, 2.0]]})
    np.testing.assert_allclose(got["hvps"][0], d2 * [1.0, -1.0, 2.0], rtol=RTOL)
    got = post(http, "/jacobian", {"function": "cbrt_pair", "x": X})
    want = np.stack([d, np.cbrt(XA) + XA * d])
    np.testing.assert_allclose(got["jacobian"], want, rtol=RTOL)
    got = post(http, "/pullback", {"function": "cbrt_sum", "x": X, "tangents": [1.0]})
    np.testing.assert_allclose(got["pullbacks"][0], d, rtol=1e-7)  # finite differences


def test_prepare_reports_the_fallback_beside_the_resolved_backend(http):
    doc = post(http, "/prepare/gradient", {"function": "cbrt_sum", "backend": "auto", "x": X})
    assert doc["resolved"] == JaxForward().to_json()
    assert doc["reason"].startswith(f"reverse mode does not trace: ValueError: {WHILE}")
    assert doc["reason"].endswith("; using jax-forward")
    got = post(http, "/gradient", {"function": "cbrt_sum", "x": X, "prep": doc["prep"]})
    np.testing.assert_allclose(got["gradient"], cbrt_derivative(XA), rtol=RTOL)

    doc = post(http, "/prepare/hessian", {"function": "cbrt_sum", "x": X})
    assert doc["resolved"] == SecondOrder(JaxForward(), JaxForward()).to_json()
    assert doc["reason"].endswith("; using forward-over-forward")

    doc = post(http, "/prepare/gradient", {"function": "rosenbrock", "x": X})
    assert doc["reason"] == "auto's rule for gradient: reverse mode"
    doc = post(http, "/prepare/gradient", {"function": "cbrt_sum", "backend": "jax-forward", "x": X})
    assert "reason" not in doc or doc["reason"] is None


def test_the_client_prep_carries_the_reason(served):
    with Client(served.url) as client:
        prep = client.prepare_pullback("cbrt_sum", "auto", XA, (np.asarray(1.0),))
        # forward mode answers the pullback exactly, from basis pushforwards
        assert prep.resolved == JaxForward().to_json()
        assert prep.reason.startswith("reverse mode does not trace")
        (vjp,) = client.pullback("cbrt_sum", "auto", XA, (np.asarray(1.0),), prep=prep)
        np.testing.assert_allclose(vjp, cbrt_derivative(XA), rtol=RTOL)
        with pytest.raises(UnsupportedOperatorError, match="jax-reverse cannot compute"):
            client.gradient("cbrt_sum", "jax-reverse", XA)


@pytest.mark.parametrize("backend", ["jax-reverse", {"type": "jax-reverse", "batch_size": 2}])
def test_explicit_reverse_is_still_a_422_naming_it_and_what_works(http, backend):
    r = http.post("/gradient", json={"function": "cbrt_sum", "backend": backend, "x": X})
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    doc = r.json()
    assert doc["field"] == "backend"
    assert doc["detail"].startswith("jax-reverse cannot compute gradient of cbrt_sum here")
    assert WHILE in doc["detail"]
    assert "Use 'jax-forward', or 'auto', which picks it" in doc["detail"]
    # and the server goes on answering
    got = post(http, "/gradient", {"function": "cbrt_sum", "backend": "jax-forward", "x": X})
    np.testing.assert_allclose(got["gradient"], cbrt_derivative(XA), rtol=RTOL)
