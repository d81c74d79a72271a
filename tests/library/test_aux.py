"""has_aux in process: every operator that takes it, on every kind of backend, against
JAX's own has_aux transformations (``jax.grad``, ``jax.value_and_grad``, ``jax.jacrev``,
``jax.jvp``, ``jax.vjp``, ``jax.hessian``) in float64.

JAX's modes and second order over them agree to rtol 1e-10; finite differences (and a
plug-in numpy engine taking forward differences) to their own tolerances, while their
aux, evaluated at x, agrees to rounding. Also: the example that used to fail, preparation,
batches of points, chunked runs, black boxes, and every malformed aux refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dxserve
from dxcontract.errors import (
    FunctionEvaluationError,
    NotScalarOutputError,
    PreparationMismatchError,
    ShapeMismatchError,
    UnsupportedOperatorError,
)
from dxcontract.operators import OPERATORS, returned, unreturned
from dxserve import (
    Engine,
    FiniteDifferences,
    JaxForward,
    JaxReverse,
    SecondOrder,
    Sparse,
    register_backend,
)
from dxserve.core import preparation
from dxserve.core.limits import ComputeLimits
from dxserve.core.progress import Job
from dxserve.frameworks.jax.precision import float64_scope
from tests.aux_functions import (
    X3,
    aux_context,
    aux_curve,
    aux_numpy,
    aux_scalar,
    aux_vector,
    no_pair,
    triple,
    vector_pair,
)
from tests.recording_job import Recording

T1, T2 = np.array([1.0, -0.5, 0.25]), np.array([0.0, 2.0, -1.0])
C1, C2 = np.array([0.5, 1.0, -2.0]), np.array([1.0, 0.0, 0.0])  # cotangents of aux_vector
XS = np.float64(0.4)  # aux_curve's scalar x


# --- a plug-in engine: forward differences in numpy, pushforward only ---------------------
@dataclass(frozen=True)
class NumpyForwardAux:
    step: float = 1e-7
    type: ClassVar[str] = "numpy-forward-aux"

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, "step": self.step}


@dataclass(frozen=True)
class NumpyForwardAuxEngine(Engine):
    step: float
    traced: bool = True
    traces = False  # concrete numpy arrays: the operator runs eagerly, aux too

    def pushforward(self, g, x, tx):
        x = np.asarray(x)
        y = np.asarray(g(x))
        h = self.step * max(1.0, float(np.max(np.abs(x))))
        return y, np.stack([(np.asarray(g(x + h * t)) - y) / h for t in np.asarray(tx)])


register_backend(
    NumpyForwardAux,
    lambda b, *, traced, nested: NumpyForwardAuxEngine(b.step, traced),
    notes="a test engine: forward differences in numpy",
)


def assert_close(got: Any, want: Any, *, rtol: float, atol: float, scaled: bool = False) -> None:
    """The same pytree (tuples, lists, dicts, None where JAX has them), leaves of the same
    shape and dtype, values within ``atol + rtol |want|`` (``scaled``: ``atol + rtol
    max|want|`` per leaf, for differences whose error scales with the whole result)."""
    structure = jax.tree_util.tree_structure
    assert structure(got) == structure(want), f"{structure(got)} != {structure(want)}"
    for i, (a, e) in enumerate(zip(jax.tree_util.tree_leaves(got),
                                   jax.tree_util.tree_leaves(want), strict=True)):
        a, e = np.asarray(a), np.asarray(e)
        assert (a.shape, a.dtype) == (e.shape, e.dtype), f"leaf {i}: {a.shape} {a.dtype}"
        if scaled:
            bound = atol + rtol * (float(np.max(np.abs(e))) if e.size else 0.0)
            assert float(np.max(np.abs(a - e), initial=0.0)) <= bound, f"leaf {i}: {a} != {e}"
        else:
            np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f"leaf {i}")


# --- JAX's references -----------------------------------------------------------------
def _primal(f: Callable) -> Callable:
    return lambda u: f(u)[0]


def _reference(op: str, f: Callable, x: Any) -> Any:
    """What ``dxserve.<op>(f, b, x, [tangents], has_aux=True)`` must return, from JAX's
    has_aux transformations (tangents ``(T1, T2)``, cotangents ``(C1, C2)``)."""
    with float64_scope():
        x = jnp.asarray(x)
        y, aux = f(x)
        if op == "value":
            return y, aux
        if op in ("gradient", "value_and_gradient"):
            (v, aux), g = jax.value_and_grad(f, has_aux=True)(x)
            g2, aux2 = jax.grad(f, has_aux=True)(x)
            assert_close(g2, g, rtol=0, atol=0)
            return (g, aux) if op == "gradient" else ((v, aux), g)
        if op in ("jacobian", "value_and_jacobian"):
            J, aux = jax.jacrev(f, has_aux=True)(x)
            return (J, aux) if op == "jacobian" else ((y, aux), J)
        if op in ("derivative", "value_and_derivative"):
            d, aux = jax.jacfwd(f, has_aux=True)(x)
            return (d, aux) if op == "derivative" else ((y, aux), d)
        if op in ("second_derivative", "value_derivative_and_second_derivative"):
            d, _ = jax.jacfwd(f, has_aux=True)(x)
            d2, aux = jax.jacfwd(jax.jacfwd(f, has_aux=True), has_aux=True)(x)
            if op == "second_derivative":
                return d2, aux
            return (y, aux), d, d2
        if op in ("hessian", "value_gradient_and_hessian"):
            H, aux = jax.hessian(f, has_aux=True)(x)
            g, _ = jax.grad(f, has_aux=True)(x)
            return (H, aux) if op == "hessian" else ((y, aux), g, H)
        if op in ("hvp", "gradient_and_hvp"):
            H, aux = jax.hessian(f, has_aux=True)(x)
            g, _ = jax.grad(f, has_aux=True)(x)
            hvps = (H @ T1, H @ T2)
            return (hvps, aux) if op == "hvp" else ((g, hvps), aux)
        if op in ("pushforward", "value_and_pushforward"):
            outs = [jax.jvp(f, (x,), (jnp.asarray(t),), has_aux=True) for t in (T1, T2)]
            ty = tuple(o[1] for o in outs)
            return (ty, outs[0][2]) if op == "pushforward" else ((outs[0][0], outs[0][2]), ty)
        if op in ("pullback", "value_and_pullback"):
            y, vjp, aux = jax.vjp(f, x, has_aux=True)
            tx = tuple(vjp(jnp.asarray(c))[0] for c in (C1, C2))
            return (tx, aux) if op == "pullback" else ((y, aux), tx)
    raise AssertionError(op)


def _case(op: str) -> tuple[Callable, Any, tuple | None]:
    """(function, x, tangents) for ``op``."""
    spec = OPERATORS[op]
    if spec.scalar_input:
        return aux_curve, XS, None
    if spec.tangents_like == "y":
        return aux_vector, X3, (C1, C2)
    f = aux_scalar if spec.scalar_output or spec.order == 2 else aux_vector
    return f, X3, (T1, T2) if spec.takes_tangents else None


def _call(op: str, f: Callable, backend: Any, x: Any, tangents: tuple | None, **kw: Any) -> Any:
    args = (x,) if tangents is None else (x, tangents)
    return getattr(dxserve, op)(f, backend, *args, has_aux=True, **kw)


AUX_OPERATORS = sorted(n for n, op in OPERATORS.items() if op.aux)
FIRST = [n for n in AUX_OPERATORS if OPERATORS[n].order <= 1]
SECOND = [n for n in AUX_OPERATORS if OPERATORS[n].order == 2]
EXACT_FIRST = ["jax-reverse", "jax-forward", "auto", JaxForward(batch_size=2)]
EXACT_SECOND = [
    "auto", "jax-reverse", SecondOrder(JaxForward(), JaxReverse()),
    SecondOrder(JaxReverse(), JaxReverse()), SecondOrder(JaxReverse(), JaxForward()),
]


def _aux_of(op: str, result: Any) -> Any:
    return unreturned(OPERATORS[op], result, True)[-1]


def test_every_operator_but_sparsity_takes_has_aux() -> None:
    assert set(AUX_OPERATORS) == set(OPERATORS) - {"sparsity"}
    assert "has_aux" not in dxserve.sparsity.__code__.co_varnames


@pytest.mark.parametrize("backend", EXACT_FIRST, ids=str)
@pytest.mark.parametrize("op", FIRST)
def test_first_order_matches_jax(op: str, backend: Any) -> None:
    f, x, tangents = _case(op)
    assert_close(_call(op, f, backend, x, tangents), _reference(op, f, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", EXACT_SECOND, ids=str)
@pytest.mark.parametrize("op", SECOND)
def test_second_order_matches_jax(op: str, backend: Any) -> None:
    f, x, tangents = _case(op)
    assert_close(_call(op, f, backend, x, tangents), _reference(op, f, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("backend", "rtol"),
    [("finite-differences", 1e-7), (FiniteDifferences(method="forward"), 1e-5),
     (NumpyForwardAux(), 1e-5)],
    ids=["fd-central", "fd-forward", "plug-in"],
)
@pytest.mark.parametrize("op", FIRST)
def test_first_order_differences_take_aux_from_the_primal_point(
    op: str, backend: Any, rtol: float
) -> None:
    f, x, tangents = _case(op)
    got, want = _call(op, f, backend, x, tangents), _reference(op, f, x)
    assert_close(got, want, rtol=rtol, atol=rtol, scaled=True)
    # aux and the value are evaluated at x, not differenced: equal to rounding
    assert_close(_aux_of(op, got), _aux_of(op, want), rtol=1e-14, atol=1e-15)
    if OPERATORS[op].results[0] == "value":
        assert_close(unreturned(OPERATORS[op], got, True)[0],
                     unreturned(OPERATORS[op], want, True)[0], rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize(
    "backend",
    ["finite-differences", SecondOrder(FiniteDifferences(), JaxReverse()),
     SecondOrder(NumpyForwardAux(), JaxReverse())],
    ids=["fd-over-fd", "fd-over-reverse", "plug-in-over-reverse"],
)
@pytest.mark.parametrize("op", SECOND)
def test_second_order_differences(op: str, backend: Any) -> None:
    f, x, tangents = _case(op)
    got, want = _call(op, f, backend, x, tangents), _reference(op, f, x)
    assert_close(got, want, rtol=1e-5, atol=1e-5, scaled=True)
    assert_close(_aux_of(op, got), _aux_of(op, want), rtol=1e-14, atol=1e-15)


def test_the_example_that_used_to_fail() -> None:
    """``value_and_gradient(lambda y: (loss, {"n": ...}), backend, x)``: refused with the
    fix named without has_aux, JAX's shapes with it."""
    def f(y):
        return jnp.sum((y - 1.0) ** 2), {"n": jnp.sum(jnp.abs(y))}

    x = np.array([1.0, 2.0, 3.0])
    with pytest.raises(NotScalarOutputError, match=r"has_aux=True") as err:
        dxserve.value_and_gradient(f, "jax-reverse", x)
    assert err.value.field == "function" and err.value.fix == {"has_aux": True}
    (value, aux), g = dxserve.value_and_gradient(f, "jax-reverse", x, has_aux=True)
    with float64_scope():
        (v_ref, aux_ref), g_ref = jax.value_and_grad(f, has_aux=True)(x)
    assert float(value) == pytest.approx(5.0, rel=1e-15) and float(aux["n"]) == 6.0
    assert_close(((value, aux), g), ((v_ref, aux_ref), g_ref), rtol=1e-12, atol=0)
    np.testing.assert_allclose(g, [0.0, 2.0, 4.0], rtol=1e-15)


def test_returned_and_unreturned_are_inverse() -> None:
    for op in OPERATORS.values():
        if not op.aux:
            continue
        values = tuple(f"r{i}" for i in range(len(op.results))) + ("aux",)
        shaped = returned(op, values, True)
        assert unreturned(op, shaped, True) == values, op.name
        assert shaped[-1] == "aux" if op.results[0] != "value" else True
    vag = OPERATORS["value_and_gradient"]
    assert returned(vag, ("v", "g", "a"), True) == (("v", "a"), "g")
    assert returned(OPERATORS["gradient"], ("g", "a"), True) == ("g", "a")
    assert returned(OPERATORS["value"], ("v", "a"), True) == ("v", "a")
    assert returned(OPERATORS["gradient_and_hvp"], ("g", "h", "a"), True) == (("g", "h"), "a")
    assert returned(vag, ("v", "g"), False) == ("v", "g")


def test_contexts_pass_through() -> None:
    a = np.array([2.0, -1.0, 0.5])
    (v, aux), g = dxserve.value_and_gradient(aux_context, "auto", X3, a, has_aux=True)
    np.testing.assert_allclose(g, 2 * a * X3, rtol=1e-15)
    np.testing.assert_allclose(aux["ax"], a * X3, rtol=1e-15)
    assert float(v) == pytest.approx(float(np.sum(a * X3**2)), rel=1e-15)


def test_a_black_box_gets_its_aux_from_one_evaluation_at_x() -> None:
    calls: list[np.ndarray] = []

    def counted(x):
        calls.append(np.array(x))
        return aux_numpy(x)

    (v, aux), g = dxserve.value_and_gradient(counted, "auto", X3, has_aux=True)
    assert dxserve.resolve("auto", "gradient", counted, X3, has_aux=True).type == (
        "finite-differences"
    )
    want = np.sin(X3) + X3 * np.cos(X3) + np.array([X3[1], X3[0], 0.0])
    np.testing.assert_allclose(g, want, rtol=1e-8)
    assert float(aux["norm"]) == pytest.approx(float(np.linalg.norm(X3)), rel=1e-15)
    assert float(v) == pytest.approx(float(aux_numpy(X3)[0]), rel=1e-15)
    # every evaluation at x itself is the primal point's (probe, value, aux): no shifted x
    # ever reaches aux, and the rest are the differences' shifted points
    at_x = [c for c in calls if np.array_equal(c, X3)]
    assert len(at_x) >= 1 and len(calls) - len(at_x) == 2 * X3.size


# --- preparation ----------------------------------------------------------------------
def test_prepared_calls_follow_x() -> None:
    prep = dxserve.prepare_value_and_gradient(aux_scalar, "jax-reverse", X3, has_aux=True)
    assert prep.has_aux and prep.results("value_and_gradient")[-1] == "aux"
    for x in (X3, X3 * 2, -X3):
        got = dxserve.value_and_gradient(aux_scalar, "jax-reverse", x, prep=prep, has_aux=True)
        assert_close(got, _reference("value_and_gradient", aux_scalar, x), rtol=1e-12, atol=0)
    # the family's other operator shares the prep
    got = dxserve.gradient(aux_scalar, "jax-reverse", X3, prep=prep, has_aux=True)
    assert_close(got, _reference("gradient", aux_scalar, X3), rtol=1e-12, atol=0)


def test_a_prep_says_when_has_aux_differs() -> None:
    prep = dxserve.prepare_gradient(aux_scalar, "auto", X3, has_aux=True)
    with pytest.raises(PreparationMismatchError, match="has_aux=False given") as err:
        dxserve.gradient(aux_scalar, "auto", X3, prep=prep)
    assert err.value.field == "has_aux"
    plain = dxserve.prepare_jacobian(aux_vector, "auto", X3)
    with pytest.raises(PreparationMismatchError, match="prepared with has_aux=False"):
        dxserve.jacobian(aux_vector, "auto", X3, prep=plain, has_aux=True)


def test_with_and_without_has_aux_are_cached_apart() -> None:
    f = aux_vector
    J, aux = dxserve.jacobian(f, "auto", X3, has_aux=True)
    whole = dxserve.jacobian(f, "auto", X3)  # the pair's Jacobian: both parts, as jax's
    with float64_scope():
        want = jax.jacobian(f)(jnp.asarray(X3))
    assert_close(whole, want, rtol=1e-12, atol=0)
    np.testing.assert_allclose(J, whole[0], rtol=1e-15)
    assert len(aux) == 2 and float(aux[0]) == pytest.approx(float(np.sum(X3)), rel=1e-15)


# --- batches of points ----------------------------------------------------------------
@pytest.mark.parametrize("op", ["value_and_gradient", "jacobian", "value_and_pullback",
                                "hessian", "gradient_and_hvp", "value"])
def test_a_batch_of_points_stacks_aux_like_the_results(op: str) -> None:
    f, _, tangents = _case(op)
    points = np.stack([X3, 2 * X3, X3 - 1, -X3])
    batched_t = None if tangents is None else tuple(np.stack([t] * 4) for t in tangents)
    got = _call(op, f, "auto", points, batched_t, batch_axis=0)
    for i, p in enumerate(points):
        want = _reference(op, f, p)
        assert_close(jax.tree_util.tree_map(lambda v, i=i: np.asarray(v)[i], got), want,
                     rtol=1e-10, atol=1e-12)
    if f is aux_scalar:  # an int leaf is stacked too
        count = np.asarray(_aux_of(op, got)["count"])
        assert count.shape == (4,) and count.dtype == np.int32 and set(count.tolist()) == {3}


# --- chunked runs: aux once, beside the chunks --------------------------------------------


@pytest.mark.parametrize("backend", ["jax-forward", "jax-reverse", "finite-differences"])
def test_a_chunked_jacobian_returns_the_one_shot_aux(backend: str) -> None:
    def f(x):
        return jnp.sin(x) * jnp.cumsum(x), {"mean": jnp.mean(x), "head": x[:3]}

    x = np.linspace(-1.0, 1.0, 40)
    chunked = preparation.prepare(
        "value_and_jacobian", f, backend, x, None, (), limits=ComputeLimits(chunk_from=8),
        has_aux=True,
    )
    assert chunked.chunked("value_and_jacobian")
    job = Recording()
    with float64_scope():
        got = chunked.run("value_and_jacobian", x, None, (), job)
    one_shot = dxserve.value_and_jacobian(f, backend, x, has_aux=True)
    assert len(job.seen) > 1 and job.seen[-1] == 40  # progress moved chunk by chunk
    want = unreturned(OPERATORS["value_and_jacobian"], one_shot, True)
    assert_close(got, want, rtol=1e-12, atol=1e-13)


def test_a_chunked_batch_of_points_joins_aux_along_the_points() -> None:
    points = np.stack([X3 * s for s in np.linspace(0.5, 2.0, 12)])
    prep = preparation.prepare(
        "value_and_gradient", aux_scalar, "jax-reverse", points, None, (), batch_axis=0,
        limits=ComputeLimits(chunk_from=4), has_aux=True,
    )
    assert prep.chunked("value_and_gradient")
    with float64_scope():
        value, grad, aux = prep.run("value_and_gradient", points, None, (), Job())
    for i, p in enumerate(points):
        (v, a), g = _reference("value_and_gradient", aux_scalar, p)
        assert_close((value[i], grad[i]), (v, g), rtol=1e-12, atol=0)
        assert_close(jax.tree_util.tree_map(lambda t, i=i: np.asarray(t)[i], aux), a,
                     rtol=1e-12, atol=0)


def test_chunked_tangents_keep_one_aux() -> None:
    tangents = tuple(np.eye(3)[i % 3] * (i + 1) for i in range(9))
    prep = preparation.prepare(
        "value_and_pushforward", aux_vector, "jax-forward", X3, tangents, (),
        limits=ComputeLimits(chunk_from=3), has_aux=True,
    )
    assert prep.chunked("value_and_pushforward")
    with float64_scope():
        value, tys, aux = prep.run("value_and_pushforward", X3, tangents, (), Job())
    (_, aux_ref), _ = _reference("value_and_pushforward", aux_vector, X3)
    assert len(tys) == 9
    assert_close(aux, aux_ref, rtol=1e-14, atol=0)


# --- what is refused, by name -----------------------------------------------------------
@pytest.mark.parametrize(("f", "got"), [
    (no_pair, "an array of shape ()"), (triple, "a tuple of 3"),
    (lambda x: [x], "a list of 1"), (lambda x: {"y": x, "aux": x}, "a dict"),
])
def test_a_function_that_returns_no_pair_is_refused_by_name(f: Callable, got: str) -> None:
    with pytest.raises(ShapeMismatchError) as err:
        dxserve.gradient(f, "auto", X3, has_aux=True)
    message = str(err.value)
    assert got in message and "return a tuple (output, aux)" in message
    assert err.value.field == "function" and err.value.fix == {"has_aux": False}
    assert "has_aux=False" in message
    if f in (no_pair, triple):
        assert repr(f.__name__) in message  # the function, by name


def test_the_output_part_is_still_checked() -> None:
    with pytest.raises(NotScalarOutputError, match=r"returns \(3,\)"):
        dxserve.gradient(vector_pair, "auto", X3, has_aux=True)
    J, aux = dxserve.jacobian(vector_pair, "auto", X3, has_aux=True)
    np.testing.assert_allclose(J, np.diag(2 * X3), rtol=1e-15)


def test_an_aux_that_is_no_array_is_a_function_error() -> None:
    with pytest.raises(FunctionEvaluationError):
        dxserve.gradient(lambda x: (jnp.sum(x), "text"), "auto", X3, has_aux=True)


def test_sparse_backends_refuse_has_aux() -> None:
    with pytest.raises(UnsupportedOperatorError, match="sparse") as err:
        dxserve.jacobian(aux_vector, Sparse(JaxForward()), X3, has_aux=True)
    assert err.value.field == "has_aux"
    # a family no sparse engine serves runs on the dense backend, aux and all
    got = dxserve.gradient(aux_scalar, Sparse(JaxReverse()), X3, has_aux=True)
    assert_close(got, _reference("gradient", aux_scalar, X3), rtol=1e-12, atol=0)


def test_the_sparsity_operator_takes_no_has_aux() -> None:
    with pytest.raises(UnsupportedOperatorError, match="sparsity takes no has_aux") as err:
        preparation.prepare("sparsity", aux_vector, "auto", X3, None, (), has_aux=True)
    assert err.value.field == "has_aux"
