"""Sparse backends inside the server's budgets, over real sockets to a real server.

Detection and colouring run in a bounded child process (``dxserve.server.sandboxes.sparsity``):
a request whose pattern would take gigabytes (softmax at n = 8000: 64 million
nonzeros) is a 422 while the server's own peak RSS stays put; ``/health`` answers
while a pattern is found and coloured; a child that crashes, runs out of memory or
time, or cannot rebuild the function is a 422 naming ``backend``; malformed patterns
are 4xx naming their field, in process and over HTTP; normal sparse Jacobians and
Hessians (server-side and stored functions) are still exact.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

import dxserve
from dxcontract.errors import InvalidBackendError
from dxserve import Sparse, SparsePattern
from tests import sparse_functions as sf
from tests.conftest import LIVENESS_TIMEOUT, ServerProcess, memory_of, start_server, stop_server

PROBLEM = "application/problem+json"
#: the server's peak RSS may grow by at most this much while it refuses the attack
RSS_HEADROOM = 1536 << 20
ENV = {
    "DXSERVE_SPARSE_DETECTION_SECONDS": "10",
    "DXSERVE_SPARSE_DETECTION_MEMORY_BYTES": str(768 << 20),
    "DXSERVE_MAX_NNZ": str(2**24),
}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(
        tmp_path_factory.mktemp("sparse-bounds"), env=ENV,
        modules=("dxserve.examples", "tests.sparse_functions", "tests.sparse_hostile"),
    )
    try:
        yield server
    finally:
        stop_server(server)


def _post(srv: ServerProcess, path: str, body: dict, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=timeout)




def _refused(r: httpx.Response, *types: str) -> dict:
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith(PROBLEM)
    problem = r.json()
    assert problem["type"].rsplit(":", 1)[-1] in types, problem
    assert problem["field"] == "backend", problem
    return problem


def _alive(srv: ServerProcess) -> None:
    assert srv.proc.poll() is None, srv.output()
    assert httpx.get(srv.url + "/health").status_code == 200


def _dense_jacobian(f, x: np.ndarray) -> np.ndarray:
    return np.asarray(dxserve.jacobian(f, "jax-forward", x)).reshape(-1, x.size)


def _csr(obj: dict) -> np.ndarray:
    import scipy.sparse as sp

    m, n = obj["shape"]
    return sp.csr_array(
        (obj["data"], obj["indices"]["__ndarray__"], obj["indptr"]["__ndarray__"]),
        shape=(m, n),
    ).toarray()


# --- normal work still exact (through the child) ---------------------------------------------
def test_sparse_jacobian_and_hessian_are_exact(srv: ServerProcess) -> None:
    x = sf.example_x(500)
    r = _post(srv, "/jacobian", {"function": "sp_tridiagonal", "backend": "sparse",
                                 "x": x.tolist()})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(_csr(r.json()["jacobian"]), _dense_jacobian(sf.sp_tridiagonal, x),
                               rtol=1e-12, atol=1e-12)
    h = _post(srv, "/hessian", {"function": "sp_chain_quartic", "backend": "sparse",
                                "x": x[:60].tolist()})
    assert h.status_code == 200, h.text
    ref = np.asarray(dxserve.hessian(sf.sp_chain_quartic, "auto", x[:60]))
    np.testing.assert_allclose(_csr(h.json()["hessian"]), ref, rtol=1e-12, atol=1e-12)
    prep = _post(srv, "/prepare/jacobian", {"function": "softmax", "backend": "sparse",
                                            "x": [0.5] * 20})
    assert prep.json()["sparsity"]["nnz"] == 400  # softmax is dense: every entry


def test_a_stored_expression_is_rebuilt_in_the_child(srv: ServerProcess) -> None:
    body = {"name": "bounds_sin_prod", "expression": "jnp.sin(x) * jnp.cumsum(x)", "args": ["x"]}
    assert httpx.post(srv.url + "/functions", json=body).status_code in (200, 201)
    x = sf.example_x(30)
    r = _post(srv, "/jacobian", {"function": "bounds_sin_prod", "backend": "sparse",
                                 "x": x.tolist()})
    assert r.status_code == 200, r.text
    J = _csr(r.json()["jacobian"])
    ref = _dense_jacobian(_sin_cumsum, x)
    np.testing.assert_allclose(J, ref, rtol=1e-12, atol=1e-12)
    assert np.count_nonzero(np.triu(J, 1)) == 0  # cumsum: lower triangular


def _sin_cumsum(v):
    return jnp.sin(v) * jnp.cumsum(v)


def test_an_export_is_rebuilt_in_the_child_and_its_refusal_says_what_to_do(
    srv: ServerProcess,
) -> None:
    import base64

    from dxclient.export import export_function

    bundle = export_function(lambda v: 2.0 * jnp.sin(v), np.zeros(6))
    body = {"name": "bounds_export", "export": base64.b64encode(bundle).decode()}
    assert httpx.post(srv.url + "/functions", json=body).status_code in (200, 201)
    x = np.linspace(0.1, 0.6, 6)
    # the child loads the export, and asdex has no rule for its call: a 422, not a 500
    r = _post(srv, "/jacobian", {"function": "bounds_export", "backend": "sparse",
                                 "x": x.tolist()})
    problem = _refused(r, "sparsity-detection")
    assert "asdex cannot detect" in problem["detail"] and "sparsity=" in problem["detail"]
    # the advice works: with the pattern given, only the colouring runs in the child
    eye = {"format": "coo", "shape": [6, 6], "indices": [[i, i] for i in range(6)]}
    ok = _post(srv, "/jacobian", {"function": "bounds_export", "x": x.tolist(),
                                  "backend": {"type": "sparse", "sparsity": eye}})
    assert ok.status_code == 200, ok.text
    np.testing.assert_allclose(_csr(ok.json()["jacobian"]), np.diag(2.0 * np.cos(x)),
                               rtol=1e-6)


# --- one small request must not take the server's memory --------------------------------------
@pytest.mark.parametrize("path", ["/sparsity", "/jacobian"])
def test_softmax_8000_is_refused_and_the_server_stays_small(
    srv: ServerProcess, path: str
) -> None:
    _post(srv, path, {"function": "softmax", "backend": "sparse", "x": [0.5] * 10})  # warm
    before = memory_of(srv.proc.pid)
    r = _post(srv, path, {"function": "softmax", "backend": "sparse", "x": [0.5] * 8000})
    after = memory_of(srv.proc.pid)
    problem = _refused(r, "sparsity-detection", "budget-exceeded")
    assert "memory" in problem["detail"] or "DXSERVE_MAX_NNZ" in problem["detail"], problem
    assert "sparsity=" in problem["detail"] or "dense backend" in problem["detail"]
    grown = after["VmHWM"] - before["VmHWM"]
    assert grown < RSS_HEADROOM, (
        f"server peak RSS grew by {grown >> 20} MiB (from {before['VmHWM'] >> 20} MiB)"
    )
    _alive(srv)


# --- the server keeps answering while a pattern is found and coloured ---------------------------
class HealthPoller(threading.Thread):
    """GET /health every 50 ms (``LIVENESS_TIMEOUT`` each) until stopped; records each outcome."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop = url, threading.Event()
        self.answered: list[int] = []
        self.failed: list[str] = []

    def run(self) -> None:
        with httpx.Client(timeout=LIVENESS_TIMEOUT) as client:
            while not self.stop.is_set():
                try:
                    self.answered.append(client.get(self.url + "/health").status_code)
                except httpx.HTTPError as e:
                    self.failed.append(repr(e))
                time.sleep(0.05)


@pytest.mark.slow
def test_health_answers_while_patterns_are_found_and_coloured(srv: ServerProcess) -> None:
    poller = HealthPoller(srv.url)
    poller.start()
    try:
        # detection-heavy: 9 million nonzeros, over the child's memory or the nnz budget
        heavy = _post(srv, "/jacobian", {"function": "softmax", "backend": "sparse",
                                         "x": [0.5] * 3000})
        polled = len(poller.answered)
        # colouring-heavy: detected in ~2 s, then numba colours 1500 dense columns, often for
        # longer than the 10 s allowed (the child is stopped mid-colouring), sometimes not
        # (then the answer is exact); a child that overruns is pinned by sp_spin below
        colouring = _post(srv, "/jacobian", {
            "function": "softmax", "backend": {"type": "sparse", "coloring": "column"},
            "x": [0.5] * 1500})
    finally:
        poller.stop.set()
        poller.join(timeout=5)
    assert not poller.failed, f"/health went unanswered {len(poller.failed)} times"
    assert polled >= 3 and len(poller.answered) >= polled + 3
    assert set(poller.answered) == {200}
    assert heavy.status_code != 500 and colouring.status_code != 500
    _refused(heavy, "sparsity-detection", "budget-exceeded")
    if colouring.status_code == 200:
        n = 1500  # softmax at equal inputs: s(1 - s) on the diagonal, -s**2 off it, s = 1/n
        expected = np.full((n, n), -1 / n**2) + np.eye(n) / n
        np.testing.assert_allclose(_csr(colouring.json()["jacobian"]), expected, rtol=1e-8)
    else:
        problem = _refused(colouring, "sparsity-detection", "budget-exceeded")
        assert "10 s" in problem["detail"], problem  # stopped mid-colouring, at the deadline
    _alive(srv)


# --- every way the child can fail is a 422 naming backend --------------------------------------
@pytest.mark.parametrize(("function", "says"), [
    ("sp_abort", "crashed"),
    ("sp_hog", "memory"),
    pytest.param("sp_spin", "longer than 10 s", marks=pytest.mark.slow),
    ("sp_closure", "cannot be rebuilt"),
])
def test_a_failing_detection_child_is_a_422(srv: ServerProcess, function: str, says: str) -> None:
    for path in ("/jacobian", "/sparsity"):
        r = _post(srv, path, {"function": function, "backend": "sparse", "x": [0.5] * 8})
        problem = _refused(r, "sparsity-detection")
        assert says in problem["detail"], problem
        assert "sparsity=" in problem["detail"], problem
        if function in ("sp_spin", "sp_hog"):
            break  # slow: once is enough
    # the detector is still there for the next request
    ok = _post(srv, "/jacobian", {"function": "sp_tridiagonal", "backend": "sparse",
                                  "x": [0.5] * 8})
    assert ok.status_code == 200, ok.text
    _alive(srv)


def test_the_nonzero_budget_refuses_given_and_detected_patterns(make_server) -> None:
    small = make_server(env={"DXSERVE_MAX_NNZ": "1000"},
                        modules=("dxserve.examples", "tests.sparse_functions"))
    n = 1000  # tridiagonal: 2998 nonzeros, over 1000
    band = {"format": "csr", "shape": [n, n],
            "indptr": [0, *range(2, 3 * n - 2, 3), 3 * n - 2],
            "indices": [c for i in range(n) for c in range(max(0, i - 1), min(n, i + 2))]}
    for backend in ({"type": "sparse", "sparsity": band}, "sparse"):  # given, then detected
        r = _post(small, "/jacobian", {"function": "sp_tridiagonal", "backend": backend,
                                       "x": sf.example_x(n).tolist()})
        problem = _refused(r, "budget-exceeded")
        assert problem["limit"] == "max_nnz" and problem["estimate"] == 3 * n - 2, problem
        assert "DXSERVE_MAX_NNZ" in problem["detail"]
    ok = _post(small, "/jacobian", {"function": "sp_tridiagonal", "backend": "sparse",
                                    "x": sf.example_x(300).tolist()})
    assert ok.status_code == 200, ok.text


# --- malformed patterns: 4xx naming the field ------------------------------------------------
MALFORMED = [
    ({"format": "coo", "shape": [8, 8], "indices": [[1e300, 0]]}, "backend.sparsity.indices"),
    ({"format": "coo", "shape": [8, 8], "indices": [[0.5, 0]]}, "backend.sparsity.indices"),
    ({"format": "coo", "shape": [8, 8], "indices": [[-1, 0]]}, "backend.sparsity.indices"),
    ({"format": "coo", "shape": [8, 8], "indices": [["NaN", 0]]}, "backend.sparsity.indices"),
    ({"format": "coo", "shape": [8, 8], "indices": [[2**70, 0]]}, "backend.sparsity.indices"),
    ({"format": "coo", "shape": [8, 8], "indices": [[0, 8]]}, "backend.sparsity.indices"),
    ({"format": "csr", "shape": [8, 8], "indptr": [0] * 8 + [2**70], "indices": [0]},
     "backend.sparsity.indptr"),
    ({"format": "csr", "shape": [8, 8], "indptr": [0] * 8 + [1.5], "indices": [0]},
     "backend.sparsity.indptr"),
    ({"format": "csr", "shape": [8, 8], "indptr": [0, 2, 1, 1, 1, 1, 1, 1, 1], "indices": [0]},
     "backend.sparsity.indptr"),
    ({"format": "csr", "shape": [8, 8], "indptr": [0] * 8 + [1], "indices": [1e300]},
     "backend.sparsity.indices"),
    ({"format": "coo", "shape": [8.5, 8], "indices": [[0, 0]]}, "backend.sparsity.shape"),
    ({"format": "coo", "shape": [2**62, 2**62], "indices": [[0, 0]]}, "backend.sparsity.shape"),
    ({"format": "coo", "shape": [-8, 8], "indices": []}, "backend.sparsity.shape"),
]


@pytest.mark.parametrize(("pattern", "field"), MALFORMED)
def test_a_malformed_pattern_is_a_4xx_naming_its_field(
    srv: ServerProcess, pattern: dict, field: str
) -> None:
    with pytest.raises(InvalidBackendError) as caught:  # in process
        dxserve.jacobian(sf.sp_tridiagonal, Sparse(sparsity=pattern), np.full(8, 0.5))
    assert caught.value.field == field
    r = _post(srv, "/jacobian", {"function": "sp_tridiagonal", "x": [0.5] * 8,
                                 "backend": {"type": "sparse", "sparsity": pattern}})
    assert 400 <= r.status_code < 500, r.text
    assert r.headers["content-type"].startswith(PROBLEM)
    assert r.json()["field"] == field, r.json()


def test_a_nan_token_in_a_pattern_is_a_4xx(srv: ServerProcess) -> None:
    body = ('{"function": "sp_tridiagonal", "x": [0.5, 0.5], "backend": {"type": "sparse", '
            '"sparsity": {"format": "coo", "shape": [2, 2], "indices": [[NaN, 0]]}}}')
    r = httpx.post(srv.url + "/jacobian", content=body,
                   headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    assert r.headers["content-type"].startswith(PROBLEM) and r.json().get("field")
    _alive(srv)


def test_in_process_patterns_take_whole_numbers_only() -> None:
    with pytest.raises(InvalidBackendError) as frac:
        SparsePattern([0, 1.5], [0, 1], (2, 2))
    assert frac.value.field == "backend.sparsity.rows"
    with pytest.raises(InvalidBackendError) as nan:
        SparsePattern([0, 1], [0, float("nan")], (2, 2))
    assert nan.value.field == "backend.sparsity.cols"
    whole = SparsePattern([0.0, 1.0], [1, 0], (2, 2))  # whole floats are indices
    assert whole.rows.tolist() == [0, 1] and whole.cols.tolist() == [1, 0]


# --- what comes back from the child is checked before it is used -------------------------------
def test_an_inconsistent_answer_from_the_child_is_refused() -> None:
    from dxcontract.errors import SparsityDetectionError
    from dxserve.frameworks.jax.sparse_detection import (
        DetectionBudget,
        InProcessDetector,
        PatternJob,
        analyse_here,
        decode,
        encode,
    )

    job = PatternJob("jacobian", (8, 8), "column")
    x = np.full(8, 0.5)
    pattern, colouring = analyse_here(job, sf.sp_tridiagonal, x, (), DetectionBudget())
    header, payload = encode(pattern, colouring)
    good, coloured = decode(header, payload, job, DetectionBudget())  # the honest answer
    reference = InProcessDetector().analyse(job, sf.sp_tridiagonal, x, ())
    assert good.nnz == reference.pattern.nnz == 22
    assert coloured.num_colors == reference.coloring.num_colors

    def tampered(name: str, value: int, at: int = 0) -> tuple[dict, bytes]:
        arrays = {n: np.frombuffer(payload, "<i4", size, 4 * sum(
            s for _, s in header["arrays"][:i])).copy()
            for i, (n, size) in enumerate(header["arrays"])}
        arrays[name][at] = value
        return header, b"".join(a.astype("<i4").tobytes() for a in arrays.values())

    bad = [
        tampered("rows", 8),  # outside the shape
        tampered("cols", -1),
        tampered("rows", 5, at=3),  # no longer sorted row-major
        tampered("colors", 99),  # a colour that does not exist
        (header, payload[:-4]),  # truncated
        (header, payload + b"\0\0\0\0"),  # bytes left over
        ({**header, "arrays": [["rows", -1]]}, payload),
        ({**header, "mode": "sideways"}, payload),
        ({**header, "num_colors": 10**9}, payload),
    ]
    for h, p in bad:
        with pytest.raises(SparsityDetectionError, match="inconsistent"):
            decode(h, p, job, DetectionBudget())


def test_a_refusal_from_the_child_keeps_only_known_fields() -> None:
    from dxcontract.errors import BudgetExceededError
    from dxserve.server.sandboxes.sparsity import _refusal

    err = _refusal({"type": "budget-exceeded", "detail": "over",
                    "extra": {"limit": "max_nnz", "estimate": 5, "field": "x", "status": 200}})
    assert isinstance(err, BudgetExceededError) and err.field == "backend"
    assert err.extra == {"limit": "max_nnz", "estimate": 5}
