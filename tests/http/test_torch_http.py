"""Torch functions served over HTTP by a real server that has torch installed.

The server imports ``tests.torch_scenarios`` (every scenario in torch) and
``tests.torch_models`` (an ``nn.Module`` MLP's loss, sin_cumsum and Rosenbrock in
torch) beside ``dxserve.examples``. Checked: the conformance grid through the client
(every scenario and operator, the torch backends rotating, every backend on one
scenario of each kind) against the references at rtol 1e-10 and against the library in
process; a training loop of the MLP served remotely against the in-process
``torch.func`` loop; a JAX backend named for a torch function (and the reverse) is a
422 naming the backends that fit; progress events, chunks, cancellation and the
compute budget's 422 behave as they do for JAX functions.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dxserve  # noqa: E402
from dxclient import Client  # noqa: E402
from dxcontract.errors import UnsupportedOperatorError  # noqa: E402
from dxcontract.operators import OPERATORS  # noqa: E402
from dxserve import FiniteDifferences, SecondOrder, TorchForward, TorchReverse  # noqa: E402
from tests.conftest import start_server, stop_server  # noqa: E402
from tests.http.test_progress_http import (  # noqa: E402
    SSE,
    cancelled,
    progress_of,
    stream_events,
    wait_for,
    worker_is_free,
)
from tests.references import (  # noqa: E402
    rosenbrock_gradient,
    rosenbrock_hessian,
    sin_cumsum_jacobian,
)

try:  # imported as a top-level module by pytest (tests/ has no __init__.py)
    import scenarios as sc
    import torch_models
    import torch_scenarios as tsc
except ImportError:  # pragma: no cover
    from tests import scenarios as sc
    from tests import torch_models
    from tests import torch_scenarios as tsc

pytestmark = pytest.mark.torch

#: the servers' per-request memory bound: the budget test's Jacobian is over it
LIMIT = 16 * 1024**2
MODULES = ("dxserve.examples", "tests.torch_scenarios", "tests.torch_models")
FWD, REV = TorchForward(), TorchReverse()
FIRST = ["torch-reverse", FWD, TorchReverse(batch_size=2), "auto", FiniteDifferences()]
SECOND = [SecondOrder(FWD, REV), SecondOrder(REV, REV), SecondOrder(REV, FWD),
          SecondOrder(FWD, FWD), SecondOrder(FiniteDifferences(), REV), "torch-forward"]


@pytest.fixture(scope="module")
def torch_server(tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(
        tmp_path_factory.mktemp("dxserve-torch"), modules=MODULES,
        env={"DXSERVE_CHUNK_FROM": "20", "DXSERVE_MAX_REQUEST_MEMORY_BYTES": str(LIMIT)},
    )
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def client(torch_server):
    with Client(torch_server.url) as c:
        yield c


def _is_fd(backend) -> bool:
    b = dxserve.backend_from_json(backend)
    return isinstance(b, FiniteDifferences) or isinstance(getattr(b, "outer", None),
                                                          FiniteDifferences)


def _cases() -> list:
    """Every (scenario, operator) with a backend rotating over the torch ones, and every
    backend with every operator on one scenario of each kind."""
    cases = []
    first_of_kind = {s.kind: s.name for s in reversed(tsc.SCENARIOS)}
    for i, s in enumerate(tsc.SCENARIOS):
        for j, op in enumerate(sc.DERIVATIVE_OPERATORS):
            if not sc.applies(s, op):
                continue
            backends = SECOND if OPERATORS[op].order == 2 else FIRST
            chosen = backends if first_of_kind[s.kind] == s.name else [
                backends[(i + j) % len(backends)]
            ]
            for b in chosen:
                label = b if isinstance(b, str) else json.dumps(b.to_json(), separators=(",", ":"))
                cases.append(pytest.param(s, op, b, id=f"{s.name}-{op}-{label}"))
    return cases


def _call(api, f, s, op, backend):
    t = sc.tangents(s, op)
    args = (s.x,) if t is None else (s.x, t)
    return getattr(api, op)(f, backend, *args, *s.contexts)


def _numpy(tree):
    if isinstance(tree, tuple | list):
        return tuple(_numpy(v) for v in tree)
    if isinstance(tree, dict):
        return {k: _numpy(v) for k, v in tree.items()}
    return np.asarray(tree)


def test_the_torch_functions_are_served(client) -> None:
    names = {f.name for f in client.functions()}
    assert {s.name for s in tsc.SCENARIOS} | {"mlp_loss", "torch_sin_cumsum"} <= names


@pytest.mark.parametrize(("s", "op", "backend"), _cases())
def test_served_matches_references_and_the_library(client, s, op, backend) -> None:
    got = _numpy(_call(client, s.name, s, op, backend))
    want = sc.expected(s, op, sc.tangents(s, op))
    fd = _is_fd(backend) and OPERATORS[op].order > 0
    rtol = 1e-8 if fd else 1e-10
    sc.assert_close(got, want, rtol=rtol, atol=rtol if fd else 1e-12, scaled=fd, path=op)
    # the same computation in process: the same numbers, to rounding
    local = _numpy(_call(dxserve, s.f, s, op, backend))
    sc.assert_close(got, local, rtol=1e-12, atol=1e-14, path=f"{op} (library)")


def test_json_and_b64_encodings_agree(torch_server) -> None:
    s = tsc.BY_NAME["torch_pytree_tanh_regression"]
    answers = []
    for encoding in ("json", "b64", "binary"):
        with Client(torch_server.url, encoding=encoding) as c:
            answers.append(c.value_gradient_and_hessian(s.name, "auto", s.x, *s.contexts))
    for other in answers[1:]:
        sc.assert_close(_numpy(other), _numpy(answers[0]), rtol=0, atol=0)
    sc.assert_close(_numpy(answers[0][2]), s.hessian, rtol=1e-10, atol=1e-12)


# --- frameworks and backends that do not fit ------------------------------------------
@pytest.mark.parametrize(("function", "backend", "fits"), [
    ("torch_rosenbrock", "jax-reverse", "torch-reverse"),
    ("torch_rosenbrock", {"type": "second-order", "outer": "jax-forward",
                          "inner": "torch-reverse"}, "torch-forward"),
    ("rosenbrock", "torch-reverse", "jax-reverse"),
    ("rosenbrock", {"type": "sparse", "dense": "torch-forward"}, "jax-forward"),
    ("torch_sin_cumsum", "sparse", "torch-forward"),
])
def test_a_backend_of_another_framework_is_a_422_naming_those_that_fit(
    torch_server, function, backend, fits
) -> None:
    operator = "hessian" if function.endswith("rosenbrock") else "jacobian"
    r = httpx.post(f"{torch_server.url}/{operator}", json={
        "function": function, "backend": backend, "x": [1.0, 2.0, 3.0]})
    assert r.status_code == 422, r.text
    problem = r.json()
    assert r.headers["content-type"].startswith("application/problem+json")
    assert problem["field"].startswith("backend")
    assert fits in problem["fits"] and "finite-differences" in problem["fits"]
    assert fits in problem["detail"]
    with Client(torch_server.url) as c, pytest.raises(UnsupportedOperatorError):
        getattr(c, operator)(function, backend, np.array([1.0, 2.0, 3.0]))


def test_the_rosenbrocks_agree_across_frameworks(client) -> None:
    x = np.array([0.5, -0.3, 1.2, 0.8])
    jax_h = client.hessian("rosenbrock", "auto", x)
    torch_h = client.hessian("torch_rosenbrock_n", "auto", x)
    np.testing.assert_allclose(torch_h, jax_h, rtol=1e-12)
    np.testing.assert_allclose(torch_h, rosenbrock_hessian(x), rtol=1e-12)


def test_float32_in_float32_out(client) -> None:
    x = np.linspace(0.1, 1.3, 6).astype(np.float32)
    g = client.gradient("torch_rosenbrock_n", "torch-reverse", x)
    assert g.dtype == np.float32
    j = client.jacobian("torch_sin_cumsum", "torch-forward", x)
    assert j.dtype == np.float32
    np.testing.assert_allclose(j, sin_cumsum_jacobian(x.astype(np.float64)), rtol=1e-5)


# --- an nn.Module trained remotely --------------------------------------------------------
def test_an_mlp_trained_remotely_matches_the_torch_func_loop(client) -> None:
    inputs, targets = torch_models.data()
    steps, rate = 25, 0.2

    # in process: torch.func.grad of the same loss, on tensors
    loss = torch_models.mlp_loss
    params = {k: torch.tensor(v) for k, v in torch_models.parameters().items()}
    xs, ys = torch.tensor(inputs), torch.tensor(targets)
    local_losses = []
    for _ in range(steps):
        grads, value = torch.func.grad_and_value(loss)(params, xs, ys)
        local_losses.append(float(value))
        params = {k: params[k] - rate * grads[k] for k in params}

    # served: value_and_gradient over HTTP, the parameters a dict of arrays by name
    remote = torch_models.parameters()
    remote_losses = []
    for _ in range(steps):
        value, grads = client.value_and_gradient("mlp_loss", "torch-reverse", remote,
                                                 inputs, targets)
        assert set(grads) == set(remote) and all(
            grads[k].shape == remote[k].shape and grads[k].dtype == np.float64 for k in remote
        )
        remote_losses.append(float(value))
        remote = {k: remote[k] - rate * grads[k] for k in remote}

    np.testing.assert_allclose(remote_losses, local_losses, rtol=1e-10)
    for k in remote:
        np.testing.assert_allclose(remote[k], params[k].numpy(), rtol=1e-10, atol=1e-12)
    assert remote_losses[-1] < 0.5 * remote_losses[0]  # it learnt something


def test_the_mlp_is_detected_as_torch_and_described(client, torch_server) -> None:
    from dxserve.frameworks import framework_of

    assert framework_of(torch_models.mlp_loss).name == "torch"
    info = httpx.get(f"{torch_server.url}/functions/mlp_loss").json()
    assert [a["name"] for a in info["arguments"]] == ["params", "inputs", "targets"]
    # shapes from its example, the output's from a run on meta tensors
    assert info["shapes_from"] == "example"
    assert (info["output"]["shape"], info["output"]["dtype"]) == ([], "float64")
    assert info["arguments"][1]["shape"] == [32, 3]
    assert "hvp" in info["operators"] and "jacobian" in info["operators"]
    # HVPs of a pytree of parameters: forward over reverse by default
    params = torch_models.parameters()
    inputs, targets = torch_models.data()
    tangent = {k: np.ones_like(v) for k, v in params.items()}
    (served,) = client.hvp("mlp_loss", "auto", params, (tangent,), inputs, targets)
    t_params = {k: torch.tensor(v) for k, v in params.items()}
    t_tangent = {k: torch.tensor(v) for k, v in tangent.items()}
    xs, ys = torch.tensor(inputs), torch.tensor(targets)
    _, want = torch.func.jvp(
        lambda p: torch.func.grad(torch_models.mlp_loss)(p, xs, ys), (t_params,), (t_tangent,)
    )
    for k in params:
        np.testing.assert_allclose(served[k], want[k].numpy(), rtol=1e-10, atol=1e-12)


# --- progress, chunks, cancellation and budgets, as for JAX functions ---------------------
@pytest.mark.parametrize(("operator", "function", "backend", "expected"), [
    ("jacobian", "torch_sin_cumsum", "torch-forward", sin_cumsum_jacobian),
    ("jacobian", "torch_sin_cumsum", "torch-reverse", sin_cumsum_jacobian),
    ("hessian", "torch_rosenbrock_n", "auto", rosenbrock_hessian),
    ("hessian", "torch_rosenbrock_n", {"type": "second-order", "outer": "finite-differences",
                                       "inner": "torch-reverse"}, rosenbrock_hessian),
])
def test_chunked_work_streams_progress_like_jax(
    torch_server, client, operator, function, backend, expected
) -> None:
    x = np.linspace(0.1, 1.3, 200)  # 200 basis vectors, from 20 on: 10 chunks
    body = {"function": function, "backend": backend, "x": x.tolist()}
    events = stream_events(f"{torch_server.url}/{operator}", body)
    steps = progress_of(events)
    dones = [s["done"] for s in steps]
    assert len(set(dones)) >= 10 and dones == sorted(dones) and dones[-1] == 200, steps
    assert events[-1][0] == "result"
    streamed = np.asarray(json.loads(events[-1][1])[operator])
    fd = "finite" in json.dumps(backend)
    np.testing.assert_allclose(streamed, expected(x), rtol=1e-7 if fd else 1e-10,
                               atol=1e-4 if fd else 1e-9)
    seen: list[tuple[int, int]] = []
    plain = getattr(client, operator)(function, backend, x,
                                      progress=lambda d, t: seen.append((d, t)))
    np.testing.assert_array_equal(plain, streamed)
    assert seen[-1] == (200, 200)
    # a JAX function through the same route streams the same way
    jax_events = stream_events(f"{torch_server.url}/{operator}", dict(
        body, function=function.replace("torch_", "").replace("_n", ""),
        backend=json.loads(json.dumps(backend).replace("torch-", "jax-")),
    ))
    assert [e for e, _ in jax_events if e != ":"] == [e for e, _ in events if e != ":"]


def test_over_budget_is_the_same_422_as_for_jax(torch_server) -> None:
    x = np.linspace(0.1, 1.3, 1500)  # a 1500 x 1500 Jacobian: 18 MB, over 16 MiB
    answers = [
        httpx.post(f"{torch_server.url}/jacobian", json={
            "function": name, "backend": backend, "x": x.tolist()})
        for name, backend in (("torch_sin_cumsum", "torch-forward"),
                              ("sin_cumsum", "jax-forward"))
    ]
    for r in answers:
        assert r.status_code == 422, r.text
    torch_problem, jax_problem = (r.json() for r in answers)
    assert torch_problem["type"] == jax_problem["type"]
    assert torch_problem["limit"] == jax_problem["limit"] == "max_request_memory_bytes"
    assert torch_problem["estimate"] > LIMIT


def test_closing_a_stream_cancels_torch_work_and_frees_the_worker(make_server) -> None:
    srv = make_server(modules=MODULES)
    body = {"function": "torch_rosenbrock_n", "backend": "finite-differences",
            "x": np.linspace(0.1, 1.3, 1200).tolist()}
    small = {"function": "torch_rosenbrock_n", "backend": "torch-reverse", "x": [1.0, 2.0, 3.0]}
    assert httpx.post(srv.url + "/gradient", json=small).json() == {
        "gradient": [-400.0, 1002.0, -200.0]}
    with httpx.stream("POST", srv.url + "/hessian", json=body, headers={"accept": SSE},
                      timeout=300) as r:
        for line in r.iter_lines():
            if line == "event: progress":
                break  # running in chunks
    assert wait_for(lambda: cancelled(srv.url) >= 1, 60), srv.output()
    assert worker_is_free(srv.url)


# --- hot signatures: compiled in the background, then served compiled --------------------
def _compiles(url: str, outcome: str) -> float:
    wanted = f'dxserve_background_compiles_total{{framework="torch",outcome="{outcome}"}} '
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(wanted):
            return float(line.split()[-1])
    return 0.0


def test_a_hot_signature_is_compiled_in_the_background_and_answers_the_same(
    make_server,
) -> None:
    # compiled after its first call (no threshold); /metrics says when it is served compiled
    srv = make_server(modules=MODULES, env={"DXSERVE_TORCH_COMPILE": "hot",
                                            "DXSERVE_TORCH_COMPILE_AFTER": "0"})
    x = np.linspace(0.1, 1.3, 9)
    with Client(srv.url) as c:
        eager = c.gradient("torch_rosenbrock", "torch-reverse", x)
        assert wait_for(lambda: _compiles(srv.url, "compiled") >= 1, 600), \
            httpx.get(f"{srv.url}/metrics").text
        assert _compiles(srv.url, "kept_eager") == 0
        for _ in range(3):
            compiled = c.gradient("torch_rosenbrock", "torch-reverse", x)
            np.testing.assert_allclose(compiled, rosenbrock_gradient(x), rtol=1e-10)
            np.testing.assert_allclose(compiled, eager, rtol=1e-12)


# --- the client takes torch tensors as inputs ---------------------------------------------
def test_the_client_takes_torch_tensors(client) -> None:
    x = np.linspace(0.1, 1.3, 6)
    want = rosenbrock_gradient(x)
    tracked = torch.tensor(x, requires_grad=True)  # detached on the way out
    for function in ("rosenbrock", "torch_rosenbrock"):
        got = client.gradient(function, "auto", tracked)
        assert isinstance(got, np.ndarray) and got.dtype == np.float64
        np.testing.assert_allclose(got, want, rtol=1e-10)
    single = client.gradient("torch_rosenbrock", "auto", torch.tensor(x, dtype=torch.float32))
    assert single.dtype == np.float32
    np.testing.assert_allclose(single, want, rtol=1e-4)
    # bfloat16 tensors arrive as bfloat16 (a JAX function: torch functions take float32/64)
    low = client.gradient("rosenbrock", "jax-reverse", torch.tensor(x).to(torch.bfloat16))
    assert low.dtype.name == "bfloat16"
    # nn.Module parameters (torch.nn.Parameter) as a dict of tensors
    params = dict(torch_models.MODEL.named_parameters())  # they require grad
    xs, ys = (torch.tensor(a) for a in torch_models.data())
    served = client.gradient("mlp_loss", "torch-reverse", params, xs, ys)
    want_params = torch.func.grad(torch_models.mlp_loss)(
        {k: v.detach() for k, v in params.items()}, xs, ys)
    for k in params:
        np.testing.assert_allclose(served[k], want_params[k].numpy(), rtol=1e-10, atol=1e-12)


def test_lazy_views_and_scalars_leave_the_client_resolved() -> None:
    """torch marks ``z.conj()`` and ``z.conj().imag`` with a bit instead of computing them;
    numpy cannot read such tensors, so the client resolves them on the way out."""
    from dxcontract.encodings.common import torch_to_numpy

    x = np.linspace(0.1, 1.3, 6)
    z = torch.tensor(x + 2j * x)
    assert z.conj().is_conj() and z.conj().imag.is_neg()
    np.testing.assert_array_equal(torch_to_numpy(z.conj()), x - 2j * x)
    np.testing.assert_array_equal(torch_to_numpy(z.conj().imag), -2 * x)
    scalar = torch_to_numpy(torch.tensor(1.5, dtype=torch.bfloat16))
    assert scalar.shape == () and scalar.dtype.name == "bfloat16" and float(scalar) == 1.5


def test_the_client_sends_a_negated_view_as_its_values(client) -> None:
    x = np.linspace(0.1, 1.3, 6)
    flipped = torch.tensor(-x + 1j * x).conj().imag  # -x, lazily
    got = client.gradient("torch_rosenbrock", "torch-reverse", flipped)
    np.testing.assert_allclose(got, rosenbrock_gradient(-x), rtol=1e-10)
