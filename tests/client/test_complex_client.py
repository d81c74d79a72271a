"""Complex numbers over HTTP: JAX's convention on every backend, through every encoding.

A real server serves ``tests.complex_functions`` (and the server-only complex-step
plug-in of ``tests.server_only_backend``). f(z) = Σ |z|² + Re z Im z at z = [1+2j,
-0.5+0.3j] has ∂f/∂x = 2x + y and ∂f/∂y = 2y + x, so JAX's gradient ∂f/∂x - i ∂f/∂y is
[4-5j, -0.7-0.1j]; jax-forward and finite-differences once answered [4, -0.7] and
[4+0j, -0.7+0j]. The answers must come back complex, exact where they were exact, from
the JSON, base64 and binary encodings alike.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dxclient import Client
from dxcontract.errors import DtypeMismatchError, UnsupportedOperatorError
from tests.conftest import REQUEST_DEADLINE, ServerProcess, start_server, stop_server

jax.config.update("jax_enable_x64", True)  # the references, in complex128

Z = np.array([1 + 2j, -0.5 + 0.3j])
WANT = np.array([4 - 5j, -0.7 - 0.1j])
ENCODINGS = ("json", "b64", "binary")
#: the tolerance each backend is held to here (finite differences: their truncation error)
BACKENDS = {"jax-forward": 1e-13, "finite-differences": 1e-8, "auto": 1e-13, "jax-reverse": 1e-13}


def abs2_plus_re_im(z):
    return jnp.sum(jnp.abs(z) ** 2 + jnp.real(z) * jnp.imag(z))


def z2_sin(z):
    return z**2 * jnp.sin(z)


def gradient_by_hand(z: np.ndarray) -> np.ndarray:
    return (2 * z.real + z.imag) - 1j * (2 * z.imag + z.real)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(
        tmp_path_factory.mktemp("complex"),
        modules=("tests.complex_functions", "tests.server_only_backend"),
    )
    try:
        yield server
    finally:
        stop_server(server)


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_the_example_on_every_backend_and_encoding(srv: ServerProcess, backend: str,
                                                   encoding: str) -> None:
    with Client(srv.url, encoding=encoding) as client:
        g = client.gradient("abs2_plus_re_im", backend, Z)
        y, g2 = client.value_and_gradient("abs2_plus_re_im", backend, Z)
    assert g.dtype == np.complex128 and g.shape == (2,)
    np.testing.assert_allclose(g, WANT, rtol=BACKENDS[backend])
    np.testing.assert_allclose(g, jax.grad(abs2_plus_re_im)(Z), rtol=BACKENDS[backend])
    np.testing.assert_allclose(g2, g, rtol=1e-15)
    assert np.asarray(y).dtype == np.float64 and np.isclose(y, abs2_plus_re_im(Z), rtol=1e-15)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_complex64_stays_complex64(srv: ServerProcess, encoding: str) -> None:
    z = Z.astype(np.complex64)
    with Client(srv.url, encoding=encoding) as client:
        exact = client.gradient("abs2_plus_re_im", "jax-forward", z)
        fd = client.gradient("abs2_plus_re_im", "finite-differences", z)
    assert exact.dtype == fd.dtype == np.complex64
    np.testing.assert_allclose(exact, WANT, rtol=1e-6)
    # float32's step: max|error| / max|g| measured 6e-6
    assert np.abs(fd - WANT).max() <= 1e-3 * np.abs(WANT).max()


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_tangents_and_cotangents_of_a_holomorphic_function(srv: ServerProcess,
                                                           encoding: str) -> None:
    ts = (np.array([0.3 - 0.7j, 1.1 + 0.4j]), np.array([-1.0 + 0.5j, 0.2 - 0.1j]))
    with Client(srv.url, encoding=encoding) as client:
        jac = client.jacobian("z2_sin", "jax-reverse", Z, holomorphic=True)
        y, pushed = client.value_and_pushforward("z2_sin", "jax-forward", Z, ts)
        pulled = client.pullback("z2_sin", "finite-differences", Z, ts)
        hv = client.hvp("abs2_plus_re_im", "auto", Z, ts)
    np.testing.assert_allclose(jac, jax.jacfwd(z2_sin, holomorphic=True)(Z), rtol=1e-13)
    np.testing.assert_allclose(y, z2_sin(Z), rtol=1e-14)
    _, vjp = jax.vjp(z2_sin, Z)
    for t, p, q, h in zip(ts, pushed, pulled, hv, strict=True):
        np.testing.assert_allclose(p, jax.jvp(z2_sin, (Z,), (t,))[1], rtol=1e-13)
        np.testing.assert_allclose(q, vjp(t)[0], rtol=1e-8)
        want = jax.jvp(jax.grad(abs2_plus_re_im), (Z,), (t,))[1]
        np.testing.assert_allclose(h, want, rtol=1e-13)
        assert p.dtype == q.dtype == h.dtype == np.complex128


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_long_complex_vector(srv: ServerProcess, encoding: str) -> None:
    rng = np.random.default_rng(0)
    z = rng.normal(size=5000) + 1j * rng.normal(size=5000)
    with Client(srv.url, encoding=encoding) as client:
        g = client.gradient("abs2_plus_re_im", "auto", z)
    np.testing.assert_allclose(g, gradient_by_hand(z), rtol=1e-13, atol=1e-13)


def test_sparse_results_carry_complex_data(srv: ServerProcess) -> None:
    with Client(srv.url) as client:
        holo = client.jacobian("z2_sin", {"type": "sparse", "coloring": "row"}, Z, holomorphic=True)
        for operator in ("jacobian", "hessian"):  # a real f of complex z: no Jacobian matrix
            with pytest.raises(UnsupportedOperatorError) as info:
                getattr(client, operator)(
                    "abs2_plus_re_im", {"type": "sparse", "coloring": "column"}, Z
                )
            assert info.value.field == "holomorphic"
    np.testing.assert_allclose(holo.toarray(), jax.jacfwd(z2_sin, holomorphic=True)(Z), rtol=1e-13)


def test_plain_json_without_the_client(srv: ServerProcess) -> None:
    """Complex arrays in JSON are typed objects of [re, im] pairs, both ways."""
    z = {"__ndarray__": [[1.0, 2.0], [-0.5, 0.3]], "dtype": "complex128", "shape": [2]}
    for backend in ("jax-forward", "finite-differences", "auto"):
        r = httpx.post(f"{srv.url}/gradient", json={
            "function": "abs2_plus_re_im", "backend": backend, "x": z})
        assert r.status_code == 200, r.text
        g = r.json()["gradient"]
        assert g["dtype"] == "complex128" and g["shape"] == [2]
        pairs = np.array(g["__ndarray__"])
        np.testing.assert_allclose(pairs[:, 0] + 1j * pairs[:, 1], WANT, rtol=1e-8)


# --- refusals -----------------------------------------------------------------------------
def test_the_complex_step_plug_in_refuses(srv: ServerProcess) -> None:
    """imaginary-step evaluates at complex points of its own: it cannot take complex x
    apart, so it refuses instead of answering in another convention."""
    with Client(srv.url) as client:
        with pytest.raises(UnsupportedOperatorError) as info:
            client.gradient("abs2_plus_re_im", "imaginary-step", Z)
        assert info.value.field == "backend"
        assert "imaginary-step" in info.value.detail and "jax-reverse" in info.value.detail
        # real x: served as before
        x = np.array([1.0, -0.5])
        np.testing.assert_allclose(
            client.jacobian("z2_sin", "imaginary-step", x), np.diag(2 * x * np.sin(x) + x**2 * np.cos(x)),
            rtol=1e-13,
        )
    z = {"__ndarray__": [[1.0, 2.0], [-0.5, 0.3]], "dtype": "complex128", "shape": [2]}
    second = {"type": "second-order", "outer": "jax-forward", "inner": "imaginary-step"}
    for operator, backend in (("gradient", "imaginary-step"), ("hessian", second)):
        r = httpx.post(f"{srv.url}/{operator}", json={
            "function": "abs2_plus_re_im", "backend": backend, "x": z})
        assert r.status_code == 422, r.text
        assert r.headers["content-type"] == "application/problem+json"


def test_careless_and_hostile_complex_requests(srv: ServerProcess) -> None:
    with Client(srv.url) as client:
        with pytest.raises(DtypeMismatchError) as info:  # real tangents for complex x
            client.pushforward("z2_sin", "auto", Z, (np.ones(2),))
        assert info.value.field == "tangents[0]"
        with pytest.raises(DtypeMismatchError) as info:  # jax.grad refuses this too
            client.gradient("phase_sum", "auto", np.array([0.1, 0.2, 0.3]))
        assert info.value.field == "x" and "complex x" in info.value.detail
        with pytest.raises(UnsupportedOperatorError) as info:
            client.hessian("abs2_plus_re_im", {"type": "sparse"}, Z)  # jax.hessian refuses
        assert info.value.field == "holomorphic"
    bad = [
        {"__ndarray__": [1.0, 2.0], "dtype": "complex128", "shape": [2]},  # not pairs
        {"__ndarray__": [[1.0, 2.0, 3.0]], "dtype": "complex128", "shape": [1]},
        {"__ndarray__": [["1", "2"]], "dtype": "complex128", "shape": [1]},
        {"__ndarray__": [[1.0, 2.0]], "dtype": "complex256", "shape": [1]},
    ]
    for x in bad:
        r = httpx.post(f"{srv.url}/gradient", json={
            "function": "abs2_plus_re_im", "backend": "auto", "x": x})
        assert 400 <= r.status_code < 500, r.text
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["field"].startswith("x")


# --- Jacobians of complex x: declared holomorphic, or refused as JAX refuses them ----------
def z_conj_z2(z):
    return z * jnp.conj(z) ** 2


@pytest.mark.parametrize("backend", ["jax-forward", "jax-reverse", "auto", "finite-differences"])
def test_a_non_holomorphic_jacobian_is_refused_over_http(srv: ServerProcess, backend: str) -> None:
    """f(z) = z conj(z)^2 once answered its ∂f/∂Re z, whose product with t is not the
    pushforward along t (for t = i at z = 1+2j: 4+7j against 4-13j); jax.jacfwd refuses it."""
    z = {"__ndarray__": [[1.0, 2.0]], "dtype": "complex128", "shape": [1]}
    for operator, function in (("jacobian", "z_conj_z2"), ("value_and_jacobian", "z_conj_z2"),
                               ("hessian", "abs2_plus_re_im"),
                               ("value_gradient_and_hessian", "abs2_plus_re_im")):
        r = httpx.post(f"{srv.url}/{operator}", json={
            "function": function, "backend": backend, "x": z})
        assert r.status_code == 422, r.text
        assert r.headers["content-type"] == "application/problem+json"
        problem = r.json()
        assert problem["field"] == "holomorphic" and '"holomorphic": true' in problem["detail"]
    with Client(srv.url) as client:
        (pushed,) = client.pushforward("z_conj_z2", backend, np.array([1 + 2j]), (np.array([1 + 0j]),))
        want = jax.jvp(z_conj_z2, (np.array([1 + 2j]),), (np.array([1 + 0j]),))[1]
        np.testing.assert_allclose(pushed, want, rtol=1e-7)
        with pytest.raises(UnsupportedOperatorError) as info:
            client.jacobian("z_conj_z2", backend, np.array([1 + 2j]))
        assert info.value.field == "holomorphic"
        declared = client.jacobian("z_conj_z2", backend, np.array([1 + 2j]), holomorphic=True)
    want = jax.jacfwd(z_conj_z2, holomorphic=True)(np.array([1 + 2j]))
    np.testing.assert_allclose(declared, want, rtol=1e-7 if backend == "finite-differences" else 1e-10)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_declared_jacobians_are_pushforward_matrices(srv: ServerProcess, encoding: str) -> None:
    """Every complex Jacobian the server answers is the pushforward's matrix."""
    ts = (np.array([0.3 - 0.7j, 1.1 + 0.4j]), np.array([-1.0 + 0.5j, 0.2 - 0.1j]))
    with Client(srv.url, encoding=encoding) as client:
        for backend in ("jax-forward", "jax-reverse", "auto"):
            y, jac = client.value_and_jacobian("z2_sin", backend, Z, holomorphic=True)
            pushed = client.pushforward("z2_sin", backend, Z, ts)
            np.testing.assert_allclose(jac, jax.jacfwd(z2_sin, holomorphic=True)(Z), rtol=1e-10)
            for t, p in zip(ts, pushed, strict=True):
                np.testing.assert_allclose(np.asarray(jac) @ t, p, rtol=1e-10)
        prep = client.prepare_jacobian("z2_sin", "auto", Z, holomorphic=True)
        np.testing.assert_allclose(client.jacobian("z2_sin", "auto", Z, prep=prep, holomorphic=True),
                                   jax.jacfwd(z2_sin, holomorphic=True)(Z), rtol=1e-10)


def test_holomorphic_field_is_checked(srv: ServerProcess) -> None:
    z = {"__ndarray__": [[1.0, 2.0]], "dtype": "complex128", "shape": [1]}
    for operator, function, value in (("jacobian", "z2_sin", "yes"),
                                      ("gradient", "abs2_plus_re_im", True),
                                      ("jacobian", "abs2_plus_re_im", True)):
        r = httpx.post(f"{srv.url}/{operator}", json={
            "function": function, "x": z, "holomorphic": value})
        assert r.status_code == 422, r.text
        assert r.json()["field"] == "holomorphic"


def test_a_declared_jacobian_as_a_detached_job(srv: ServerProcess) -> None:
    with Client(srv.url) as client:
        job = client.submit.jacobian("z2_sin", "auto", Z, holomorphic=True)
        np.testing.assert_allclose(job.result(timeout=REQUEST_DEADLINE, progress=False),
                                   jax.jacfwd(z2_sin, holomorphic=True)(Z), rtol=1e-10)
        refused = client.submit.jacobian("z_conj_z2", "auto", Z)
        with pytest.raises(UnsupportedOperatorError) as info:
            refused.result(timeout=REQUEST_DEADLINE, progress=False)
        assert info.value.field == "holomorphic"
