"""Sparse Jacobians and Hessians (``Sparse``, asdex): equal to dense at rtol 1e-12 for the
eight patterns of ``tests.sparse_functions``, in process and over HTTP in JSON and in
the binary framing (through the client); colours from the prep's report; the wire
object; the ``sparsity`` operator; limits; ``scipy.optimize`` trust-constr with sparse
constraint Jacobians from the service.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import scipy.optimize
import scipy.sparse as sp
from fastapi.testclient import TestClient

import dxserve
from dxclient import Client
from dxclient import sparse as wire
from dxcontract.errors import BudgetExceededError, ResultTooLargeError, ShapeMismatchError
from dxserve import JaxForward, JaxReverse, SecondOrder, Sparse
from dxserve.core.limits import ComputeLimits
from dxserve.core.preparation import prepare
from dxserve.frameworks.jax import sparse as sparse_backend
from dxserve.frameworks.jax.sparse_detection import (
    DetectionBudget,
    InProcessDetector,
    PatternJob,
    colouring_steps,
)
from dxserve.http import create_app
from dxserve.settings import Settings
from tests import sparse_functions as sf

RTOL = 1e-12
NAMES = list(sf.PATTERNS)


def _bcoo_to_scipy(m) -> sp.coo_array:
    """The library's BCOO result as scipy (exact: no float32 detour through todense)."""
    idx = np.asarray(m.indices)
    return sp.coo_array((np.asarray(m.data), (idx[:, 0], idx[:, 1])), shape=m.shape)


def _dense(name: str) -> tuple[np.ndarray, np.ndarray, tuple]:
    family, n, contexts = sf.PATTERNS[name]
    x = sf.example_x(n)
    op = dxserve.jacobian if family == "jacobian" else dxserve.hessian
    ref = np.asarray(op(getattr(sf, name), "auto", x, *contexts)).reshape(-1, n)
    return x, ref, contexts


def _close(actual: np.ndarray, expected: np.ndarray) -> None:
    # rtol 1e-12 entrywise, with an absolute floor at 1e-12 of the matrix's scale for
    # entries that cancel to (near) zero
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=RTOL * np.abs(expected).max())


# --- in process ------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_in_process_sparse_equals_dense(name: str) -> None:
    family, _, _ = sf.PATTERNS[name]
    x, ref, contexts = _dense(name)
    f = getattr(sf, name)
    if family == "jacobian":
        S = dxserve.jacobian(f, Sparse(), x, *contexts)
        v, S2 = dxserve.value_and_jacobian(f, Sparse(JaxReverse()), x, *contexts)
        np.testing.assert_allclose(np.asarray(v), np.asarray(dxserve.value(f, 'auto', x)), rtol=RTOL)
    else:
        S = dxserve.hessian(f, Sparse(), x, *contexts)
        v, g, S2 = dxserve.value_gradient_and_hessian(
            f, Sparse(SecondOrder(JaxReverse(), JaxReverse())), x, *contexts
        )
        g_ref = np.asarray(dxserve.gradient(f, "auto", x, *contexts))
        np.testing.assert_allclose(np.asarray(g), g_ref, rtol=RTOL, atol=1e-15)
    assert type(S).__name__ == "BCOO" and S.shape == ref.shape
    _close(_bcoo_to_scipy(S).toarray(), ref)
    _close(_bcoo_to_scipy(S2).toarray(), ref)
    with dxserve.float64_scope():  # BCOO.todense in float64 (see docs/library.md)
        _close(np.asarray(S.todense()), ref)


def test_detection_finds_the_dense_row_and_colours_by_rows() -> None:
    x = sf.example_x(40)
    prep = dxserve.prepare_jacobian(sf.sp_dense_row, Sparse(), x)
    report = prep.report["sparsity"]
    pattern = _bcoo_to_scipy(dxserve.sparsity(sf.sp_dense_row, "auto", x)).toarray()
    assert pattern[0].all() and report["nnz"] == 40 + 39
    assert report["coloring"] == "row" and report["colors"] == 2  # fewer than 40 columns


def test_colours_from_the_prep_report() -> None:
    x = sf.example_x(200)
    tri = dxserve.prepare_jacobian(sf.sp_tridiagonal, Sparse(JaxForward()), x).report["sparsity"]
    assert tri["colors"] <= 3 and tri["nnz"] == 3 * 200 - 2 and tri["shape"] == [200, 200]
    assert tri["coloring"] == "column" and tri["mode"] == "forward"
    hess = dxserve.prepare_hessian(sf.sp_chain_quartic, Sparse(), x).report["sparsity"]
    assert hess["colors"] <= 3 and hess["coloring"] == "star"
    assert hess["mode"] == "forward-over-reverse" and hess["source"] == "detected"


def test_given_pattern_and_its_shape_check() -> None:
    n = 30
    x = sf.example_x(n)
    band = np.abs(np.subtract.outer(np.arange(n), np.arange(n))) <= 1
    S = dxserve.jacobian(sf.sp_tridiagonal, Sparse(sparsity=band), x)
    _close(_bcoo_to_scipy(S).toarray(), _dense("sp_tridiagonal")[1][:n, :n] if n == 40 else
           np.asarray(dxserve.jacobian(sf.sp_tridiagonal, "auto", x)))
    prep = dxserve.prepare_jacobian(sf.sp_tridiagonal, Sparse(sparsity=band), x)
    assert prep.report["sparsity"]["source"] == "given"
    with pytest.raises(ShapeMismatchError):
        dxserve.jacobian(sf.sp_tridiagonal, Sparse(sparsity=np.eye(3)), x)


def test_other_operators_fall_through_to_the_dense_backend() -> None:
    x = sf.example_x(10)
    g = dxserve.gradient(sf.sp_chain_quartic, Sparse(JaxReverse()), x)
    np.testing.assert_allclose(g, dxserve.gradient(sf.sp_chain_quartic, "jax-reverse", x))
    assert dxserve.resolve(Sparse(JaxForward()), "pushforward", sf.sp_tridiagonal, x) == JaxForward()


def test_result_limit_counts_nonzeros() -> None:
    n = 20_000  # dense: 4e8 numbers, far over the limit; sparse: 6e4
    x = sf.example_x(n)
    with pytest.raises(ResultTooLargeError):
        prepare("jacobian", sf.sp_tridiagonal, "jax-forward", x, None, (), None, 10**6)
    prep = prepare("jacobian", sf.sp_tridiagonal, Sparse(), x, None, (), None, 10**6)
    assert prep.report["sparsity"]["nnz"] == 3 * n - 2
    with pytest.raises(ResultTooLargeError):
        prepare("jacobian", sf.sp_tridiagonal, Sparse(), x, None, (), None, 3 * n)


def test_library_budget_refuses_before_colouring() -> None:
    """The library's detector runs in this thread and takes a budget: a pattern over
    max_nnz is refused before it is coloured, and a colouring that cannot finish in time
    (counted from the pattern) before it starts."""
    x = sf.example_x(300)
    f = sf.sp_tridiagonal
    detector = InProcessDetector(DetectionBudget(max_nnz=100))
    limits = ComputeLimits(sparsity=detector)
    with pytest.raises(BudgetExceededError) as refused:
        prepare("jacobian", f, Sparse(), x, None, (), limits=limits)
    assert refused.value.field == "backend" and refused.value.extra["limit"] == "max_nnz"
    assert refused.value.extra["estimate"] == 3 * 300 - 2
    band = np.abs(np.subtract.outer(np.arange(300), np.arange(300))) <= 1
    with pytest.raises(BudgetExceededError, match="DXSERVE_MAX_NNZ"):  # a given one too
        prepare("jacobian", f, Sparse(sparsity=band), x, None, (), limits=limits)
    dense = InProcessDetector(DetectionBudget(seconds=1e-9))
    with pytest.raises(BudgetExceededError) as slow:
        prepare("jacobian", f, Sparse(), x, None, (), limits=ComputeLimits(sparsity=dense))
    assert slow.value.extra["limit"] == "sparse_detection_seconds"
    assert slow.value.extra["estimate"] > 0
    # the pattern alone needs no colouring: not refused by the colouring's time
    prep = prepare("sparsity", f, Sparse(), x, None, (), limits=ComputeLimits(sparsity=dense))
    assert prep.report["sparsity"]["nnz"] == 3 * 300 - 2


def test_library_refuses_a_seed_matrix_over_budget() -> None:
    x = sf.example_x(50)
    # the arrow-head needs 50 colours by columns: a (50, 50) float64 seed matrix
    detector = InProcessDetector(DetectionBudget(max_seed_bytes=8 * 50 * 49))
    with pytest.raises(BudgetExceededError) as refused:
        prepare("jacobian", sf.sp_arrowhead, Sparse(JaxForward()), x, None, (),
                limits=ComputeLimits(sparsity=detector))
    assert refused.value.extra["limit"] == "max_request_memory_bytes"


def test_colouring_steps_count_pairs_sharing_a_row() -> None:
    rows, cols = np.array([0, 0, 0, 1]), np.array([0, 1, 2, 2])
    job = PatternJob("jacobian", (2, 3), "column")
    assert colouring_steps(rows, cols, (2, 3), job) == 2 * (3 * 3 + 1 * 1)
    by_rows = PatternJob("jacobian", (2, 3), "row")
    assert colouring_steps(rows, cols, (2, 3), by_rows) == 2 * (1 + 1 + 2 * 2)


def test_engine_holds_its_wire_form_and_counts_its_bytes() -> None:
    x = sf.example_x(100)
    prep = dxserve.prepare_jacobian(sf.sp_tridiagonal, Sparse(), x)
    engine = prep.compiler
    assert engine.held_bytes() >= 2 * 4 * (3 * 100 - 2)  # its int32 rows and columns, at least
    assert prep.nbytes() >= engine.held_bytes()  # what a prep cache counts
    J = dxserve.jacobian(sf.sp_tridiagonal, Sparse(), x, prep=prep)
    obj = sparse_backend.sparse_wire(J)
    assert obj["indices"] is engine.wire["indices"]  # made once, not per call
    np.testing.assert_array_equal(obj["data"], np.asarray(J.data))


# --- over HTTP -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    store = tmp_path_factory.mktemp("sparse-store")
    settings = Settings(
        store=store, compilation_cache="", functions=["tests.sparse_functions"], warm_up=False
    )
    with TestClient(create_app(settings)) as client:
        yield client


def _client(http: TestClient, encoding: str) -> Client:
    return Client(
        http=httpx.Client(transport=http._transport, base_url="http://testserver"),
        encoding=encoding,
    )


@pytest.mark.parametrize("encoding", ["json", "binary"])
@pytest.mark.parametrize("name", NAMES)
def test_over_http_sparse_equals_dense(http: TestClient, name: str, encoding: str) -> None:
    client = _client(http, encoding)
    family, _, _ = sf.PATTERNS[name]
    x, ref, contexts = _dense(name)
    if family == "jacobian":
        S = client.jacobian(name, Sparse(), x, *contexts)
        _, S2 = client.value_and_jacobian(name, Sparse(JaxReverse(), format="coo"), x, *contexts)
        assert isinstance(S2, sp.coo_array)
    else:
        S = client.hessian(name, Sparse(), x, *contexts)
        _, _, S2 = client.value_gradient_and_hessian(name, Sparse(coloring="column"), x, *contexts)
    assert isinstance(S, sp.csr_array) and S.shape == ref.shape
    _close(S.toarray(), ref)
    _close(S2.toarray(), ref)


def test_wire_object_in_json(http: TestClient) -> None:
    x = sf.example_x(10)
    r = http.post("/jacobian", json={"function": "sp_tridiagonal", "backend": "sparse",
                                     "x": x.tolist()})
    assert r.status_code == 200, r.text
    obj = r.json()["jacobian"]
    assert obj["format"] == "csr" and obj["shape"] == [10, 10]
    assert obj["indptr"]["dtype"] == "int32" and obj["indices"]["dtype"] == "int32"
    assert obj["indptr"]["__ndarray__"][:4] == [0, 2, 5, 8] and len(obj["data"]) == 28
    M = sp.csr_array((obj["data"], obj["indices"]["__ndarray__"], obj["indptr"]["__ndarray__"]),
                     shape=(10, 10))
    _close(M.toarray(), np.asarray(dxserve.jacobian(sf.sp_tridiagonal, "auto", x)))
    coo = http.post("/jacobian", json={"function": "sp_tridiagonal", "x": x.tolist(),
                                       "backend": {"type": "sparse", "format": "coo"}}).json()
    assert coo["jacobian"]["format"] == "coo" and coo["jacobian"]["indices"]["shape"] == [28, 2]


def test_prepare_reports_the_pattern(http: TestClient) -> None:
    client = _client(http, "binary")
    x = sf.example_x(100)
    prep = client.prepare_jacobian("sp_tridiagonal", Sparse(JaxForward()), x)
    assert prep.sparsity is not None and prep.sparsity["colors"] <= 3
    assert prep.sparsity["nnz"] == 298 and prep.sparsity["shape"] == [100, 100]
    S = client.jacobian("sp_tridiagonal", Sparse(JaxForward()), x, prep=prep)
    assert S.nnz == 298
    hprep = client.prepare_hessian("sp_chain_quartic", Sparse(), x)
    assert hprep.sparsity["colors"] <= 3 and hprep.sparsity["coloring"] == "star"
    r = http.post("/prepare/hessian", json={"function": "sp_chain_quartic", "backend": "sparse",
                                            "x": x.tolist()})
    assert r.json()["sparsity"]["mode"] == "forward-over-reverse"


def test_sparsity_operator_over_http(http: TestClient) -> None:
    x = sf.example_x(16)
    for encoding in ("json", "binary"):
        P = _client(http, encoding).sparsity("sp_laplacian_2d", "auto", x)
        assert P.dtype == bool and P.nnz == 16 * 5 - 4 * 4  # 5-point stencil, 4x4 grid
    r = http.post("/sparsity", json={"function": "sp_chain_quartic", "x": x.tolist()})
    assert r.status_code == 200 and "data" not in r.json()["sparsity"]


def test_client_container_without_scipy() -> None:
    rows, cols = np.array([0, 0, 1]), np.array([0, 2, 1])
    obj = wire.wire_object("csr", (2, 3), rows, cols, np.array([1.0, 2.0, 3.0]))
    m = wire.from_wire(obj, "jacobian", use_scipy=False)
    assert isinstance(m, wire.SparseMatrix) and m.nnz == 3
    np.testing.assert_array_equal(m.toarray(), [[1.0, 0.0, 2.0], [0.0, 3.0, 0.0]])
    coo = wire.from_wire(wire.wire_object("coo", (2, 3), rows, cols), "p", use_scipy=False)
    np.testing.assert_array_equal(coo.toarray(), [[True, False, True], [False, True, False]])


def test_errors_over_http(http: TestClient) -> None:
    x = sf.example_x(10).tolist()
    bad = http.post("/jacobian", json={"function": "sp_tridiagonal", "x": x,
                                       "backend": {"type": "sparse", "coloring": "diagonal"}})
    assert bad.status_code == 422 and bad.json()["field"] == "backend.coloring"
    wrong = http.post("/jacobian", json={"function": "sp_tridiagonal", "x": x, "backend": {
        "type": "sparse", "sparsity": {"format": "coo", "shape": [3, 3], "indices": [[0, 0]]}}})
    assert wrong.status_code == 422 and wrong.json()["field"] == "backend.sparsity"
    listed = {b["type"]: b for b in http.get("/backends").json()["backends"]}
    assert "hessian" in listed["sparse"]["operators"]


# --- a real consumer: scipy's trust-constr ---------------------------------------------
def test_trust_constr_with_sparse_constraint_jacobians(http: TestClient) -> None:
    client = _client(http, "binary")
    n = 30
    x0 = np.full(n, 0.3)

    def solve(backend: object) -> scipy.optimize.OptimizeResult:
        jacobians: list[object] = []

        def jac(x: np.ndarray) -> object:
            J = client.jacobian("chain_constraints", backend, x)
            jacobians.append(J)
            return J

        constraint = scipy.optimize.NonlinearConstraint(
            lambda x: client.value("chain_constraints", "auto", x), 0.0, 0.0, jac=jac
        )
        res = scipy.optimize.minimize(
            lambda x: client.value("chain_objective", "auto", x), x0, method="trust-constr",
            jac=lambda x: client.gradient("chain_objective", "jax-reverse", x),
            hess=lambda x: client.hessian("chain_objective", backend, x),
            constraints=[constraint], options={"gtol": 1e-10, "xtol": 1e-12, "maxiter": 500},
        )
        res.jacobians = jacobians
        return res

    sparse_res = solve(Sparse())
    dense_res = solve("auto")
    assert sparse_res.success and dense_res.success
    assert all(isinstance(J, sp.csr_array) for J in sparse_res.jacobians)
    assert all(isinstance(J, np.ndarray) for J in dense_res.jacobians)
    np.testing.assert_allclose(sparse_res.x, dense_res.x, rtol=1e-7, atol=1e-9)
    assert abs(sparse_res.fun - dense_res.fun) <= 1e-9 * max(1.0, abs(dense_res.fun))
    assert np.abs(client.value("chain_constraints", "auto", sparse_res.x)).max() < 1e-8
