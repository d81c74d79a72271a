"""The operator table is the one source of each operator's facts; what is derived agrees.

``_operators.py`` (the client's methods) is generated from it, the OpenAPI models take
their examples from it, and the server sizes results with ``result_elements``.
"""

from __future__ import annotations

import inspect
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import dxserve
from dxclient import AsyncClient, Client, _gen, _models
from dxcontract.operators import BATCH_RESULTS, OPERATORS


def test_generated_operator_methods_are_current() -> None:
    assert _gen.TARGET.read_text(encoding="utf-8") == _gen.render(), (
        "clients/python/dxclient/_operators.py is stale: run `python -m dxclient._gen`"
    )
    assert _gen.main(["--check"]) == 0


@pytest.mark.parametrize("cls", [Client, AsyncClient])
def test_client_methods_follow_the_table(cls: type) -> None:
    for name, op in OPERATORS.items():
        for method_name in (name, f"prepare_{name}"):
            method = getattr(cls, method_name)
            params = list(inspect.signature(method).parameters)
            assert params[:4] == ["self", "f", "backend", "x"], method_name
            assert ("tangents" in params) == op.takes_tangents, method_name
            assert ("prep" in params) == (method_name == name), method_name
        assert getattr(cls, name).__doc__ == op.summary
    # JAX's names are not aliases: their return shapes would differ from jax.jvp/jax.vjp
    assert not hasattr(cls, "jvp") and not hasattr(cls, "vjp")


def test_submit_methods_follow_the_table() -> None:
    """``client.submit.<op>`` (generated with the operator methods): every operator, its
    positional arguments, no ``prep`` (a job may run in another process)."""
    submitter = type(Client("http://127.0.0.1:9").submit)
    for name, op in OPERATORS.items():
        params = list(inspect.signature(getattr(submitter, name)).parameters)
        assert params[:4] == ["self", "f", "backend", "x"], name
        assert ("tangents" in params) == op.takes_tangents, name
        assert "prep" not in params and "batch_axis" in params, name
        assert op.summary in getattr(submitter, name).__doc__


def test_specs_are_consistent() -> None:
    families = {op.family for op in OPERATORS.values()}
    assert families <= set(OPERATORS), "each family is itself an operator"
    for name, op in OPERATORS.items():
        assert op.name == name and op.summary and op.results
        assert op.takes_tangents == (op.tangents_like is not None)
        assert op.batch_results <= set(op.results)
        assert bool(op.batch_results) == op.takes_tangents, name
        assert ("tangents" in op.example) == op.takes_tangents
        assert OPERATORS[op.family].tangents_like == op.tangents_like
    assert _models.BATCH_RESULTS == BATCH_RESULTS == {"pushforwards", "pullbacks", "hvps"}
    assert {op.tangents_like for op in OPERATORS.values()} == {None, "x", "y"}
    assert OPERATORS["pullback"].tangents_like == "y"
    assert OPERATORS["hvp"].tangents_like == OPERATORS["pushforward"].tangents_like == "x"


def _vector(x: Any) -> Any:  # R^n -> R^2
    return jnp.stack([jnp.sum(x**2), jnp.prod(jnp.sin(x))])


def _scalar(x: Any) -> Any:  # R^n -> R
    return jnp.sum(jnp.sin(x) * x)


def _curve(x: Any) -> Any:  # R -> R^2
    return jnp.stack([jnp.sin(x), x**3])


# The widest operator of each family (every result the family computes), a function,
# x, and y's size.
_FAMILY_CASES = {
    "value": ("value", _vector, np.linspace(0.1, 0.9, 3), 2),
    "derivative": ("value_and_derivative", _curve, np.float64(0.3), 2),
    "second_derivative": ("value_derivative_and_second_derivative", _curve, np.float64(0.3), 2),
    "gradient": ("value_and_gradient", _scalar, np.linspace(0.1, 0.9, 3), 1),
    "jacobian": ("value_and_jacobian", _vector, np.linspace(0.1, 0.9, 3), 2),
    "hessian": ("value_gradient_and_hessian", _scalar, np.linspace(0.1, 0.9, 3), 1),
    "pushforward": ("value_and_pushforward", _vector, np.linspace(0.1, 0.9, 3), 2),
    "pullback": ("value_and_pullback", _vector, np.linspace(0.1, 0.9, 3), 2),
    "hvp": ("gradient_and_hvp", _scalar, np.linspace(0.1, 0.9, 3), 1),
    # the pattern: the table bounds it by m * n (the dense shape; a BCOO's size)
    "sparsity": ("sparsity", _vector, np.linspace(0.1, 0.9, 3), 2),
}


def _count(result: Any) -> int:
    if isinstance(result, tuple):
        return sum(_count(r) for r in result)
    return int(np.size(result))


@pytest.mark.parametrize("family", sorted(_FAMILY_CASES))
def test_result_elements_count_what_the_family_computes(family: str) -> None:
    """``result_elements(n, m, k)`` is the numbers the family's widest operator returns."""
    name, f, x, m = _FAMILY_CASES[family]
    op = OPERATORS[name]
    assert op.family == family and set(_FAMILY_CASES) == {s.family for s in OPERATORS.values()}
    n, k = int(np.size(x)), 2
    args: list[Any] = [f, "auto", x]
    if op.takes_tangents:
        shape = (m,) if op.tangents_like == "y" else np.shape(x)
        args.append(tuple(np.full(shape, float(i + 1)) for i in range(k)))
    result = getattr(dxserve, name)(*args)
    assert _count(result) == op.result_elements(n, m, k if op.takes_tangents else 0)
    for other in OPERATORS.values():  # the family's other operators share the rule
        if other.family == family:
            assert other.result_elements(n, m, k) == op.result_elements(n, m, k)


def test_result_elements_grow_as_the_limit_expects() -> None:
    assert OPERATORS["jacobian"].result_elements(1000, 1000, 0) == 1000 * 1000 + 1000
    assert OPERATORS["hessian"].result_elements(1000, 1, 0) == 1000 * 1000 + 1000 + 1
    assert OPERATORS["pullback"].result_elements(10, 3, 4) == 4 * 10 + 3
    assert OPERATORS["value_and_pushforward"].result_elements(10, 3, 4) == 5 * 3
