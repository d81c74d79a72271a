"""``Auto`` falls back where its mode does not trace: reverse mode through a while_loop.

The functions (``tests.trace_functions``) iterate Newton's method in a ``lax.while_loop``:
JAX's reverse mode does not trace them, forward mode does. ``Auto`` finds out at
preparation, uses forward mode (forward-over-forward at second order) and says why in
``resolve(..., explain=True)`` and in the prep's report; a function neither mode traces
(``pure_callback``) gets finite differences. Explicit backends are not second-guessed:
``jax-reverse`` still fails, naming itself and what works. Every value is checked
against the analytic derivatives of ∛x and against the explicit forward backends.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dxserve
from dxcontract.errors import UnsupportedOperatorError
from dxserve import FiniteDifferences, JaxForward, JaxReverse, SecondOrder
from tests.references import cbrt_derivative, cbrt_second_derivative
from tests.trace_functions import (
    X,
    callback_cbrt_sum,
    cbrt_pair,
    cbrt_sum,
    cube_sum_vjp,
    newton_cbrt,
)

RTOL = 1e-8
FOF = SecondOrder(JaxForward(), JaxForward())
WHILE = "Reverse-mode differentiation does not work for lax.while_loop"


def close(got, want, rtol=RTOL):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=0)


def fresh(fn):
    """A new function object calling ``fn``: nothing cached for it yet."""
    return lambda x: fn(x)


def test_gradient_auto_uses_forward_and_matches_the_analytic_derivative():
    f = fresh(cbrt_sum)
    g = dxserve.gradient(f, "auto", X)
    close(g, cbrt_derivative(X))
    close(g, dxserve.gradient(f, "jax-forward", X))
    value, g2 = dxserve.value_and_gradient(f, "auto", X)
    close(value, np.sum(np.cbrt(X)), 1e-14)
    close(g2, g, 1e-15)


def test_jacobian_auto_falls_back_when_its_size_rule_picks_reverse():
    # two outputs, three inputs: Auto's rule picks reverse mode (n > m)
    assert dxserve.resolve("auto", "jacobian", cbrt_pair, X) == JaxForward()
    J = dxserve.jacobian(fresh(cbrt_pair), "auto", X)
    d = cbrt_derivative(X)
    close(J, np.stack([d, np.cbrt(X) + X * d]))  # d/dx x∛x = ∛x + x (∛x)'
    close(J, dxserve.jacobian(cbrt_pair, "jax-forward", X))


def test_hessian_and_hvp_auto_use_forward_over_forward():
    f = fresh(cbrt_sum)
    H = dxserve.hessian(f, "auto", X)
    close(H, np.diag(cbrt_second_derivative(X)))
    close(H, dxserve.hessian(f, FOF, X))
    t = np.array([1.0, -2.0, 0.5])
    (hv,) = dxserve.hvp(f, "auto", X, (t,))
    close(hv, cbrt_second_derivative(X) * t)
    close(hv, dxserve.hvp(f, FOF, X, (t,))[0])
    g, (hv2,) = dxserve.gradient_and_hvp(f, "auto", X, (t,))
    close(g, cbrt_derivative(X))
    close(hv2, hv, 1e-15)


def test_pushforward_and_derivative_keep_forward_mode():
    f = fresh(cbrt_sum)
    (jt,) = dxserve.pushforward(f, "auto", X, (np.ones(3),))
    close(jt, np.sum(cbrt_derivative(X)))
    dc = dxserve.derivative(lambda s: newton_cbrt(s), "auto", np.asarray(2.0))
    close(dc, cbrt_derivative(np.asarray(2.0)))
    assert dxserve.resolve("auto", "pushforward", f, X, explain=True) == (
        JaxForward(), "auto's rule for pushforward: forward mode"
    )


def test_pullback_auto_falls_back_to_forward_mode():
    # forward mode cannot transpose its JVP through a loop, so it takes the pullback from
    # the pushforwards of x's basis (J^T c), as DifferentiationInterface does: exact
    f = fresh(cbrt_sum)
    chosen, reason = dxserve.resolve("auto", "pullback", f, X, explain=True)
    assert chosen == JaxForward()
    assert reason.startswith(f"reverse mode does not trace: ValueError: {WHILE}")
    assert reason.endswith("; using jax-forward")
    (vjp,) = dxserve.pullback(f, "auto", X, (np.asarray(2.0),))
    close(vjp, 2.0 * cbrt_derivative(X), 1e-12)
    close(vjp, dxserve.pullback(f, JaxForward(), X, (np.asarray(2.0),))[0], 1e-15)


def test_resolve_and_the_prep_report_say_what_was_chosen_and_why():
    f = fresh(cbrt_sum)
    chosen, reason = dxserve.resolve("auto", "gradient", f, X, explain=True)
    assert chosen == JaxForward() == dxserve.resolve("auto", "gradient", f, X)
    assert reason.startswith(f"reverse mode does not trace: ValueError: {WHILE}")
    assert reason.endswith("; using jax-forward")
    prep = dxserve.prepare_gradient(f, "auto", X)
    assert prep.resolved == JaxForward() and prep.reason == reason
    assert prep.report == {"reason": reason}
    close(dxserve.gradient(f, "auto", X, prep=prep), cbrt_derivative(X))

    chosen, reason = dxserve.resolve("auto", "hessian", f, X, explain=True)
    assert chosen == FOF
    assert reason.startswith(
        f"forward-over-reverse and reverse-over-reverse do not trace: ValueError: {WHILE}"
    )
    assert reason.endswith("; using forward-over-forward")
    assert dxserve.prepare_hessian(f, "auto", X).report == {"reason": reason}


def test_auto_on_a_function_every_mode_traces_states_its_rule():
    f = fresh(lambda x: (x**3).sum())
    assert dxserve.resolve("auto", "gradient", f, X, explain=True) == (
        JaxReverse(), "auto's rule for gradient: reverse mode"
    )
    assert dxserve.resolve("auto", "jacobian", f, X, explain=True) == (
        JaxReverse(), "auto's rule for jacobian: reverse mode (x has 3 elements, f(x) 1)"
    )
    assert dxserve.prepare_hessian(f, "auto", X).reason == (
        "auto's rule for hessian: forward-over-reverse"
    )
    # explicit backends report nothing: they were not chosen
    assert dxserve.resolve("jax-forward", "gradient", f, X, explain=True) == (JaxForward(), None)
    assert dxserve.prepare_gradient(f, "jax-forward", X).report == {}


def test_a_function_no_mode_traces_falls_back_to_finite_differences():
    f = fresh(callback_cbrt_sum)
    chosen, reason = dxserve.resolve("auto", "gradient", f, X, explain=True)
    assert chosen == FiniteDifferences()
    assert reason.startswith("reverse mode and forward mode do not trace: ValueError: Pure ")
    assert "callbacks do not support JVP" in reason
    assert reason.endswith("; using finite-differences")
    prep = dxserve.prepare_gradient(f, "auto", X)
    assert prep.resolved == FiniteDifferences() and prep.reason == reason
    g = dxserve.gradient(f, "auto", X, prep=prep)
    close(g, cbrt_derivative(X), 1e-7)  # central differences, step ∛eps
    close(g, dxserve.gradient(f, "finite-differences", X), 1e-15)

    chosen, reason = dxserve.resolve("auto", "hessian", f, X, explain=True)
    assert chosen == SecondOrder(FiniteDifferences(), FiniteDifferences())
    assert reason.startswith(
        "forward-over-reverse and reverse-over-reverse and forward-over-forward and "
        "reverse-over-forward and finite differences over reverse mode and finite "
        "differences over forward mode do not trace"
    )
    assert reason.endswith("; using finite differences over finite differences")
    H = dxserve.hessian(f, "auto", X)
    close(np.diag(H), cbrt_second_derivative(X), 1e-4)  # differences of differences


def test_a_reverse_only_function_gets_reverse_mode_for_a_pushforward():
    f = fresh(cube_sum_vjp)
    chosen, reason = dxserve.resolve("auto", "pushforward", f, X, explain=True)
    assert chosen == JaxReverse()
    assert reason == (
        "forward mode does not trace: TypeError: can't apply forward-mode autodiff (jvp) "
        "to a custom_vjp function; using jax-reverse"
    )
    t = np.array([1.0, 0.5, -1.0])
    (jt,) = dxserve.pushforward(f, "auto", X, (t,))
    close(jt, np.sum(3 * X**2 * t))


def test_a_prep_reused_does_not_probe_again():
    traces = []

    def f(x):
        traces.append(1)  # runs when JAX traces f, never when a compiled program runs
        return cbrt_sum(x)

    g = dxserve.gradient(f, "auto", X)
    probed = len(traces)
    assert probed >= 2  # probed, then reverse mode tried, then forward mode compiled
    for _ in range(3):
        close(dxserve.gradient(f, "auto", X), g, 0)
    assert len(traces) == probed
    prep = dxserve.prepare_gradient(f, "auto", X)
    prepared = len(traces)
    for _ in range(3):
        close(dxserve.gradient(f, "auto", X, prep=prep), g, 0)
    assert len(traces) == prepared


@pytest.mark.parametrize(
    ("operator", "backend", "args", "asked", "use"),
    [
        ("gradient", "jax-reverse", (), "jax-reverse cannot compute gradient", "'jax-forward'"),
        ("hessian", "jax-reverse", (), "jax-reverse (as {", '"outer":"jax-forward","inner":"jax-forward"}'),
        ("pullback", "jax-reverse", ((np.asarray(1.0),),), "jax-reverse cannot compute pullback",
         "'jax-forward'"),
    ],
)  # fmt: skip
def test_explicit_backends_still_fail_naming_themselves_and_what_works(
    operator, backend, args, asked, use
):
    with pytest.raises(UnsupportedOperatorError) as info:
        getattr(dxserve, operator)(fresh(cbrt_sum), backend, X, *args)
    err = info.value
    assert err.field == "backend"
    assert err.detail.startswith(asked), err.detail
    assert WHILE in err.detail and use in err.detail and "'auto'" in err.detail


def _sin_grad_on_host(x):
    x = np.asarray(x)
    return np.cos(x).astype(x.dtype)


@jax.custom_vjp
def sin_sum_host_gradient(x):
    """sum(sin x), whose gradient cos x comes from numpy (a callback): no JAX mode
    differentiates the gradient, and forward mode refuses the custom_vjp."""
    return jnp.sum(jnp.sin(x))


def _fwd(x):
    return jnp.sum(jnp.sin(x)), x


def _bwd(x, ct):
    grad = jax.pure_callback(
        _sin_grad_on_host, jax.ShapeDtypeStruct(x.shape, x.dtype), x, vmap_method="sequential"
    )
    return (ct * grad,)


sin_sum_host_gradient.defvjp(_fwd, _bwd)


def test_second_order_auto_prefers_differences_of_an_exact_gradient():
    """No pair of JAX's modes reaches second order here; reverse mode's gradient is
    exact, so auto takes finite differences of it, not differences of differences."""
    f = fresh(sin_sum_host_gradient)
    chosen, reason = dxserve.resolve("auto", "hessian", f, X, explain=True)
    assert chosen == SecondOrder(FiniteDifferences(), JaxReverse())
    assert reason.endswith("; using finite differences over reverse mode"), reason
    H = dxserve.hessian(f, "auto", X)
    np.testing.assert_allclose(H, np.diag(-np.sin(X)), rtol=1e-7, atol=1e-7)
    t = np.array([1.0, -2.0, 0.5])
    (hv,) = dxserve.hvp(f, "auto", X, (t,))
    want = -np.sin(X) * t
    close(hv, want, 1e-7)
    fd_fd = dxserve.hvp(f, SecondOrder(FiniteDifferences(), FiniteDifferences()), X, (t,))[0]
    # one difference's error against two (measured: 0 against 1.4e-6 here)
    assert 10 * np.abs(hv - want).max() <= np.abs(fd_fd - want).max()
