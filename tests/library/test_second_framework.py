"""A second framework beside JAX: plain numpy functions, through the same seam.

``NumpyFramework`` is a ``dxserve.frameworks.Framework`` written here in numpy alone:
it probes by calling the function, "compiles" by keeping the function (one call on
the given arguments measures its outputs: numpy has no abstract evaluation), vmaps
by a Python loop and estimates an executable's cost from the sizes of its arguments
and outputs. ``ComplexStepEngine`` differentiates numpy code by the complex step
(``Im f(x + i h t) / h``, exact to rounding for real-analytic code); Hessians take
finite differences of its gradients.

The functions below are marked ``framework="numpy"``; they get preparation, chunked
Jacobians and Hessians that report progress, the compute budgets' 422 and batches of
points (``batch_axis=0``), in process and over HTTP from a real server that imports
this module (which registers the framework and the backend, as a plug-in would).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import httpx
import numpy as np
import pytest

import dxserve
from dxclient import Client
from dxcontract.errors import BudgetExceededError, UnsupportedOperatorError
from dxserve import Engine, register_backend
from dxserve.core.limits import ComputeLimits
from dxserve.examples import sin_cumsum
from dxserve.frameworks import Estimate, get_framework, register_framework
from tests.recording_job import Recording
from tests.references import rosenbrock_gradient, rosenbrock_hessian, sin_cumsum_jacobian

Tree = Any


# --- the framework ------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """An abstract numpy array."""

    shape: tuple[int, ...]
    dtype: np.dtype


def _spec(value: Any) -> Spec:
    a = np.asarray(value)
    return Spec(a.shape, a.dtype)


class NumpyExecutable:
    """A "compiled" numpy program: the function itself, with an estimate from sizes."""

    def __init__(self, fn: Callable, args: tuple, leaves: Callable[[Tree], list]) -> None:
        self.fn = fn
        out = fn(*args)  # no abstract evaluation: one call measures the outputs
        ins = [np.asarray(v) for v in leaves(args)]
        outs = [np.asarray(v) for v in leaves(out)]
        self.out_info = _spec(out) if not isinstance(out, tuple | list | dict) else None
        memory = sum(a.nbytes for a in ins) + sum(a.nbytes for a in outs)
        work = sum(a.size for a in ins) * max(1, sum(a.size for a in outs))
        self.estimate = Estimate(memory, float(work), float(memory))

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


class NumpyFramework:
    """numpy as a ``Framework``: eager arrays, dict/list/tuple trees, loops."""

    name = "numpy"
    xp = np

    def is_traced(self, tree: Tree) -> bool:
        return False  # numpy has no transformations to be inside of

    # pytrees: dicts (sorted keys), lists and tuples are nodes; None is empty
    def flatten(self, tree: Tree) -> tuple[list[Any], Any]:
        if tree is None:
            return [], None
        if isinstance(tree, dict):
            keys = sorted(tree)
            parts = [self.flatten(tree[k]) for k in keys]
            return [v for p in parts for v in p[0]], ("dict", keys, [p[1] for p in parts],
                                                      [len(p[0]) for p in parts])
        if isinstance(tree, list | tuple):
            parts = [self.flatten(v) for v in tree]
            return [v for p in parts for v in p[0]], (type(tree), None, [p[1] for p in parts],
                                                      [len(p[0]) for p in parts])
        return [tree], "leaf"

    def unflatten(self, structure: Any, leaves: Sequence[Any]) -> Tree:
        if structure is None:
            return None
        if structure == "leaf":
            return leaves[0]
        kind, keys, subs, counts = structure
        out, at = [], 0
        for sub, count in zip(subs, counts, strict=True):
            out.append(self.unflatten(sub, leaves[at:at + count]))
            at += count
        if kind == "dict":
            return dict(zip(keys, out, strict=True))
        return kind(out)

    def leaves(self, tree: Tree) -> list[Any]:
        return self.flatten(tree)[0]

    def tree_map(self, fn: Callable[..., Any], tree: Tree, *rest: Tree) -> Tree:
        leaves, structure = self.flatten(tree)
        others = [self.leaves(r) for r in rest]
        return self.unflatten(structure, [fn(*vs) for vs in zip(leaves, *others, strict=True)])

    def spec(self, shape: tuple[int, ...], dtype: Any) -> Spec:
        return Spec(tuple(shape), np.dtype(dtype))

    def to_device(self, tree: Tree) -> Tree:
        return tree

    def device(self) -> Any:
        return None

    def block(self, tree: Tree) -> Tree:
        return tree

    def probe(self, f: Callable, x: Tree, contexts: tuple) -> tuple[bool, Tree]:
        return True, self.eval_shape(f, x, *contexts)

    def eval_shape(self, fn: Callable, *args: Any) -> Tree:
        return self.tree_map(_spec, fn(*args))

    def vmap(self, fn: Callable, in_axes: Any = 0) -> Callable:
        def looped(*args: Any) -> Tree:
            axes = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(args)
            mapped = [a for a, axis in zip(args, axes, strict=True) if axis is not None]
            count = np.shape(self.leaves(mapped)[0])[0]
            outs = [
                fn(*[a if axis is None else self.tree_map(lambda v, i=i: v[i], a)
                     for a, axis in zip(args, axes, strict=True)])
                for i in range(count)
            ]
            return self.tree_map(lambda *vs: np.stack([np.asarray(v) for v in vs]), *outs)

        return looped

    def map(self, fn: Callable[[Tree], Tree], batch: Tree, batch_size: int | None) -> Tree:
        return self.vmap(fn)(batch)

    def ravel(self, tree: Tree) -> tuple[Any, Callable[[Any], Tree]]:
        leaves, structure = self.flatten(tree)
        leaves = [np.asarray(v) for v in leaves]
        shapes = [v.shape for v in leaves]
        vec = np.concatenate([v.ravel() for v in leaves]) if leaves else np.zeros(0)
        cuts = np.cumsum([v.size for v in leaves])[:-1]

        def unravel(v: Any) -> Tree:
            parts = np.split(np.asarray(v), cuts)
            return self.unflatten(structure, [p.reshape(s) for p, s in zip(parts, shapes, strict=True)])

        return vec, unravel

    def compile(self, fn: Callable, args: tuple, key: Any = None) -> NumpyExecutable:
        return NumpyExecutable(fn, args, self.leaves)

    def compile_donating(self, fn: Callable, args: tuple) -> NumpyExecutable:
        return NumpyExecutable(fn, args, self.leaves)

    def executable_key(self, *args: Any) -> None:
        return None

    def estimate(self, executable: Any) -> Estimate | None:
        return getattr(executable, "estimate", None)

    def batch_program(self, run: Callable, inputs: tuple) -> tuple[Any, str]:
        return None, "numpy runs each request as it comes"

    def compile_batched(self, program: Any, stacked: list[Any]) -> Callable:
        raise NotImplementedError

    def out_structure(self, program: Any) -> Any:
        raise NotImplementedError

    def program_arrays(self, program: Any) -> list[Any]:
        return []

    def precision_scope(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # numpy keeps every dtype as it is

    def eager(self) -> NumpyFramework:
        return self


NUMPY = register_framework(NumpyFramework())


# --- the engine ---------------------------------------------------------------------
@dataclass(frozen=True)
class ComplexStep:
    """Complex-step derivatives of real-analytic numpy code."""

    type: ClassVar[str] = "complex-step"

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type}


@dataclass(frozen=True)
class ComplexStepEngine(Engine):
    """``J t = Im g(x + i h t) / h``: no subtraction, so exact to rounding."""

    traced: bool = True
    H: ClassVar[float] = 1e-30

    def pushforward(self, g, x, tx):
        ops, h = self.ops, self.H
        y = g(x)

        def one(t: Tree) -> Tree:
            shifted = ops.tree_map(lambda a, b: a + 1j * h * b, x, t)
            return ops.tree_map(lambda v: self.xp.imag(v) / h, g(shifted))

        return y, self.map(one, tx)


register_backend(
    ComplexStep,
    lambda b, *, traced, nested: ComplexStepEngine(traced),
    parameters={},
    notes="a test engine: complex-step derivatives of numpy code",
)


# --- numpy functions ----------------------------------------------------------------
@dxserve.function(framework="numpy", description="extended Rosenbrock in numpy")
def np_rosenbrock(x: np.ndarray) -> Any:
    return np.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


@dxserve.function(framework="numpy", description="sin(x) * cumsum(x) in numpy")
def np_sin_cumsum(x: np.ndarray) -> Any:
    return np.sin(x) * np.cumsum(x)


@dxserve.function(framework="numpy", description="|z|^2 + Re z Im z, summed, in numpy")
def np_abs2_re_im(z: np.ndarray) -> Any:
    return np.sum(np.abs(z) ** 2 + np.real(z) * np.imag(z))








CS = {"type": "complex-step"}
#: second order: finite differences of the complex-step gradient
HESSIAN = {"type": "second-order", "outer": {"type": "finite-differences"}, "inner": CS}
RTOL = 1e-8


def _close(got: Any, want: np.ndarray) -> None:
    got = np.asarray(got)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * np.abs(want).max())




# --- in process -------------------------------------------------------------------
def test_the_functions_know_their_framework() -> None:
    from dxserve.frameworks import framework_of

    assert framework_of(np_rosenbrock) is NUMPY
    assert framework_of(lambda x: x).name == "jax" and get_framework().name == "jax"


def test_first_and_second_order_in_process() -> None:
    x = np.linspace(0.2, 1.4, 7)
    _close(dxserve.gradient(np_rosenbrock, CS, x), rosenbrock_gradient(x))
    _close(dxserve.jacobian(np_sin_cumsum, CS, x), sin_cumsum_jacobian(x))
    _close(dxserve.hessian(np_rosenbrock, HESSIAN, x), rosenbrock_hessian(x))
    (pushed,) = dxserve.pushforward(np_sin_cumsum, CS, x, (np.ones(7),))
    _close(pushed, sin_cumsum_jacobian(x) @ np.ones(7))
    # finite differences, a built-in engine, run in the numpy framework too
    g = dxserve.gradient(np_rosenbrock, "finite-differences", x)
    np.testing.assert_allclose(g, rosenbrock_gradient(x), rtol=1e-6)


def test_complex_x_is_refused_by_the_complex_step() -> None:
    """JAX's convention takes complex x apart into real and imaginary parts; a complex
    step evaluates the function at complex points of its own, so it refuses complex x
    (422) instead of answering in another convention. Finite differences serve it."""
    z = np.array([1 + 2j, -0.5 + 0.3j])
    with pytest.raises(UnsupportedOperatorError) as info:
        dxserve.gradient(np_abs2_re_im, CS, z)
    assert info.value.field == "backend"
    assert "complex-step" in info.value.detail and "finite-differences" in info.value.detail
    with pytest.raises(UnsupportedOperatorError) as info:  # no Hessian matrix of complex x
        dxserve.hessian(np_abs2_re_im, HESSIAN, z)  # for a real f, as jax.hessian says
    assert info.value.field == "holomorphic"
    with pytest.raises(UnsupportedOperatorError):
        dxserve.pushforward(np_abs2_re_im, CS, z, (np.ones(2, complex),))
    # ∂f/∂x - i ∂f/∂y = (2x + y) - i (2y + x), as jax.grad answers
    g = dxserve.gradient(np_abs2_re_im, "finite-differences", z)
    np.testing.assert_allclose(g, [4 - 5j, -0.7 - 0.1j], rtol=1e-8)


def test_preparation_compiles_through_the_framework() -> None:
    x = np.linspace(0.2, 1.4, 5)
    prep = dxserve.prepare_jacobian(np_sin_cumsum, CS, x)
    assert prep.traced and prep.framework is NUMPY
    exe = prep.executables[("jacobian", None)]
    assert isinstance(getattr(exe, "executable", exe), NumpyExecutable)
    _close(dxserve.jacobian(np_sin_cumsum, CS, x, prep=prep), sin_cumsum_jacobian(x))


@pytest.mark.parametrize(
    ("operator", "f", "backend", "expected"),
    [("jacobian", np_sin_cumsum, CS, sin_cumsum_jacobian),
     ("hessian", np_rosenbrock, HESSIAN, rosenbrock_hessian)],
)
def test_chunked_runs_report_progress(operator: str, f, backend, expected) -> None:
    x = np.linspace(0.1, 1.3, 40)
    prep = dxserve.core.preparation.prepare(
        operator, f, backend, x, None, (), limits=ComputeLimits(chunk_from=20)
    )
    assert prep.chunked(operator)
    job = Recording()
    (out,) = prep.run(operator, x, None, (), job)
    assert job.seen[-1] == 40 and len(job.seen) == 10  # 40 basis vectors, 10 chunks of 4
    _close(out, expected(x))


def test_a_request_over_budget_is_refused_before_it_runs() -> None:
    x = np.linspace(0.1, 1.3, 64)
    with pytest.raises(BudgetExceededError) as numpy_refusal:
        dxserve.core.preparation.prepare(
            "jacobian", np_sin_cumsum, CS, x, None, (),
            limits=ComputeLimits(max_memory_bytes=4096),
        )
    with pytest.raises(BudgetExceededError) as jax_refusal:
        dxserve.core.preparation.prepare(
            "jacobian", sin_cumsum, "jax-forward", x, None, (),
            limits=ComputeLimits(max_memory_bytes=4096),
        )
    limits = [e.value.extra["limit"] for e in (numpy_refusal, jax_refusal)]
    assert limits == ["max_request_memory_bytes"] * 2


def test_batches_of_points() -> None:
    xs = np.linspace(0.1, 1.3, 15).reshape(3, 5)
    got = dxserve.gradient(np_rosenbrock, CS, xs, batch_axis=0)
    _close(got, np.stack([rosenbrock_gradient(x) for x in xs]))
    got = dxserve.hessian(np_rosenbrock, HESSIAN, xs, batch_axis=0)
    _close(got, np.stack([rosenbrock_hessian(x) for x in xs]))
    # sliced into chunks of points, with progress
    prep = dxserve.core.preparation.prepare(
        "gradient", np_rosenbrock, CS, xs, None, (), limits=ComputeLimits(chunk_from=2),
        batch_axis=0,
    )
    job = Recording()
    (out,) = prep.run("gradient", xs, None, (), job)
    assert job.seen[-1] == 3
    _close(out, np.stack([rosenbrock_gradient(x) for x in xs]))


# --- over HTTP, from a real server ----------------------------------------------------
@pytest.fixture(scope="module")
def numpy_server(tmp_path_factory: pytest.TempPathFactory):
    from tests.conftest import start_server, stop_server

    srv = start_server(
        tmp_path_factory.mktemp("dxserve-numpy"),
        env={"DXSERVE_CHUNK_FROM": "20", "DXSERVE_MAX_REQUEST_MEMORY_BYTES": str(256 * 1024)},
        modules=("dxserve.examples", "tests.library.test_second_framework"),
    )
    try:
        yield srv
    finally:
        stop_server(srv)


def test_over_http(numpy_server) -> None:
    x = np.linspace(0.1, 1.3, 40)
    with Client(numpy_server.url) as client:
        _close(client.gradient("np_rosenbrock", CS, x), rosenbrock_gradient(x))
        seen: list[tuple[int, int]] = []
        h = client.hessian("np_rosenbrock", HESSIAN, x, progress=lambda d, t: seen.append((d, t)))
        _close(h, rosenbrock_hessian(x))
        assert len(seen) >= 5 and seen[-1] == (40, 40)
        seen.clear()
        j = client.jacobian("np_sin_cumsum", CS, x, progress=lambda d, t: seen.append((d, t)))
        _close(j, sin_cumsum_jacobian(x))
        assert seen[-1] == (40, 40)
        xs = np.linspace(0.1, 1.3, 15).reshape(3, 5)
        g = client.gradient("np_rosenbrock", CS, xs, batch_axis=0)
        _close(g, np.stack([rosenbrock_gradient(v) for v in xs]))


def test_complex_x_over_http(numpy_server) -> None:
    z = {"__ndarray__": [[1.0, 2.0], [-0.5, 0.3]], "dtype": "complex128", "shape": [2]}
    r = httpx.post(f"{numpy_server.url}/gradient", json={
        "function": "np_abs2_re_im", "backend": CS, "x": z})
    assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json"
    assert r.json()["field"] == "backend" and "complex-step" in r.json()["detail"]
    with Client(numpy_server.url) as client:
        g = client.gradient("np_abs2_re_im", "finite-differences", np.array([1 + 2j, -0.5 + 0.3j]))
    np.testing.assert_allclose(g, [4 - 5j, -0.7 - 0.1j], rtol=1e-8)


def test_over_budget_over_http_is_the_same_422(numpy_server) -> None:
    x = np.linspace(0.1, 1.3, 400)  # a 400 x 400 Jacobian: 1.25 MB, over 256 KiB
    answers = [
        httpx.post(f"{numpy_server.url}/jacobian", json={
            "function": name, "backend": backend, "x": x.tolist()})
        for name, backend in (("np_sin_cumsum", CS), ("sin_cumsum", "jax-forward"))
    ]
    for r in answers:
        assert r.status_code == 422, r.text
    numpy_problem, jax_problem = (r.json() for r in answers)
    assert numpy_problem["type"] == jax_problem["type"]
    assert numpy_problem["limit"] == jax_problem["limit"] == "max_request_memory_bytes"
