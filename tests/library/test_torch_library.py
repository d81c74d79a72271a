"""PyTorch functions in process: what the torch conformance grid does not sweep.

Framework detection, ``nn.Module`` parameters as a pytree x (results a dict of tensors
by parameter name, as ``torch.func.grad``'s), dtypes in and out, one tangent, batches
of points, chunked runs with progress, budgets, and the refusals: a backend of the
other framework, a function that returns no tensor, tensors inside ``torch.func``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402

import dxserve  # noqa: E402
from dxcontract.errors import (  # noqa: E402
    BudgetExceededError,
    DtypeMismatchError,
    FunctionEvaluationError,
    InvalidArgumentError,
    UnsupportedOperatorError,
)
from dxserve import SecondOrder, TorchForward, TorchReverse  # noqa: E402
from dxserve.core.limits import ComputeLimits  # noqa: E402
from dxserve.frameworks import framework_of  # noqa: E402
from tests.recording_job import Recording  # noqa: E402
from tests.references import rosenbrock_gradient, rosenbrock_hessian, sin_cumsum_jacobian  # noqa: E402

pytestmark = pytest.mark.torch


def rosenbrock(x):
    return torch.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)


def sin_cumsum(x):
    return torch.sin(x) * torch.cumsum(x, 0)




# --- which framework ----------------------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(2, 3, dtype=torch.float64)

    def forward(self, x):
        return self.a(x)


NET = Net()


def _uses_net(x):
    return NET(x).sum()


def test_functions_that_refer_to_torch_are_torch_functions() -> None:
    assert framework_of(rosenbrock).name == "torch"
    assert framework_of(lambda x: torch.sin(x).sum()).name == "torch"
    assert framework_of(_uses_net).name == "torch"  # an nn.Module subclass of the caller's
    assert framework_of(lambda x: rosenbrock(x) * 2).name == "torch"  # through a helper
    assert framework_of(lambda x: jnp.sum(x)).name == "jax"
    assert framework_of(lambda x: jnp.sum(x) + torch.zeros(())).name == "jax"  # both: JAX's
    assert framework_of(lambda x: (x**2).sum()).name == "jax"  # plain Python: JAX's
    marked = dxserve.function(framework="torch")(lambda x: (x**2).sum())
    assert framework_of(marked).name == "torch"


# --- values, dtypes, tangents -------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch-reverse", "torch-forward", "auto",
                                     "finite-differences"])
def test_float32_in_float32_out(backend: str) -> None:
    x = np.linspace(0.1, 1.3, 6)
    # float32: eps ~1.2e-7; finite differences' step ~5e-3, their error relative to max|g|
    rtol = 1e-3 if backend == "finite-differences" else 1e-5
    for given in (x.astype(np.float32), torch.tensor(x, dtype=torch.float32)):
        g = dxserve.gradient(rosenbrock, backend, given)
        assert isinstance(g, torch.Tensor) and g.dtype == torch.float32
        want = rosenbrock_gradient(x)
        np.testing.assert_allclose(g.numpy(), want, rtol=rtol, atol=rtol * np.abs(want).max())
        j = dxserve.jacobian(sin_cumsum, backend, given)
        assert j.dtype == torch.float32
        np.testing.assert_allclose(j.numpy(), sin_cumsum_jacobian(x), rtol=rtol, atol=rtol)
    h = dxserve.hessian(rosenbrock, "auto", x.astype(np.float32))
    assert h.dtype == torch.float32
    np.testing.assert_allclose(h.numpy(), rosenbrock_hessian(x), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("backend", ["torch-forward", "torch-reverse",
                                     SecondOrder(TorchReverse(), TorchReverse())])
def test_one_tangent(backend) -> None:
    x = np.linspace(0.2, 1.1, 5)
    t = np.linspace(-1.0, 1.0, 5)
    (hv,) = dxserve.hvp(rosenbrock, backend, x, (t,))
    np.testing.assert_allclose(hv.numpy(), rosenbrock_hessian(x) @ t, rtol=1e-12)
    if isinstance(backend, str):
        (jt,) = dxserve.pushforward(sin_cumsum, backend, x, (t,))
        np.testing.assert_allclose(jt.numpy(), sin_cumsum_jacobian(x) @ t, rtol=1e-12)
        (ct,) = dxserve.pullback(sin_cumsum, backend, x, (t,))
        np.testing.assert_allclose(ct.numpy(), t @ sin_cumsum_jacobian(x), rtol=1e-12)


def test_batches_of_points() -> None:
    xs = np.linspace(0.1, 1.3, 15).reshape(3, 5)
    g = dxserve.gradient(rosenbrock, "torch-reverse", xs, batch_axis=0)
    np.testing.assert_allclose(g.numpy(), np.stack([rosenbrock_gradient(x) for x in xs]),
                               rtol=1e-12)
    h = dxserve.hessian(rosenbrock, "auto", xs, batch_axis=0)
    np.testing.assert_allclose(h.numpy(), np.stack([rosenbrock_hessian(x) for x in xs]),
                               rtol=1e-12)


# --- nn.Module parameters as x ------------------------------------------------------
def test_module_parameters_are_the_pytree_x() -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 5, dtype=torch.float64), torch.nn.Tanh(),
        torch.nn.Linear(5, 1, dtype=torch.float64),
    )
    data = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(4, 3)

    def loss(params, inputs):
        return torch.func.functional_call(model, params, (inputs,)).pow(2).mean()

    params = dict(model.named_parameters())  # tensors that require grad: read, not tracked
    got = dxserve.gradient(loss, "auto", params, data)
    want = torch.func.grad(loss)({k: v.detach() for k, v in params.items()}, data)
    assert set(got) == set(want) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for k in want:
        assert isinstance(got[k], torch.Tensor) and got[k].shape == want[k].shape
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-14)
    tangent = {k: torch.ones_like(v) for k, v in want.items()}
    (hv,) = dxserve.hvp(loss, "auto", params, (tangent,), data)
    _, want_hv = torch.func.jvp(lambda p: torch.func.grad(loss)(p, data),
                                ({k: v.detach() for k, v in params.items()},), (tangent,))
    for k in want_hv:
        torch.testing.assert_close(hv[k], want_hv[k], rtol=1e-12, atol=1e-14)
    assert all(v.grad is None for v in params.values())  # nothing accumulated on the model


# --- chunks, progress, budgets --------------------------------------------------------
@pytest.mark.parametrize(("operator", "f", "backend", "expected"), [
    ("jacobian", sin_cumsum, "torch-forward", sin_cumsum_jacobian),
    ("jacobian", sin_cumsum, "torch-reverse", sin_cumsum_jacobian),
    ("hessian", rosenbrock, "auto", rosenbrock_hessian),
])
def test_chunked_runs_report_progress(operator, f, backend, expected) -> None:
    x = np.linspace(0.1, 1.3, 40)
    prep = dxserve.core.preparation.prepare(
        operator, f, backend, x, None, (), limits=ComputeLimits(chunk_from=20)
    )
    assert prep.chunked(operator)
    job = Recording()
    (out,) = prep.run(operator, x, None, (), job)
    assert job.seen[-1] == 40 and len(job.seen) == 10
    np.testing.assert_allclose(np.asarray(out), expected(x), rtol=1e-12, atol=1e-12)
    # the same numbers as one shot
    whole = getattr(dxserve, operator)(f, backend, x)
    np.testing.assert_allclose(np.asarray(out), whole.numpy(), rtol=1e-14, atol=1e-14)


def test_chunks_fit_the_memory_budget_by_the_estimate() -> None:
    x = np.linspace(0.1, 1.3, 300)
    fd = SecondOrder(dxserve.FiniteDifferences(), dxserve.FiniteDifferences())
    prep = dxserve.core.preparation.prepare(
        "hessian", rosenbrock, fd, x, None, (),
        limits=ComputeLimits(chunk_memory_bytes=8 * 1024**2, chunk_from=0),
    )
    size = prep.chunker.size_for("hessian")
    assert size is not None and size < 300  # the one shot's estimate is over 8 MiB
    job = Recording()
    (h,) = prep.run("hessian", x, None, (), job)
    exe = prep.chunker.executables()[0]
    assert exe.estimate.memory_bytes <= 8 * 1024**2
    np.testing.assert_allclose(h, rosenbrock_hessian(x), rtol=1e-4, atol=1e-2)


def test_over_budget_is_refused_before_it_runs_as_for_jax() -> None:
    from dxserve.examples import sin_cumsum as jax_sin_cumsum

    x = np.linspace(0.1, 1.3, 64)
    refusals = []
    for f, backend in ((sin_cumsum, "torch-forward"), (jax_sin_cumsum, "jax-forward")):
        with pytest.raises(BudgetExceededError) as info:
            dxserve.core.preparation.prepare("jacobian", f, backend, x, None, (),
                                        limits=ComputeLimits(max_memory_bytes=4096))
        refusals.append(info.value.extra["limit"])
    assert refusals == ["max_request_memory_bytes"] * 2


def test_a_function_closing_over_tensors_is_not_estimated_but_runs() -> None:
    weights = torch.linspace(1, 2, 5, dtype=torch.float64)  # concrete: no meta run

    def weighted(x):
        return torch.sum(weights * x**2)

    prep = dxserve.core.preparation.prepare("gradient", weighted, "torch-reverse", np.ones(5),
                                       None, (), limits=ComputeLimits(max_memory_bytes=1))
    (g,) = prep.run("gradient", np.ones(5), None, ())
    np.testing.assert_allclose(np.asarray(g), 2 * weights.numpy())


# --- refusals ---------------------------------------------------------------------------
def test_a_backend_of_the_other_framework_names_those_that_fit() -> None:
    with pytest.raises(UnsupportedOperatorError) as info:
        dxserve.gradient(rosenbrock, "jax-reverse", np.ones(3))
    assert info.value.field == "backend"
    assert {"torch-reverse", "torch-forward", "finite-differences"} <= set(
        info.value.extra["fits"])
    with pytest.raises(UnsupportedOperatorError) as info:
        dxserve.hessian(rosenbrock, SecondOrder(TorchForward(), dxserve.JaxReverse()), np.ones(3))
    assert info.value.field == "backend.inner"
    with pytest.raises(UnsupportedOperatorError) as info:
        dxserve.gradient(lambda x: jnp.sum(x**2), TorchReverse(), np.ones(3))
    assert "jax-reverse" in info.value.extra["fits"]


def test_careless_functions_and_inputs_are_typed_errors() -> None:
    with pytest.raises(FunctionEvaluationError):
        dxserve.gradient(lambda x: float(torch.sum(x)), "torch-reverse", np.ones(3))
    with pytest.raises(DtypeMismatchError):
        dxserve.gradient(rosenbrock, "torch-reverse", np.arange(3))
    with pytest.raises(FunctionEvaluationError):  # the function raises on these inputs
        dxserve.gradient(lambda x: torch.sum(x @ torch.ones(4, dtype=x.dtype)), "auto",
                         np.ones(3))

    def inside(x):  # an operator called on torch.func's own wrapped tensors
        return dxserve.gradient(rosenbrock, "torch-reverse", x).sum()

    with pytest.raises(InvalidArgumentError):
        torch.func.grad(inside)(torch.ones(3, dtype=torch.float64))


def test_torch_compile_executables_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    import dxserve.frameworks.torch.framework as torch_framework

    monkeypatch.setattr(torch_framework, "COMPILE", "always")
    x = np.linspace(0.1, 1.3, 7)
    cache = dxserve.core.preparation.PrepCache()
    g = dxserve.core.preparation.call("gradient", rosenbrock, "torch-reverse", x, None, (),
                                 cache=cache)
    np.testing.assert_allclose(g.numpy(), rosenbrock_gradient(x), rtol=1e-12)


# --- hot executables: compiled in the background once they have run long enough ---------
def _hot_prep(monkeypatch: pytest.MonkeyPatch, x: np.ndarray) -> tuple[Any, Any]:
    """A gradient prep whose executable compiles after its first call (the threshold
    at 0 s), and that executable."""
    import dxserve.frameworks.torch.framework as torch_framework

    monkeypatch.setattr(torch_framework, "COMPILE", "hot")
    monkeypatch.setattr(torch_framework, "COMPILE_AFTER", 0.0)
    prep = dxserve.prepare_gradient(rosenbrock, "torch-reverse", x)
    dxserve.gradient(rosenbrock, "torch-reverse", x, prep=prep)  # eager; queues the compile
    (exe,) = [e for e in prep.executables.values()
              if isinstance(e, torch_framework.TorchExecutable)]
    assert exe.compile_tried.wait(timeout=600)
    return prep, exe


def test_hot_executables_compile_in_the_background_and_agree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = np.linspace(0.1, 1.3, 7)
    prep, exe = _hot_prep(monkeypatch, x)
    assert exe.run is not exe.fn  # the compiled program now answers
    for _ in range(3):
        g = dxserve.gradient(rosenbrock, "torch-reverse", x, prep=prep)
        np.testing.assert_allclose(g.numpy(), rosenbrock_gradient(x), rtol=1e-12)


def test_a_program_that_does_not_compile_or_disagrees_stays_eager(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    import dxserve.frameworks.torch.framework as torch_framework

    def failing(fn: Any, **options: Any) -> Any:
        raise RuntimeError("no C++ compiler here")

    def wrong(fn: Any, **options: Any) -> Any:  # compiles "fine", answers off by one
        return lambda *args: torch_framework.tree_map(lambda t: t + 1, fn(*args))

    x = np.linspace(0.1, 1.3, 5)
    for fake, said in ((failing, "torch.compile failed"), (wrong, "differ from the eager")):
        monkeypatch.setattr(torch_framework.torch, "compile", fake)
        with caplog.at_level("WARNING", logger="dxserve.torch"):
            prep, exe = _hot_prep(monkeypatch, x)
        assert exe.run is exe.fn
        assert said in caplog.text
        g = dxserve.gradient(rosenbrock, "torch-reverse", x, prep=prep)
        np.testing.assert_allclose(g.numpy(), rosenbrock_gradient(x), rtol=1e-12)
        caplog.clear()


def test_the_library_stays_eager_unless_told() -> None:
    import dxserve.frameworks.torch.framework as torch_framework

    assert torch_framework._compile_mode("") == "off"
    assert torch_framework._compile_mode("1") == "always"
    assert torch_framework._compile_mode("hot") == "hot"


def test_forward_mode_programs_run_safely_from_several_threads() -> None:
    """torch keeps forward-mode AD levels process-wide: two threads in ``jvp`` at once
    broke each other's ("no level exists") until torch programs took a lock."""
    import threading

    backend = SecondOrder(TorchForward(), TorchReverse())
    x = np.linspace(0.1, 1.3, 6)
    t = np.ones(6)
    expected = rosenbrock_hessian(x) @ t
    errors: list[BaseException] = []

    def work() -> None:
        prep = dxserve.prepare_hvp(rosenbrock, backend, x, (t,))
        try:
            for _ in range(150):
                (got,) = dxserve.hvp(rosenbrock, backend, x, (t,), prep=prep)
                np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=work) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == []


# --- read-only inputs from the wire ---------------------------------------------------------
def _read_only(values: np.ndarray) -> np.ndarray:
    out = np.frombuffer(values.tobytes(), dtype=values.dtype).reshape(values.shape)
    assert not out.flags.writeable
    return out


@pytest.mark.parametrize("make", [
    lambda v: v,                                   # contiguous: shared, no copy
    lambda v: v[::2],                              # strided
    lambda v: v[::-1],                             # negative strides: DLPack refuses them
    lambda v: v[3:4].reshape(()),                  # 0-d
], ids=["contiguous", "strided", "reversed", "0-d"])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "complex128", "int32"])
def test_read_only_inputs_become_tensors_without_warnings(make, dtype: str) -> None:
    """Decoded bodies are read-only views of the request; they reach torch without a copy
    where they can and without the warning that ``from_numpy`` gives for them (silencing
    that per call changed process-wide warning filters from every device thread)."""
    import warnings

    from dxserve.frameworks.torch.framework import numpy_dtype, to_torch

    np_dtype = numpy_dtype(getattr(torch, dtype))
    value = make(_read_only(np.arange(8).astype(np_dtype)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = to_torch(value)
    assert t.dtype == getattr(torch, dtype)
    assert tuple(t.shape) == value.shape
    if dtype == "bfloat16":  # numpy cannot take torch's bfloat16: compare as float64
        np.testing.assert_array_equal(t.double().numpy(), value.astype(np.float64))
    else:
        np.testing.assert_array_equal(t.numpy(), value)
    if value.flags.c_contiguous:
        assert t.data_ptr() == value.ctypes.data  # the wire's bytes, not a copy


def test_a_gradient_on_a_read_only_input_is_exact() -> None:
    x = _read_only(np.linspace(-1.2, 1.4, 7))
    got = dxserve.gradient(rosenbrock, TorchReverse(), x)
    np.testing.assert_allclose(got.numpy(), rosenbrock_gradient(x), rtol=1e-12)
