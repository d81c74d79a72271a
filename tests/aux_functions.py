"""Functions returning ``(output, aux)``, for the has_aux tests in process and served.

Each aux is a pytree of several kinds (dicts, tuples, lists, None, int and float arrays)
so every encoding's sequence nodes and dtypes are crossed. ``tests/library/test_aux.py``
calls them in process and the HTTP tests serve them with ``--functions tests.aux_functions``.
Module functions also carry malformed ones: a has_aux call on them must answer 422.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import dxserve

X3 = np.array([0.3, -0.7, 1.1])


@dxserve.function(example=(X3,))
def aux_scalar(x):
    """R^3 -> R with an aux of every node kind: a dict of a tuple, a list, None and an int."""
    y = jnp.sum(jnp.sin(x) * x) + x[0] * x[1]
    aux = {
        "norm": jnp.sqrt(jnp.sum(x**2)),
        "parts": (x**2, [jnp.cumsum(x), None]),
        "count": jnp.asarray(x.shape[0], jnp.int32),
    }
    return y, aux


@dxserve.function(example=(X3,))
def aux_vector(x):
    """R^3 -> R^3 with a list aux."""
    return jnp.sin(x) * jnp.cumsum(x), [jnp.sum(x), {"max": jnp.max(x)}]


@dxserve.function(example=(np.float64(0.4),))
def aux_curve(x):
    """R -> R^2 (scalar x) with a tuple aux."""
    return jnp.stack([jnp.sin(x), x**3]), (x**2, jnp.cos(x))


@dxserve.function(example=(X3, np.array([2.0, -1.0, 0.5])))
def aux_context(x, a):
    """R^3 -> R with a context; aux depends on x and the context."""
    return jnp.sum(a * x**2), {"ax": a * x}


def aux_numpy(x):
    """A black box (numpy, not traceable by JAX) R^3 -> R with a dict aux."""
    x = np.asarray(x)
    return np.sum(np.sin(x) * x) + x[0] * x[1], {"norm": np.sqrt(np.sum(x**2))}


@dxserve.function(example=(X3,))
def no_pair(x):
    """Returns its output alone: a has_aux call must be refused."""
    return jnp.sum(x**2)


@dxserve.function(example=(X3,))
def triple(x):
    """Returns three things: not a pair."""
    return jnp.sum(x**2), x, x


@dxserve.function(example=(X3,))
def vector_pair(x):
    """A pair whose output is a vector: has_aux gradient must still say 'scalar'."""
    return x**2, jnp.sum(x)
