"""Typed PRNG keys in process: contexts of every operator, per implementation, checked
against the analytic derivatives of the ``noisy`` example; keys as x refused.

The draws ``z = jax.random.normal(key, x.shape, x.dtype)`` are data to the references
(``tests/references.py``): nothing there is differentiated by JAX.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dxserve
from dxcontract.errors import InvalidArgumentError, PreparationMismatchError
from dxcontract.keys import KeyArray
from dxserve.examples import noisy
from tests.key_functions import noisy_keys, noisy_step, noisy_tree
from tests.references import noisy_gradient, noisy_hessian, noisy_value

IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
X = np.array([0.5, -1.25, 2.0])


def draws(key: jax.Array, x: np.ndarray) -> np.ndarray:
    """The normal draws ``noisy`` makes with ``key``, in x's dtype (float64)."""
    with dxserve.float64_scope():
        return np.asarray(jax.random.normal(key, x.shape, x.dtype))


@pytest.mark.parametrize("impl", IMPLS)
def test_every_operator_takes_a_key_context(impl: str) -> None:
    key = jax.random.key(11, impl=impl)
    z = draws(key, X)
    np.testing.assert_allclose(dxserve.value(noisy, "auto", X, key), noisy_value(X, z), rtol=1e-12)
    for backend in ("jax-reverse", "jax-forward", "finite-differences"):
        g = dxserve.gradient(noisy, backend, X, key)
        rtol = 1e-6 if backend == "finite-differences" else 1e-12
        np.testing.assert_allclose(g, noisy_gradient(X, z), rtol=rtol)
    np.testing.assert_allclose(dxserve.hessian(noisy, "auto", X, key), noisy_hessian(X, z),
                               rtol=1e-12, atol=1e-15)
    t = (np.array([1.0, 0.0, -1.0]), np.array([0.25, 2.0, 0.5]))
    hvps = dxserve.hvp(noisy, "auto", X, t, key)
    for got, tangent in zip(hvps, t, strict=True):
        np.testing.assert_allclose(got, noisy_hessian(X, z) @ tangent, rtol=1e-12, atol=1e-15)
    (pf,) = dxserve.pushforward(noisy, "auto", X, t[:1], key)
    np.testing.assert_allclose(pf, noisy_gradient(X, z) @ t[0], rtol=1e-12)
    # the key is data: another key, other draws, another gradient
    other = draws(jax.random.key(12, impl=impl), X)
    assert not np.allclose(other, z)
    np.testing.assert_allclose(
        dxserve.gradient(noisy, "auto", X, jax.random.key(12, impl=impl)),
        noisy_gradient(X, other), rtol=1e-12,
    )


def test_arrays_and_pytrees_of_keys() -> None:
    keys = jax.random.split(jax.random.key(3), 5)
    with dxserve.float64_scope():  # as the function draws them
        z = np.asarray(jax.vmap(lambda k: jax.random.normal(k, X.shape, X.dtype))(keys))
    z = z.mean(axis=0)
    np.testing.assert_allclose(dxserve.gradient(noisy_keys, "auto", X, keys),
                               noisy_gradient(X, z), rtol=1e-12)
    key = jax.random.key(4, impl="rbg")
    state = {"key": key, "scale": np.array(0.1)}
    np.testing.assert_allclose(dxserve.gradient(noisy_tree, "auto", X, state),
                               noisy_gradient(X, draws(key, X)), rtol=1e-12)


def test_a_key_comes_back_from_value() -> None:
    key = jax.random.key(5)
    y, new_key = dxserve.value(noisy_step, "auto", X, key)
    want_key, sub = jax.random.split(key)
    np.testing.assert_allclose(y, noisy_value(X, draws(sub, X)), rtol=1e-12)
    assert jax.dtypes.issubdtype(new_key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(new_key), jax.random.key_data(want_key))


def test_batch_axis_shares_the_key() -> None:
    key = jax.random.key(6)
    xs = np.stack([X, 2 * X, -X])
    G = dxserve.gradient(noisy, "auto", xs, key, batch_axis=0)
    z = draws(key, X)
    for row, x in zip(G, xs, strict=True):
        np.testing.assert_allclose(row, noisy_gradient(x, z), rtol=1e-12)


def test_a_prep_is_for_one_implementation() -> None:
    key = jax.random.key(7)
    prep = dxserve.prepare_gradient(noisy, "auto", X, key)
    other = jax.random.key(8)
    np.testing.assert_array_equal(dxserve.gradient(noisy, "auto", X, other, prep=prep),
                                  dxserve.gradient(noisy, "auto", X, other))
    with pytest.raises(PreparationMismatchError, match="key<rbg> differs from prepared "
                       "key<threefry2x32>") as err:
        dxserve.gradient(noisy, "auto", X, jax.random.key(8, impl="rbg"), prep=prep)
    assert err.value.field == "contexts[0]"


@pytest.mark.parametrize("operator", ["value", "gradient", "hessian", "jacobian"])
def test_a_key_as_x_is_refused_naming_x(operator: str) -> None:
    with pytest.raises(InvalidArgumentError, match="Pass the key as a context") as err:
        getattr(dxserve, operator)(lambda k, x: jnp.sum(x), "auto", jax.random.key(0), X)
    assert err.value.field == "x" and "key<threefry2x32>" in err.value.detail
    with pytest.raises(InvalidArgumentError) as err:  # in a pytree x too
        dxserve.gradient(lambda p: jnp.sum(p["w"]), "auto", {"w": X, "k": jax.random.key(0)})
    assert err.value.field == "x"


def test_a_key_as_tangent_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="typed PRNG key") as err:
        dxserve.pushforward(noisy, "auto", X, (np.ones(3), jax.random.key(0)), jax.random.key(1))
    assert err.value.field == "tangents[1]"


def test_the_wire_key_is_not_a_jax_key_in_process() -> None:
    with pytest.raises(InvalidArgumentError, match="wrap_key_data") as err:
        dxserve.value(noisy, "auto", X, KeyArray("threefry2x32", [0, 0]))
    assert err.value.field == "contexts[0]"
