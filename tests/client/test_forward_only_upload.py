"""Uploading a function only forward mode differentiates: a while_loop Newton √x.

``client.register`` cannot trace its VJP (JAX's reverse mode does not go through a loop
of unknown length), so it uploads the forward artifacts alone (``modes: ["forward"]``,
format version 2) and warns why. A real server then answers every operator forward mode
can, ``auto`` picks forward mode (forward-over-forward at second order), and what needs
reverse mode (``jax-reverse``, a pullback by JAX) is a 422 naming what the function
serves. Bundles of the first format version still load; malformed ``modes``
declarations are 422 problems naming ``export``.
"""

from __future__ import annotations

import base64
import json

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

from dxclient import Client, FiniteDifferences, JaxForward, SecondOrder
from dxclient.export import ReverseModeWarning, export_function, split_bundle
from dxcontract.bundle import bundle_signature, pack
from dxcontract.errors import UnsupportedOperatorError
from tests.conftest import start_server, stop_server
from tests.references import rosenbrock_gradient, sqrt_derivative, sqrt_second_derivative
from tests.trace_functions import newton_sqrt

X = np.array([0.5, 1.5, 2.0, 4.0])
W = np.array([1.0, 2.0, 3.0, 4.0])
RTOL = 1e-8
FOF = SecondOrder(JaxForward(), JaxForward())
SUPPORTED = (
    "Supported: value, derivative, second_derivative, gradient, jacobian, pushforward, hvp "
    "and hessian with 'jax-forward'"
)


def wsqrt(x):
    """Σ wᵢ √xᵢ, √ by Heron's iteration in a while_loop."""
    return jnp.sum(jnp.asarray(W) * newton_sqrt(x))


def rosenbrock(x):
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def close(got, want, rtol=RTOL):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=0)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    # Newton's loop runs until it converges: its trip count depends on the data
    env = {"DXSERVE_EXPORT_UNBOUNDED_LOOPS": "allow"}
    srv = start_server(
        tmp_path_factory.mktemp("forward-only"), env=env, modules=("dxserve.examples",)
    )
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(served):
    with Client(served.url) as c:
        with pytest.warns(ReverseModeWarning, match="reverse mode does not trace"):
            remote = c.register(wsqrt, np.ones(4), name="wsqrt")
        assert remote.kind == "export"
        yield c


@pytest.fixture(scope="module")
def http(served, client):
    with httpx.Client(base_url=served.url) as h:
        yield h


def test_the_bundle_declares_forward_mode_only():
    with pytest.warns(ReverseModeWarning, match="Reverse-mode differentiation does not work"):
        bundle = export_function(wsqrt, np.ones(4))
    manifest, blobs = split_bundle(bundle)
    assert manifest["modes"] == ["forward"] and manifest["format_version"] == 2
    assert sorted(blobs) == ["jvp", "jvp_jvp", "primal"]
    full = bundle_signature(export_function(rosenbrock, np.ones(3)))
    assert full["modes"] == ["forward", "reverse"] and full["format_version"] == 1


def test_forward_operators_match_the_analytic_derivatives(client):
    d, d2 = W * sqrt_derivative(X), W * sqrt_second_derivative(X)
    for backend in ("auto", "jax-forward"):
        close(client.gradient("wsqrt", backend, X), d)
        close(client.jacobian("wsqrt", backend, X), d)  # f(x) is a scalar: J is ∇f
    value, g = client.value_and_gradient("wsqrt", "auto", X)
    close(value, np.sum(W * np.sqrt(X)), 1e-14)
    close(g, d)
    for backend in ("auto", FOF):
        close(client.hessian("wsqrt", backend, X), np.diag(d2))
        t = np.array([1.0, -1.0, 0.5, 2.0])
        (hv,) = client.hvp("wsqrt", backend, X, (t,))
        close(hv, d2 * t)
    t1, t2 = np.ones(4), np.array([0.0, 1.0, 0.0, -3.0])
    (a, b) = client.pushforward("wsqrt", "auto", X, (t1, t2))
    close(a, d @ t1)
    close(b, d @ t2)
    close(client.pushforward("wsqrt", "jax-forward", X, (t2,))[0], d @ t2)


def test_auto_prepares_forward_mode_and_says_why(client):
    prep = client.prepare_gradient("wsqrt", "auto", X)
    assert prep.resolved == JaxForward().to_json()
    assert prep.reason.startswith("reverse mode does not trace: uploaded export 'wsqrt'")
    assert prep.reason.endswith("; using jax-forward")
    close(client.gradient("wsqrt", "auto", X, prep=prep), W * sqrt_derivative(X))
    prep = client.prepare_hessian("wsqrt", "auto", X)
    assert prep.resolved == FOF.to_json()
    assert prep.reason.endswith("; using forward-over-forward")
    # a pullback needs a transpose: auto falls back to finite differences
    prep = client.prepare_pullback("wsqrt", "auto", X, (np.asarray(1.0),))
    assert prep.resolved == FiniteDifferences().to_json()
    (vjp,) = client.pullback("wsqrt", "auto", X, (np.asarray(2.0),), prep=prep)
    close(vjp, 2.0 * W * sqrt_derivative(X), 1e-7)  # central differences


@pytest.mark.parametrize(
    ("operator", "backend", "tangents"),
    [
        ("gradient", "jax-reverse", None),
        ("hessian", {"type": "second-order", "outer": "jax-forward", "inner": "jax-reverse"},
         None),
        ("pullback", "jax-reverse", [1.0]),
        ("pullback", "jax-forward", [1.0]),
    ],
)  # fmt: skip
def test_what_needs_reverse_mode_is_a_422_naming_what_is_supported(
    http, client, operator, backend, tangents
):
    body = {"function": "wsqrt", "backend": backend, "x": X.tolist()}
    if tangents is not None:
        body["tangents"] = tangents
    r = http.post(f"/{operator}", json=body)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    doc = r.json()
    assert doc["field"] == "backend" and doc["type"].endswith("unsupported-operator")
    assert "uploaded export 'wsqrt' carries forward mode only" in doc["detail"]
    assert SUPPORTED in doc["detail"] and "pullback with 'finite-differences'" in doc["detail"]
    assert "or 'auto', which picks it" in doc["detail"]
    with pytest.raises(UnsupportedOperatorError, match="carries forward mode only"):
        client.gradient("wsqrt", "jax-reverse", X)
    close(client.gradient("wsqrt", "auto", X), W * sqrt_derivative(X))  # still served


def test_the_description_shows_the_modes(http, client):
    r = http.get("/functions/wsqrt")
    assert r.status_code == 200, r.text
    assert r.json()["signature"]["modes"] == ["forward"]


def _repacked(bundle: bytes, change) -> bytes:
    """``bundle`` with its manifest changed by ``change(manifest, blobs)`` and every
    checksum recomputed (so the container's own checks pass)."""
    manifest, blobs = split_bundle(bundle)
    manifest, blobs = dict(manifest), dict(blobs)
    manifest.pop("artifacts")
    change(manifest, blobs)
    return pack(manifest, blobs)


def test_a_bundle_of_the_first_format_version_still_loads(http, client):
    # written before bundles declared their modes: version 1, every artifact, no "modes"
    old = _repacked(export_function(rosenbrock, np.ones(3)), lambda m, b: m.pop("modes"))
    assert "modes" not in bundle_signature(old) and bundle_signature(old)["format_version"] == 1
    body = {"name": "rosenbrock_v1", "export": base64.b64encode(old).decode()}
    r = http.post("/functions", json=body)
    assert r.status_code in (200, 201), r.text
    x = np.array([0.5, -1.0, 1.5])
    for backend in ("jax-reverse", "auto"):
        close(client.gradient("rosenbrock_v1", backend, x), rosenbrock_gradient(x), 1e-12)
    (vjp,) = client.pullback("rosenbrock_v1", "jax-reverse", x, (np.asarray(1.0),))
    close(vjp, rosenbrock_gradient(x), 1e-12)


def _set(**fields):
    return lambda m, b: m.update(fields)


def _drop(*names):
    def change(m, b):
        for name in names:
            b.pop(name, None)

    return change


HOSTILE = [
    ("no-modes-in-v2", lambda m, b: m.pop("modes"), "'modes' must be a non-empty list"),
    ("modes-a-string", _set(modes="forward"), "'modes' must be a non-empty list"),
    ("modes-empty", _set(modes=[]), "'modes' must be a non-empty list"),
    ("modes-null", _set(modes=None), "'modes' must be a non-empty list"),
    ("modes-an-object", _set(modes={"forward": True}), "'modes' must be a non-empty list"),
    ("unknown-mode", _set(modes=["forward", "sideways"]), "unknown mode 'sideways'"),
    ("mode-a-number", _set(modes=["forward", 1]), "unknown mode 1"),
    ("mode-a-list", _set(modes=[["forward"]]), "unknown mode ['forward']"),
    ("repeated-mode", _set(modes=["forward", "forward"]), "repeats a mode"),
    ("reverse-alone", _set(modes=["reverse"]), "must include 'forward'"),
    ("v1-forward-only", _set(format_version=1), "format_version 1 carries every mode"),
    ("claims-reverse", _set(modes=["forward", "reverse"]), "exactly the artifacts"),
    ("missing-jvp-jvp", _drop("jvp_jvp"), "exactly the artifacts"),
    ("version-3", _set(format_version=3), "unknown format_version 3"),
    ("version-a-string", _set(format_version="2"), "unknown format_version '2'"),
    ("version-true", _set(format_version=True), "unknown format_version True"),
]


@pytest.mark.parametrize(("change", "says"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_malformed_modes_are_422_problems_naming_export(http, change, says):
    with pytest.warns(ReverseModeWarning):
        bundle = _repacked(export_function(wsqrt, np.ones(4)), change)
    with pytest.raises(ValueError, match="modes|artifacts|format_version") as info:
        split_bundle(bundle)
    assert says in str(info.value)
    r = http.post("/functions", json={"name": "hostile", "export": base64.b64encode(bundle).decode()})
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    doc = r.json()
    assert doc["field"] == "export" and says in doc["detail"], doc
    assert http.get("/health").status_code == 200
    assert "hostile" not in {f["name"] for f in http.get("/functions").json()["functions"]}


def test_a_huge_modes_list_is_refused_without_a_child(http):
    bundle = _repacked(
        export_function(rosenbrock, np.ones(3)), _set(modes=["forward"] * 100_000)
    )
    r = http.post("/functions", json={"name": "hostile", "export": base64.b64encode(bundle).decode()})
    assert r.status_code in (413, 422), r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert json.loads(r.text)["field"] == "export"
