"""One conformance grid for every door: the same drawn functions through each way in.

Hypothesis draws a function as in the dtype grid (``tests/library/test_dtype_grid.py``:
a random ``jnp`` composition of a vector x, float32 or float64, sometimes scaled by an
int32 context ``k`` or a float context ``s``). Each operator that applies (``gradient``
for a scalar function; ``jacobian``, ``pushforward``, ``pullback`` for an array one;
with ``s``, the gradient in x and s and the Jacobian in s: ``wrt``, JAX's ``argnums``)
then goes through every
door that offers it, and each answer is checked against JAX's own transformation of
the same function in the same dtype, with the dtype grid's bounds:

* ``in process``: ``dxserve.<op>(f, "auto", ...)``;
* ``nested``: the operator inside ``jax.vmap`` (scalar) or ``dxserve.value`` under
  ``jax.jacfwd``/``jax.jvp``/``jax.vjp`` (array);
* ``DifferentiateWith``: ``DifferentiateWith(f, "auto")`` under JAX's transformation;
* ``client``: the function registered as an expression, called through ``Client``;
* ``upload``: the function exported with ``client.register`` (``jax.export``);
* ``remote_function``: the expression under JAX's transformation (``dxclient.jax``);
* ``job``: the client's call as a detached job (``client.submit``).

A door added later joins ``DOORS``. ``make test`` draws ``FAST`` examples
(derandomized), ``make test-slow`` ``LONG``; the table of what was drawn (door x dtype
x operator) is printed at the end of the module.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dxserve
from dxclient import Client
from dxclient.jax import remote_function
from dxserve.frameworks.jax.expressions import compile_expression
from tests.library.test_dtype_grid import _check, _compositions

DTYPES = [np.dtype(np.float32), np.dtype(np.float64)]
FAST, LONG = 3, 40  # make test: 3 derandomized examples (each compiles every door)
FAST_TIMEOUT, LONG_TIMEOUT = 900, 3000
TABLE: Counter = Counter()  # (door, dtype, operator) -> examples checked


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(1, 5))
    body = draw(_compositions())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    context = draw(st.sampled_from(["none", "int", "float"]))  # what scales every term
    if context != "none":
        body = f"({body} * {'k' if context == 'int' else 's'})"
    scalar = draw(st.booleans())
    text = f"jnp.sum({body})" if scalar else body

    def sample() -> np.ndarray:
        return rng.uniform(-1, 1, n).astype(dtype)

    contexts = {
        "none": (),
        "int": (rng.integers(1, 4, n).astype(np.int32),),
        "float": (rng.uniform(0.5, 1.5, n).astype(dtype),),  # differentiated with wrt
    }[context]
    args = {"none": ["x"], "int": ["x", "k"], "float": ["x", "s"]}[context]
    return {
        "dtype": dtype,
        "text": text,
        "scalar": scalar,
        "x": sample(),
        "t": sample(),
        "w": sample(),
        "args": args,
        "contexts": contexts,
    }


def _references(case: dict[str, Any], f: Callable) -> dict[str, Any]:
    x, t, w, c = case["x"], case["t"], case["w"], case["contexts"]
    float_context = case["args"] == ["x", "s"]
    if case["scalar"]:
        refs = {"gradient": jax.grad(f)(x, *c)}
        if float_context:  # with respect to x and the context: wrt / argnums (0, 1)
            refs["gradient wrt (0, 1)"] = jax.grad(f, (0, 1))(x, *c)
        return refs
    refs = {
        "jacobian": jax.jacfwd(f)(x, *c),
        "pushforward": jax.jvp(lambda u: f(u, *c), (x,), (t,))[1],
        "pullback": jax.vjp(lambda u: f(u, *c), x)[1](w)[0],
    }
    if float_context:  # with respect to the context alone: wrt / argnums 1
        refs["jacobian wrt 1"] = jax.jacfwd(f, 1)(x, *c)
    return refs


#: the ``wrt`` (argnums) of an operator's name in the grid
WRT = {"gradient wrt (0, 1)": (0, 1), "jacobian wrt 1": 1}


def _served(call: Callable[..., Any]) -> Callable[[dict[str, Any], str], Any]:
    """A door through ``call(op, x, tangents or None, *contexts)`` (the client's shape)."""

    def door(case: dict[str, Any], op: str) -> Any:
        x, c = case["x"], case["contexts"]
        if op == "pushforward":
            return call(op, x, (case["t"],), *c)[0]
        if op == "pullback":
            return call(op, x, (case["w"],), *c)[0]
        if op in WRT:
            return call(op.split()[0], x, None, *c, wrt=WRT[op])
        return call(op, x, None, *c)

    return door


def _traced(g: Callable) -> Callable[[dict[str, Any], str], Any]:
    """A door through JAX's transformations of the JAX-callable ``g(x, *contexts)``."""

    def door(case: dict[str, Any], op: str) -> Any:
        x, t, w, c = case["x"], case["t"], case["w"], case["contexts"]
        if op == "gradient":
            return jax.grad(g)(x, *c)
        if op == "jacobian":
            return jax.jacfwd(g)(x, *c)
        if op in WRT:
            transform = jax.grad if op.startswith("gradient") else jax.jacfwd
            return transform(g, WRT[op])(x, *c)
        if op == "pushforward":
            return jax.jvp(lambda u: g(u, *c), (x,), (t,))[1]
        return jax.vjp(lambda u: g(u, *c), x)[1](w)[0]

    return door


def _in_process(f: Callable) -> Callable[[dict[str, Any], str], Any]:
    return _served(
        lambda op, x, tangents, *c, wrt=None: getattr(dxserve, op)(
            f, "auto", x, *(() if tangents is None else (tangents,)), *c, wrt=wrt
        )
    )


def _nested(f: Callable) -> Callable[[dict[str, Any], str], Any]:
    def door(case: dict[str, Any], op: str) -> Any:
        c = case["contexts"]
        if op in ("gradient", "gradient wrt (0, 1)"):  # the operator itself under vmap
            wrt = WRT.get(op)
            return jax.tree.map(
                lambda v: v[0],
                jax.vmap(lambda u: dxserve.gradient(f, "auto", u, *c, wrt=wrt))(case["x"][None]),
            )
        return _traced(lambda u, *c: dxserve.value(f, "auto", u, *c))(case, op)

    return door


def _client(client: Client, name: str) -> Callable[[dict[str, Any], str], Any]:
    return _served(
        lambda op, x, tangents, *c, wrt=None: getattr(client, op)(
            name, "auto", x, *(() if tangents is None else (tangents,)), *c, wrt=wrt
        )
    )


def _job(client: Client, name: str) -> Callable[[dict[str, Any], str], Any]:
    return _served(
        lambda op, x, tangents, *c, wrt=None: getattr(client.submit, op)(
            name, "auto", x, *(() if tangents is None else (tangents,)), *c, wrt=wrt
        ).result(progress=False)
    )


@pytest.fixture(scope="module")
def client(server) -> Iterator[Client]:
    with Client(server.url) as c:
        yield c


def _doors(
    client: Client, case: dict[str, Any], f: Callable, name: str, uploaded: str
) -> dict[str, Callable[[dict[str, Any], str], Any]]:
    return {
        "in process": _in_process(f),
        "nested": _nested(f),
        "DifferentiateWith": _traced(dxserve.DifferentiateWith(f, "auto")),
        "client": _client(client, name),
        "upload": _client(client, uploaded),
        "remote_function": _traced(remote_function(client, name)),
        "job": _job(client, name),
    }


def run_doors(client: Client, case: dict[str, Any]) -> None:
    f = compile_expression(case["text"], case["args"])
    tag = abs(hash((case["text"], case["dtype"].name, case["x"].size))) % 10**12
    name, uploaded = f"doors_{tag}", f"doors_up_{tag}"
    client.register_expression(name, case["text"], case["args"], replace=True)
    client.register(f, case["x"], *case["contexts"], name=uploaded, replace=True)
    try:
        with jax.enable_x64(True):
            wants = _references(case, f)
            for door, through in _doors(client, case, f, name, uploaded).items():
                for op, want in wants.items():
                    _check(case, op, door, "auto", through(case, op), want)
                    TABLE[door, case["dtype"].name, op] += 1
    finally:
        client.delete(name)
        client.delete(uploaded)


@pytest.mark.timeout(FAST_TIMEOUT)
@settings(
    max_examples=FAST,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=cases())
def test_every_door_agrees_with_jax(client: Client, case: dict[str, Any]) -> None:
    run_doors(client, case)


@pytest.mark.slow
@pytest.mark.timeout(LONG_TIMEOUT)
@settings(
    max_examples=LONG,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=cases())
def test_every_door_agrees_with_jax_long(client: Client, case: dict[str, Any]) -> None:
    run_doors(client, case)


def table() -> str:
    """The examples checked, door x dtype x operator, as a text table."""
    ops = sorted({op for _, _, op in TABLE})
    rows = sorted({(door, dtype) for door, dtype, _ in TABLE})
    lines = [" | ".join(["door", "dtype", *ops])]
    lines += [
        " | ".join([door, dtype, *(str(TABLE[door, dtype, op]) for op in ops)])
        for door, dtype in rows
    ]
    return "\n".join(lines)


def teardown_module() -> None:
    print("\nexamples checked per door, dtype and operator:\n" + table())
