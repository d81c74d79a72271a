"""Any pytree as x, outputs and contexts; Jacobian and Hessian blocks; structured expressions.

Scenarios (``tests/pytree_functions.py``): dicts, tuples, lists, nestings, None nodes,
pytree outputs and pytree contexts. References are JAX's own (``jax.grad``,
``jax.jacobian``, ``jax.hessian``, ``jax.jvp``, ``jax.vjp`` of the same function) run in
float64; results must have exactly their structure (tuples stay tuples, lists lists)
and match at rtol 1e-10, in process and through the client in every encoding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fastapi.testclient import TestClient

import dxserve
from dxclient import Client
from dxcontract.codec import BINARY_TYPE, HEADER_LENGTH
from dxcontract.errors import (
    InvalidArgumentError,
    ResultTooLargeError,
    UnsupportedOperatorError,
)
from dxserve import JaxForward, JaxReverse, SecondOrder
from dxserve.core.preparation import prepare
from dxserve.http import create_app
from dxserve.settings import Settings
from tests import pytree_functions as pf

RTOL, ATOL = 1e-10, 1e-12
ENCODINGS = ("json", "b64", "binary")
tmap = jax.tree_util.tree_map


# --- references and comparison ------------------------------------------------------------
def _jax_args(s: pf.Scenario) -> tuple[Any, tuple]:
    return tmap(jnp.asarray, s.x), tmap(jnp.asarray, s.contexts)


def reference(s: pf.Scenario, op: str, tangent: Any = None) -> Any:
    """``op`` of scenario ``s`` by JAX itself, in float64."""
    with jax.enable_x64(True):
        x, ctx = _jax_args(s)

        def g(u: Any) -> Any:
            return s.f(u, *ctx)

        out = {
            "value": lambda: g(x),
            "gradient": lambda: jax.grad(g)(x),
            "jacobian": lambda: jax.jacobian(g)(x),
            "hessian": lambda: jax.hessian(g)(x),
            "pushforward": lambda: jax.jvp(g, (x,), (tmap(jnp.asarray, tangent),))[1],
            "pullback": lambda: jax.vjp(g, x)[1](tmap(jnp.asarray, tangent))[0],
            "hvp": lambda: jax.jvp(jax.grad(g), (x,), (tmap(jnp.asarray, tangent),))[1],
        }[op]()
        return tmap(np.asarray, out)


def assert_tree_close(got: Any, want: Any, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Same structure (tuple vs list vs dict, None nodes) and close leaves."""
    got_def, want_def = jax.tree_util.tree_structure(got), jax.tree_util.tree_structure(want)
    assert got_def == want_def, f"structure {got_def} != {want_def}"
    for a, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert np.shape(a) == np.shape(e)
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


def _like(tree: Any, seed: int) -> Any:
    r = np.random.default_rng(seed)
    return tmap(lambda leaf: r.normal(size=np.shape(leaf)), tree)


def _y_like(s: pf.Scenario, seed: int) -> Any:
    return _like(jax.eval_shape(s.f, s.x, *s.contexts), seed)


SCALAR = [s for s in pf.SCENARIOS if s.scalar]
VECTOR = [s for s in pf.SCENARIOS if not s.scalar]
IDS = lambda s: s.name  # noqa: E731


def test_at_least_eight_structured_scenarios() -> None:
    assert len(pf.SCENARIOS) >= 8
    assert {"pt_tuple_scalar", "pt_list_scalar", "pt_nested_scalar", "pt_dict_to_dict"} <= set(
        pf.BY_NAME
    )


# --- in process -----------------------------------------------------------------------------
@pytest.mark.parametrize("s", SCALAR, ids=IDS)
def test_scalar_scenarios_in_process(s: pf.Scenario) -> None:
    f, x, ctx = s.f, s.x, s.contexts
    t = _like(x, 1)
    assert_tree_close(dxserve.value(f, "auto", x, *ctx), reference(s, "value"))
    assert_tree_close(dxserve.gradient(f, JaxReverse(), x, *ctx), reference(s, "gradient"))
    assert_tree_close(dxserve.gradient(f, JaxForward(), x, *ctx), reference(s, "gradient"))
    for b in (JaxForward(), JaxReverse()):
        assert_tree_close(dxserve.jacobian(f, b, x, *ctx), reference(s, "jacobian"))
    H = reference(s, "hessian")
    for b in ("auto", SecondOrder(JaxReverse(), JaxReverse())):
        assert_tree_close(dxserve.hessian(f, b, x, *ctx), H)
    v, g, h = dxserve.value_gradient_and_hessian(f, "auto", x, *ctx)
    assert_tree_close((v, g, h), (reference(s, "value"), reference(s, "gradient"), H))
    (hv,) = dxserve.hvp(f, "auto", x, (t,), *ctx)
    assert_tree_close(hv, reference(s, "hvp", t))
    (pf_,) = dxserve.pushforward(f, "jax-reverse", x, (t,), *ctx)
    assert_tree_close(pf_, reference(s, "pushforward", t))


@pytest.mark.parametrize("s", VECTOR, ids=IDS)
def test_pytree_valued_scenarios_in_process(s: pf.Scenario) -> None:
    f, x, ctx = s.f, s.x, s.contexts
    J = reference(s, "jacobian")
    for b in (JaxForward(), JaxReverse(), JaxForward(batch_size=2)):
        assert_tree_close(dxserve.jacobian(f, b, x, *ctx), J)
    v, j = dxserve.value_and_jacobian(f, "auto", x, *ctx)
    assert_tree_close((v, j), (reference(s, "value"), J))
    t, c = _like(x, 2), _y_like(s, 3)
    (jt,) = dxserve.pushforward(f, "jax-reverse", x, (t,), *ctx)  # transposed VJP
    assert_tree_close(jt, reference(s, "pushforward", t))
    (ct,) = dxserve.pullback(f, "jax-forward", x, (c,), *ctx)  # transposed JVP
    assert_tree_close(ct, reference(s, "pullback", c))
    # finite differences reach the same blocks through the engine fallbacks
    assert_tree_close(dxserve.jacobian(f, "finite-differences", x, *ctx), J, 1e-6, 1e-7)


def test_block_shapes_are_out_leaf_by_in_leaf() -> None:
    s = pf.BY_NAME["pt_dict_to_dict"]
    J = dxserve.jacobian(s.f, "auto", s.x)
    assert J["a"]["u"].shape == (3, 3) and J["a"]["v"].shape == (3, 2)
    assert J["b"]["u"].shape == (3,) and J["b"]["v"].shape == (2,)
    s = pf.BY_NAME["pt_nested_scalar"]
    H = dxserve.hessian(s.f, "auto", s.x)
    assert H["layers"][0][0]["scale"].shape == (2, 3)
    assert H["scale"]["layers"][1][0].shape == (3, 1)
    assert isinstance(H["layers"], list) and isinstance(H["layers"][0], tuple)


def test_result_limit_counts_every_block() -> None:
    s = pf.BY_NAME["pt_dict_to_dict"]  # n = 5, m = 4: 20 block entries + the value's 4
    prep = prepare("jacobian", s.f, "auto", s.x, None, (), None, 24)
    assert prep is not None
    with pytest.raises(ResultTooLargeError):
        prepare("jacobian", s.f, "auto", s.x, None, (), None, 23)


def test_sparse_refuses_pytrees_clearly() -> None:
    s = pf.BY_NAME["pt_dict_to_dict"]
    with pytest.raises(UnsupportedOperatorError) as info:
        dxserve.jacobian(s.f, dxserve.Sparse(), s.x)
    assert info.value.field == "x" and "pytree" in info.value.detail


def test_unknown_leaf_in_process_names_its_path() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        dxserve.gradient(pf.pt_dict_scalar, "auto", {"w": np.ones((3, 2)), "b": [object()]})
    assert info.value.field == "x.b[0]"


def test_lists_of_numbers_are_still_arrays() -> None:
    g = dxserve.gradient(lambda x: jnp.sum(x**2), "auto", [1.0, 2.0, 3.0])
    np.testing.assert_allclose(np.asarray(g), [2.0, 4.0, 6.0])


# --- over HTTP ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    store = tmp_path_factory.mktemp("pytree-store")
    settings = Settings(
        store=store, compilation_cache="", functions=["tests.pytree_functions"], warm_up=False
    )
    with TestClient(create_app(settings)) as client:
        yield client


def _client(http: TestClient, encoding: str) -> Client:
    return Client(
        http=httpx.Client(transport=http._transport, base_url="http://testserver"),
        encoding=encoding,
    )


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("s", pf.SCENARIOS, ids=IDS)
def test_scenarios_through_the_client(http: TestClient, s: pf.Scenario, encoding: str) -> None:
    client = _client(http, encoding)
    x, ctx = s.x, s.contexts
    assert_tree_close(client.value(s.name, "auto", x, *ctx), reference(s, "value"))
    assert_tree_close(client.jacobian(s.name, "auto", x, *ctx), reference(s, "jacobian"))
    if s.scalar:
        v, g = client.value_and_gradient(s.name, "jax-reverse", x, *ctx)
        assert_tree_close((v, g), (reference(s, "value"), reference(s, "gradient")))
        assert_tree_close(client.hessian(s.name, "auto", x, *ctx), reference(s, "hessian"))
        t = _like(x, 4)
        (hv,) = client.hvp(s.name, "auto", x, (t,), *ctx)
        assert_tree_close(hv, reference(s, "hvp", t))
    else:
        v, j = client.value_and_jacobian(s.name, "jax-reverse", x, *ctx)
        assert_tree_close((v, j), (reference(s, "value"), reference(s, "jacobian")))
        c = _y_like(s, 5)
        (ct,) = client.pullback(s.name, "auto", x, (c,), *ctx)
        assert_tree_close(ct, reference(s, "pullback", c))


# --- the MLP: a list of layer dicts -----------------------------------------------------------
def adam(value_and_grad: Callable[[Any], tuple[Any, Any]], params: Any, steps: int = 50,
         lr: float = 0.05) -> tuple[float, Any]:
    """Adam in numpy over any pytree: ``(loss after the last step, params)``."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    m = tmap(np.zeros_like, params)
    v = tmap(np.zeros_like, params)
    for k in range(1, steps + 1):
        _, g = value_and_grad(params)
        g = tmap(np.asarray, g)
        m = tmap(lambda m_, g_: b1 * m_ + (1 - b1) * g_, m, g)
        v = tmap(lambda v_, g_: b2 * v_ + (1 - b2) * g_**2, v, g)
        c1, c2 = 1 - b1**k, 1 - b2**k  # bias corrections
        params = tmap(
            lambda p, m_, v_, c1=c1, c2=c2: p - lr * (m_ / c1) / (np.sqrt(v_ / c2) + eps),
            params, m, v,
        )
    loss, _ = value_and_grad(params)
    return float(loss), params


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_mlp_gradient_and_adam_through_the_client(http: TestClient, encoding: str) -> None:
    s = pf.BY_NAME["pt_mlp_loss"]
    X, y = s.contexts
    client = _client(http, encoding)
    g = client.gradient("pt_mlp_loss", "jax-reverse", s.x, X, y)
    assert isinstance(g, list) and set(g[0]) == {"W", "b"}
    assert_tree_close(g, reference(s, "gradient"))

    remote, remote_params = adam(
        lambda p: client.value_and_gradient("pt_mlp_loss", "jax-reverse", p, X, y), s.x
    )
    local, local_params = adam(
        lambda p: dxserve.value_and_gradient(pf.pt_mlp_loss, "jax-reverse", p, X, y), s.x
    )
    assert abs(remote - local) <= 1e-10
    assert remote < 0.5 * float(pf.pt_mlp_loss(s.x, X, y))  # it did train
    assert_tree_close(remote_params, local_params, rtol=1e-9, atol=1e-12)


# --- the wire format --------------------------------------------------------------------------
def test_json_marker_format(http: TestClient) -> None:
    body = {
        "function": "pt_tuple_scalar", "backend": "jax-reverse",
        "x": {"__tuple__": [[0.1, 0.2, 0.3], 0.7]},
    }
    r = http.post("/gradient", json=body)
    assert r.status_code == 200, r.text
    grad = r.json()["gradient"]
    assert list(grad) == ["__tuple__"] and len(grad["__tuple__"]) == 2
    s = pf.Scenario("t", pf.pt_tuple_scalar, (np.array([0.1, 0.2, 0.3]), np.array(0.7)))
    want = reference(s, "gradient")
    np.testing.assert_allclose(grad["__tuple__"][0], want[0], rtol=RTOL)
    np.testing.assert_allclose(grad["__tuple__"][1], want[1], rtol=RTOL)
    body = {  # lists, dicts and None nodes nest; plain lists inside stay arrays
        "function": "pt_none_scalar", "backend": "auto",
        "x": {"w": [1.0, 2.0, 3.0], "frozen": None},
    }
    r = http.post("/gradient", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["gradient"] == {"w": [4.0, 32.0, 108.0], "frozen": None}


@pytest.mark.parametrize(
    ("x", "status", "field"),
    [
        ({"__tuple__": 3.0}, 400, "x"),
        ({"__list__": {"a": [1.0]}}, 400, "x"),
        ({"__tuple__": [[1.0]], "extra": [1.0]}, 400, "x"),
        ({"w": {"__list__": [[1.0], "oops"]}}, 400, "x.w[1]"),
        ({"w": {"__set__": [[1.0]]}}, 422, "x.w.__set__"),
        ({"__tuple__": [{"__ndarray__": [1.0], "dtype": "float64"}]}, 400, "x[0]"),
    ],
)
def test_malformed_markers_are_problems_naming_the_field(
    http: TestClient, x: Any, status: int, field: str
) -> None:
    r = http.post("/gradient", json={"function": "pt_tuple_scalar", "x": x})
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["field"] == field


def test_malformed_marker_in_a_binary_header(http: TestClient) -> None:
    header = b'{"function":"pt_tuple_scalar","x":{"__tuple__":7}}'
    header += b" " * (-len(header) % 64)
    r = http.post("/gradient", content=header, headers={
        "content-type": BINARY_TYPE, HEADER_LENGTH: str(len(header)),
    })
    assert r.status_code == 400 and r.json()["field"] == "x"


def test_unknown_leaf_through_the_client_names_its_path(http: TestClient) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        _client(http, "json").gradient("pt_dict_scalar", "auto", {"w": np.ones((3, 2)),
                                                                  "b": {object()}})
    assert info.value.field == "x.b"


# --- expressions over structured inputs -------------------------------------------------------
def test_expression_indexes_pytree_inputs(http: TestClient) -> None:
    from dxserve.frameworks.jax.expressions import compile_expression

    source = 'jnp.sum(x["w"] ** 2) * x["b"][0] + jnp.sum(jnp.sin(x["b"][1]))'
    f = compile_expression(source, ["x"])
    x = {"w": np.array([1.0, 2.0]), "b": (np.array(0.5), np.array([0.1, 0.2]))}
    s = pf.Scenario("expr", f, x)
    assert_tree_close(dxserve.gradient(f, "auto", x), reference(s, "gradient"))
    assert_tree_close(dxserve.hessian(f, "auto", x), reference(s, "hessian"))
    for encoding in ENCODINGS:
        client = _client(http, encoding)
        client.register_expression("pt_expr", source, ["x"], replace=True)
        assert_tree_close(client.gradient("pt_expr", "auto", x), reference(s, "gradient"))


@pytest.mark.parametrize(
    "source", ['x["__class__"]', 'x["_w"]', 'x["w", 0]', '"w"', 'jnp.sum(x, axis="w")',
               'x[x["w"]]', 'x["a b"]']
)
def test_expression_strings_only_as_whole_subscripts(source: str) -> None:
    from dxcontract.errors import InvalidExpressionError
    from dxserve.frameworks.jax.expressions import compile_expression

    with pytest.raises(InvalidExpressionError) as info:
        compile_expression(source, ["x"])
    assert info.value.field == "expression"
