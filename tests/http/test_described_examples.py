"""Every description is true: each example request that ``GET /functions/{name}``
offers answers 200 when posted as it is, for every function a server serves (the
examples, and the uploads and expressions the docs register), and
what it lists as operators is what its shapes allow."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

from dxclient import Client
from dxserve.http.schemas import FunctionList
from tests.conftest import ServerProcess, start_server, stop_server

#: The expressions the docs register (docs/functions.md, the expression kind's example).
EXPRESSIONS = [
    {"name": "quad", "expression": "0.5 * x @ (A @ x) + jnp.sum(jnp.sin(x))", "args": ["x", "A"]},
    {"name": "sq", "expression": "jnp.sum(jnp.sin(x) ** 2)", "args": ["x"]},
    {"name": "firsts", "expression": "jnp.sin(x[0:2])", "args": ["x"]},  # never a scalar
    {"name": "layer", "expression": "jnp.tanh(W @ x)", "args": ["x", "W"]},
]


@pytest.fixture(scope="module")
def described(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path_factory.mktemp("described"), modules=("dxserve.examples",))
    try:
        for body in EXPRESSIONS:
            answer = httpx.post(srv.url + "/functions", json=body)
            assert answer.status_code in (200, 201), answer.text
        with Client(srv.url) as client:  # the docs' uploads: a pytree x, symbolic shapes

            def loss(params, X, Y):
                return 0.5 * jnp.sum((jnp.tanh(X @ params["w"] + params["b"]) - Y) ** 2)

            params = {"w": np.zeros((3, 2)), "b": np.zeros(2)}
            client.register(loss, params, np.ones((5, 3)), np.ones((5, 2)), name="my_loss")
            rosen = lambda x: jnp.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)  # noqa: E731
            client.register(rosen, np.ones(3), name="my_rosen",
                            polymorphic_shapes=("(n,)",), constraints=("n >= 2",))  # fmt: skip
        yield srv
    finally:
        stop_server(srv)


def _names(url: str) -> list[str]:
    listed = httpx.get(url + "/functions").json()["functions"]
    return sorted(f["name"] for f in listed)


def test_every_example_request_answers_200(described: ServerProcess) -> None:
    names = _names(described.url)
    assert {"rosenbrock", "quad", "my_loss", "my_rosen"} <= set(names), names
    offered = []
    for name in names:
        d = httpx.get(f"{described.url}/functions/{name}").json()
        example = d["example"]
        if example is None:
            continue
        operator = example["path"].lstrip("/")
        assert operator in d["operators"], (name, example["path"], d["operators"])
        answer = httpx.post(described.url + example["path"], json=example["body"])
        assert answer.status_code == 200, (name, example, answer.text)
        offered.append(name)
    # examples are the rule, not the exception
    assert {"rosenbrock", "tanh_layer", "quad", "sq", "firsts", "layer", "my_loss"} <= set(offered)


def test_an_expression_with_a_matrix_output_does_not_offer_a_gradient(
    described: ServerProcess,
) -> None:
    d = httpx.get(described.url + "/functions/quad").json()
    assert d["output"]["shape"] == [], d  # traced on shapes it takes: x (3,), A (3, 3)
    assert [a["shape"] for a in d["arguments"]] == [[3], [3, 3]], d
    firsts = httpx.get(described.url + "/functions/firsts").json()  # never a scalar output
    assert "gradient" not in firsts["operators"], firsts
    assert firsts["example"]["path"] == "/jacobian", firsts


def test_the_list_is_a_summary_and_details_are_one_step_away(described: ServerProcess) -> None:
    listed = httpx.get(described.url + "/functions")
    functions = listed.json()["functions"]
    assert all(set(f) == {"name", "kind", "description", "href"} for f in functions)
    # a few hundred bytes a function, not every description's shapes and example
    assert len(listed.content) < 400 * len(functions), len(listed.content)
    for f in functions[:3]:
        assert httpx.get(described.url + f["href"]).json()["name"] == f["name"]
    detailed = httpx.get(described.url + "/functions", params={"details": "true"}).json()
    assert [f["name"] for f in detailed["functions"]] == [f["name"] for f in functions]
    assert all("operators" in f for f in detailed["functions"])
    # both forms are what the committed OpenAPI document promises for this route
    FunctionList.model_validate(listed.json())
    FunctionList.model_validate(detailed)
    with Client(described.url) as client:
        assert {f.name for f in client.functions()} == {f["name"] for f in functions}


def test_an_uploads_shapes_are_enforced_naming_the_argument(described: ServerProcess) -> None:
    """An upload's signature is a contract: a symbolic (n,) is any length, not a matrix."""
    r = httpx.post(described.url + "/gradient", json={"function": "my_rosen",
                                                      "x": [[1.0, 2.0], [3.0, 4.0]]})  # fmt: skip
    assert r.status_code == 422, r.text
    problem = r.json()
    assert problem["field"] == "x", problem
    assert problem["detail"].startswith("x has shape (2, 2), but the function declares (n,)")
    ok = httpx.post(described.url + "/gradient", json={"function": "my_rosen", "x": [1.0] * 7})
    assert ok.status_code == 200, ok.text
