"""Declared shapes are a contract, enforced before anything is traced: a 422 naming the
argument, the shape given and the shape declared. Shapes taken from an example are only
an example (other shapes work where the function takes them), but when a call fails on
one, the 422 names the argument whose shape is new, in words, before JAX's text."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from tests.conftest import ServerProcess, start_server, stop_server


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(
        tmp_path_factory.mktemp("door"), modules=("dxserve.examples", "tests.annotated_functions")
    )
    try:
        yield srv
    finally:
        stop_server(srv)


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/gradient", json=body)


def test_declared_shapes_are_described_as_a_contract(door: ServerProcess) -> None:
    d = httpx.get(door.url + "/functions/logp").json()
    assert d["shapes_from"] == "annotations", d
    assert [a["shape"] for a in d["arguments"]] == [[2], ["n"]], d
    example = d["example"]
    assert httpx.post(door.url + example["path"], json=example["body"]).status_code == 200


def test_logp_declared_2_given_3_is_a_422_naming_x(door: ServerProcess) -> None:
    r = _post(door.url, {"function": "logp", "x": [0.1, 1.0, 2.0], "contexts": [[0.3, -0.2]]})
    assert r.status_code == 422, r.text
    problem = r.json()
    assert problem["field"] == "x", problem
    assert problem["detail"].startswith("x (theta) has shape (3,), but the function declares (2,)")
    ok = _post(door.url, {"function": "logp", "x": [0.1, 1.0], "contexts": [[0.3, -0.2, 0.5]]})
    assert ok.status_code == 200, ok.text  # "n": any length


def test_named_dimensions_must_agree(door: ServerProcess) -> None:
    W = np.ones((2, 3)).tolist()
    ok = httpx.post(door.url + "/jacobian", json={"function": "named_layer", "x": [1.0, 2.0, 3.0],
                                                   "contexts": [W]})  # fmt: skip
    assert ok.status_code == 200, ok.text
    bad = httpx.post(door.url + "/jacobian", json={"function": "named_layer", "x": [1.0, 2.0],
                                                    "contexts": [W]})  # fmt: skip
    assert bad.status_code == 422, bad.text
    assert bad.json()["field"] == "contexts[0]", bad.json()
    assert bad.json()["detail"].startswith("contexts[0] (W) has shape (2, 3)"), bad.json()


def test_tanh_layer_with_a_bad_W_names_contexts_0_W(door: ServerProcess) -> None:
    """tanh_layer's shapes are its example's: not enforced, but the failure is named."""
    x = [1.0, 2.0, 3.0]
    bad_W = [[0.1, 0.2], [0.3, 0.4]]  # (2, 2): W @ x cannot contract 2 with 3
    r = httpx.post(door.url + "/jacobian", json={"function": "tanh_layer", "x": x,
                                                  "contexts": [bad_W]})  # fmt: skip
    assert r.status_code == 422, r.text
    problem = r.json()
    assert problem["field"] == "contexts[0]", problem
    assert problem["detail"].startswith(
        "contexts[0] (W) has shape (2, 2), where its example has (2, 3)"
    ), problem
    # an example is not a contract: other shapes that the function takes work
    wide = httpx.post(door.url + "/jacobian", json={"function": "tanh_layer", "x": [1.0] * 4,
                                                     "contexts": [np.ones((5, 4)).tolist()]})  # fmt: skip
    assert wide.status_code == 200, wide.text
    assert np.asarray(wide.json()["jacobian"]).shape == (5, 4)
    d = httpx.get(door.url + "/functions/tanh_layer").json()
    assert d["shapes_from"] == "example"


def test_an_annotation_that_declares_nothing_is_said(caplog: pytest.LogCaptureFixture) -> None:
    from dxserve.server.kinds.module import MODULE

    def f(x: "float64[3]"):  # noqa: F722, F821, UP037 - a string form dxserve does not read
        return (x**2).sum()

    with caplog.at_level("WARNING", logger="dxserve.registry"):
        built = MODULE.wrap(f)
    assert built.facts is None
    assert "annotations declare no shapes" in caplog.text and "Float[Array" in caplog.text
