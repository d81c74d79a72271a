"""The first hour of a new user: installs, what the server says it serves, the errors a
newcomer meets, and functions that describe themselves.

Everything runs against real servers (``server``, ``make_server``) over real sockets,
except the Makefile checks, which read ``make -n``'s commands (and, marked ``slow``
since it needs the package index, pip's own resolution of ``make serve``'s install).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dxserve
from dxclient import OPERATORS, AsyncClient, Client, JaxReverse
from dxcontract.errors import FunctionConflictError, InvalidArgumentError, ShapeMismatchError
from dxserve.cli import module_list
from dxserve.core.functions import module_functions
from dxserve.settings import Settings
from tests.conftest import REPO, ServerProcess

EXAMPLES = [info.name for info, _ in module_functions("dxserve.examples")]
TEST_TOOLS = (
    "pytest",
    "hypothesis",
    "schemathesis",
    "ruff",
    "optax",
    "matplotlib",
    "equinox",
    "flax",
)
X = np.array([1.0, 2.0, 3.0])
W = np.array([[0.1, 0.2, 0.3], [-0.3, 0.2, -0.1]])


# --- installs ---------------------------------------------------------------------------
def make_commands(target: str, venv: Path) -> list[str]:
    """The commands ``make <target>`` would run for a fresh ``venv`` (``make -n``)."""
    out = subprocess.run(
        ["make", "--no-print-directory", "-n", f"VENV={venv}", target],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return out.splitlines()


def installs(commands: list[str]) -> list[str]:
    return [c for c in commands if "pip install" in c and "--upgrade pip" not in c]


def test_make_serve_installs_the_three_packages_without_extras(tmp_path: Path) -> None:
    commands = make_commands("serve", tmp_path / "venv")
    lines = installs(commands)
    assert len(lines) == 1, commands
    words = lines[0].split()
    assert words[words.index("install") :] == [
        "install",
        "-q",
        "-e",
        "./contract",
        "-e",
        "./clients/python",
        "-e",
        ".",
    ]
    assert "[" not in lines[0]
    assert commands[-1].endswith(f"{tmp_path / 'venv'}/bin/dxserve serve")


def test_make_test_adds_the_test_extras(tmp_path: Path) -> None:
    lines = installs(make_commands("test", tmp_path / "venv"))
    assert any("'.[test]'" in line and "'./clients/python[test,jax]'" in line for line in lines)
    assert any(line.rstrip().endswith("-e ./contract -e ./clients/python -e .") for line in lines)


def test_make_docker_test_needs_nothing_outside_the_repository(tmp_path: Path) -> None:
    commands = make_commands("docker-test", tmp_path / "venv")
    run = next(c for c in commands if "build-and-run.sh" in c)
    script = REPO / "docker" / "oci" / "build-and-run.sh"
    assert "bash docker/oci/build-and-run.sh -f docker/Dockerfile -c ." in run
    assert "../" not in run
    text = script.read_text()
    # the only file the script reads beside itself is its base image's Dockerfile
    assert '"$HERE/Dockerfile.python-slim"' in text
    assert (script.parent / "Dockerfile.python-slim").is_file()
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_make_serve_install_resolves_no_test_tools(tmp_path: Path) -> None:
    """pip's own resolution (``--dry-run --report``) of ``make serve``'s install line, in a
    fresh venv: the server and client dependencies, and none of the test tools."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    line = installs(make_commands("serve", venv))[0]
    words = line.split()
    targets = words[words.index("install") + 1 :]
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--report",
            str(report),
            *targets,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {  # normalized as PEP 503 does
        re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower()
        for item in json.loads(report.read_text())["install"]
    }
    assert {"dxserve", "dxserve-client", "jax", "fastapi", "fastapi-offline"} <= names
    assert not names & set(TEST_TOOLS), sorted(names & set(TEST_TOOLS))


# --- a server that says what it serves --------------------------------------------------
def test_startup_log_names_what_is_served(make_server) -> None:
    """Examples, plus a module given with a second --functions, plus a module that
    registers nothing: each function named with its module, the empty one warned about."""
    srv = make_server(
        modules=("dxserve.examples", "json"), args=["--functions", "tests.pytree_functions"]
    )
    log = srv.log.read_text()
    pytree = [info.name for info, _ in module_functions("tests.pytree_functions")]
    served = len(EXAMPLES) + len(pytree)
    assert (
        f"functions: {served} served: {served} from --functions modules "
        "(dxserve.examples, json, tests.pytree_functions), 0 stored in" in log
    ), log
    for name in EXAMPLES:
        assert f"function {name}: module dxserve.examples" in log
    for name in pytree:
        assert f"function {name}: module tests.pytree_functions" in log
    assert "module json registers no functions" in log
    assert "store: 0 stored function(s)" in log
    listed = {f["name"] for f in httpx.get(srv.url + "/functions").json()["functions"]}
    assert set(EXAMPLES) | set(pytree) <= listed  # both --functions flags count
    # every example describes itself with a request that works as it is
    for name in EXAMPLES:
        described = httpx.get(f"{srv.url}/functions/{name}").json()
        assert described["shapes_from"] == "example", name
        assert _post_example(srv.url, described), name
    rosenbrock = httpx.get(srv.url + "/functions/rosenbrock").json()
    assert rosenbrock["example"]["body"] == {
        "function": "rosenbrock",
        "backend": "auto",
        "x": [1.0, 2.0, 3.0],
    }
    assert _post_example(srv.url, rosenbrock) == {"gradient": [-400.0, 1002.0, -200.0]}


def test_functions_flag_adds_up() -> None:
    assert module_list(["a,b", " c ", "a", ""]) == ["a", "b", "c"]


def test_dxserve_functions_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DXSERVE_FUNCTIONS", "dxserve.examples, mymodule")
    assert Settings().functions == ["dxserve.examples", "mymodule"]
    monkeypatch.delenv("DXSERVE_FUNCTIONS")
    assert Settings().functions == ["dxserve.examples"]


def test_help_says_how_the_examples_come_in() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dxserve.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout
    flat = " ".join(out.split())
    assert "Without --functions the example functions are served" in flat
    assert "Repeat the flag or separate modules with commas: the lists add up" in flat
    assert "Naming modules replaces that default" in flat
    assert "add dxserve.examples to keep the examples" in flat
    assert "DXSERVE_FUNCTIONS" in flat


# --- newcomer fixes ---------------------------------------------------------------------
@pytest.mark.parametrize("method, path, meant", [
    ("POST", "/jvp", "/pushforward"),
    ("POST", "/vjp", "/pullback"),
    ("POST", "/grad", "/gradient"),
    ("POST", "/value_and_grad", "/value_and_gradient"),
    ("POST", "/prepare/jvp", "/prepare/pushforward"),
    ("POST", "/gradiant", "/gradient"),
    ("GET", "/fuctions", "/functions"),
])  # fmt: skip
def test_unknown_route_says_what_was_meant(server: ServerProcess, method, path, meant) -> None:
    r = httpx.request(method, server.url + path, json={"function": "rosenbrock", "x": [1.0]})
    assert r.status_code == 404
    assert r.headers["content-type"] == "application/problem+json"
    problem = r.json()
    assert problem["suggestions"] == [meant]
    assert f"no route {method} {path}; did you mean {meant}" in problem["detail"]
    assert problem["field"] == "path"


def test_unknown_route_without_a_near_one(server: ServerProcess) -> None:
    problem = httpx.post(server.url + "/completely-else").json()
    assert "suggestions" not in problem
    assert problem["detail"] == "no route POST /completely-else; see /docs for every route"


def test_unknown_function_says_what_was_meant(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/gradient", json={"function": "rosenbrok", "x": [1.0, 2.0]})
    assert r.status_code == 404
    assert "did you mean 'rosenbrock'?" in r.json()["detail"]


@pytest.mark.parametrize("function, x, contexts, field, named", [
    ("tanh_layer", [1.0, 2.0, 3.0], [], "contexts[0]", "(W) is missing"),
    ("least_squares", {"w": [[0.5], [-0.5]], "b": [0.1]}, [[[1.0, 2.0]]], "contexts[1]",
     "(Y) is missing"),
    ("rosenbrock", [1.0, 2.0, 3.0], [[1.0]], "contexts[0]", "are extra"),
])  # fmt: skip
def test_wrong_number_of_contexts_names_the_context(
    server: ServerProcess, function, x, contexts, field, named
) -> None:
    body = {"function": function, "x": x, "contexts": contexts}
    r = httpx.post(server.url + "/jacobian", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == field
    assert named in r.json()["detail"]


def test_missing_context_through_the_client_and_the_library(server: ServerProcess) -> None:
    with Client(server.url) as client, pytest.raises(InvalidArgumentError) as info:
        client.jacobian("tanh_layer", X)
    assert info.value.field == "contexts[0]"

    def layer(x, W):
        return jnp.tanh(W @ x)

    with pytest.raises(InvalidArgumentError) as info:
        dxserve.jacobian(layer, "auto", X)
    assert info.value.field == "contexts[0]"
    assert "layer takes 1 context (W) after x, got 0" in str(info.value)


def test_conflict_is_spelled_for_each_caller(server: ServerProcess) -> None:
    body = {"name": "fh_conflict", "expression": "jnp.sum(x ** 2)"}
    assert httpx.post(server.url + "/functions", json=body).status_code in (200, 201)
    try:
        r = httpx.post(server.url + "/functions", json={**body, "expression": "jnp.sum(x)"})
        assert r.status_code == 409
        problem = r.json()
        assert 'pass "replace": true to overwrite' in problem["detail"]
        assert "replace=True" not in problem["detail"]
        assert problem["fix"] == {"replace": True}
        with Client(server.url) as client, pytest.raises(FunctionConflictError) as info:
            client.register_expression("fh_conflict", "jnp.sum(x)")
        assert "pass replace=True to overwrite" in str(info.value)
        assert '"replace"' not in str(info.value)
        assert info.value.fix == {"replace": True}
    finally:
        httpx.delete(server.url + "/functions/fh_conflict")


@pytest.mark.parametrize(
    "operator, function", [("pushforward", "sin_cumsum"), ("hvp", "rosenbrock")]
)
def test_unwrapped_tangent_gets_the_wrapped_spelling(
    server: ServerProcess, operator, function
) -> None:
    body = {"function": function, "x": [1.0, 2.0, 3.0], "tangents": [1, 1, 1]}
    r = httpx.post(f"{server.url}/{operator}", json=body)
    assert r.status_code == 422
    problem = r.json()
    assert problem["field"] == "tangents"
    assert "tangents is a list of tangents" in problem["detail"]
    assert "for one tangent write [[1, 1, 1]]" in problem["detail"]
    with Client(server.url) as client, pytest.raises(ShapeMismatchError) as info:
        getattr(client, operator)(function, X, [1.0, 1.0, 1.0])
    assert "[[1, 1, 1]]" in str(info.value)


def test_client_backend_defaults_to_auto(server: ServerProcess) -> None:
    want = np.array([-400.0, 1002.0, -200.0])
    with Client(server.url) as client:
        np.testing.assert_allclose(client.gradient("rosenbrock", X), want)
        np.testing.assert_allclose(client.gradient("rosenbrock", "jax-reverse", X), want)
        np.testing.assert_allclose(client.gradient("rosenbrock", JaxReverse(), X), want)
        np.testing.assert_allclose(client.gradient("rosenbrock", {"type": "jax-reverse"}, X), want)
        np.testing.assert_allclose(client.gradient("rosenbrock", x=X), want)
        # contexts after x, with and without a backend
        J = client.jacobian("tanh_layer", X, W)
        np.testing.assert_allclose(J, client.jacobian("tanh_layer", "auto", X, W))
        np.testing.assert_allclose(J, (1 - np.tanh(W @ X) ** 2)[:, None] * W, rtol=1e-12)
        # tangents after x
        t = np.array([1.0, 0.0, 0.0])
        (p,) = client.pushforward("sin_cumsum", X, [t])
        np.testing.assert_allclose(p, client.pushforward("sin_cumsum", "jax-forward", X, [t])[0])
        # a pytree x (a dict without a string "type") is x, not a backend
        params = {"w": np.array([[0.5], [-0.5]]), "b": np.array([0.1])}
        Xd, Y = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), np.array([[1.0], [0.0], [-1.0]])
        v, g = client.value_and_gradient("least_squares", params, Xd, Y)
        v2, g2 = client.value_and_gradient("least_squares", "auto", params, Xd, Y)
        assert v == v2 and set(g) == {"w", "b"}
        np.testing.assert_array_equal(g["w"], g2["w"])
        # preparation the same way
        prep = client.prepare_gradient("rosenbrock", X)
        np.testing.assert_allclose(client.gradient("rosenbrock", X, prep=prep), want)
        with pytest.raises(TypeError, match="needs x"):
            client.gradient("rosenbrock")
        with pytest.raises(TypeError, match="needs tangents"):
            client.pushforward("sin_cumsum", X)


async def _async_gradient(url: str) -> np.ndarray:
    async with AsyncClient(url) as client:
        return await client.gradient("rosenbrock", X)


def test_async_client_backend_defaults_to_auto(server: ServerProcess) -> None:
    import asyncio

    np.testing.assert_allclose(asyncio.run(_async_gradient(server.url)), [-400.0, 1002.0, -200.0])


def test_library_keeps_its_argument_order() -> None:
    import inspect

    assert list(inspect.signature(dxserve.gradient).parameters)[:3] == ["f", "backend", "x"]
    np.testing.assert_allclose(dxserve.gradient(lambda x: jnp.sum(x**2), JaxReverse(), X), 2 * X)


def test_install_hints_name_lines_that_work() -> None:
    """Every hint names the extra's requirements as the installed metadata has them, and
    the extra itself as a path in this repository."""
    import tomllib

    from dxcontract.extras import CLIENT, SERVER, install_hint

    client = tomllib.loads((REPO / "clients/python/pyproject.toml").read_text())
    server = tomllib.loads((REPO / "pyproject.toml").read_text())
    for extra in ("progress", "scipy", "jax"):
        hint = install_hint(extra, CLIENT)
        assert f"pip install ./contract './clients/python[{extra}]'" in hint
        assert extra in client["project"]["optional-dependencies"]
    for extra in ("ray", "postgres"):
        hint = install_hint(extra, SERVER)
        assert f"pip install -e '.[{extra}]'" in hint
        assert extra in server["project"]["optional-dependencies"]
    # no unpublished distribution names anywhere a user reads an install line
    for path in [
        REPO / "README.md",
        *REPO.glob("docs/*.md"),
        *REPO.glob("service/**/*.py"),
        *REPO.glob("clients/python/dxclient/*.py"),
        REPO / "deploy/ray-serve.yaml",
    ]:
        text = path.read_text(encoding="utf-8")
        # (a direct reference, 'dxserve-client[jax] @ git+...', installs from a URL)
        bad = re.search(r"pip install '?(dxclient|dxserve|dxserve-client)\[[a-z,]*\]'?(?! @)", text)
        assert not bad, (path, bad)


def test_progress_import_error_names_a_working_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from dxclient import progress

    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if tqdm were not installed
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with pytest.raises(ImportError) as info:
        progress._tqdm()
    assert "pip install ./contract './clients/python[progress]'" in str(info.value)
    assert "dxclient[progress]" not in str(info.value)


# --- /docs offline ----------------------------------------------------------------------
@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_api_pages_load_only_local_assets(server: ServerProcess, page: str) -> None:
    html = httpx.get(server.url + page).text
    urls = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html) + re.findall(
        r"""url:\s*["']([^"']+)["']|spec-url=["']([^"']+)["']""", html
    )
    urls = [u for item in urls for u in ((item,) if isinstance(item, str) else item) if u]
    assert urls, html
    assert not re.search(r"https?://|//cdn|jsdelivr|unpkg|fonts.googleapis", html), html
    types = {".js": "javascript", ".css": "text/css", ".png": "image/png", ".json": "json"}
    for url in urls:
        assert url.startswith("/"), url
        r = httpx.get(server.url + url)
        assert r.status_code == 200, url
        kind = next(v for k, v in types.items() if url.endswith(k))
        assert kind in r.headers["content-type"], (url, r.headers["content-type"])
        assert len(r.content) > 1000, url


def test_docs_assets_are_the_pinned_packages(server: ServerProcess) -> None:
    from importlib.resources import files

    shipped = files("fastapi_offline").joinpath("static", "swagger-ui-bundle.js").read_bytes()
    assert httpx.get(server.url + "/docs/assets/swagger-ui-bundle.js").content == shipped
    missing = httpx.get(server.url + "/docs/assets/nothing.js")
    assert missing.status_code == 404
    assert missing.headers["content-type"] == "application/problem+json"


# --- functions that describe themselves --------------------------------------------------
def _post_example(url: str, described: dict) -> dict:
    example = described["example"]
    r = httpx.post(url + example["path"], json=example["body"])
    assert r.status_code == 200, r.text
    return r.json()


def test_module_function_describes_itself(server: ServerProcess) -> None:
    # (the session server's rosenbrock is tests.scenarios', registered after the examples')
    d = httpx.get(server.url + "/functions/normal_logpdf").json()
    assert d["kind"] == "module" and d["signature"] == {"args": ["x"]}
    assert d["arguments"] == [
        {"name": "x", "role": "x", "shape": [3], "dtype": "float64", "tree": None}
    ]
    assert d["output"]["shape"] == [] and d["shapes_from"] == "example"
    assert {"gradient", "hessian", "hvp", "jacobian"} <= set(d["operators"])
    assert "derivative" not in d["operators"]  # x is not a scalar
    assert d["example"] == {
        "path": "/gradient",
        "body": {"function": "normal_logpdf", "backend": "auto", "x": [1.0, 2.0, 3.0]},
    }
    assert _post_example(server.url, d) == {"gradient": [-1.0, -2.0, -3.0]}
    shadowed = httpx.get(server.url + "/functions/rosenbrock").json()
    assert shadowed["shapes_from"] is None and shadowed["example"] is None
    assert shadowed["operators"] == list(OPERATORS)
    assert "functions: rosenbrock of tests.scenarios replaces the one of dxserve.examples" in (
        server.log.read_text()
    )

    layer = httpx.get(server.url + "/functions/tanh_layer").json()
    assert [(a["name"], a["role"], a["shape"]) for a in layer["arguments"]] == [
        ("x", "x", [3]),
        ("W", "context", [2, 3]),
    ]
    assert layer["output"]["shape"] == [2]
    assert "gradient" not in layer["operators"] and layer["example"]["path"] == "/jacobian"
    J = np.array(_post_example(server.url, layer)["jacobian"])
    np.testing.assert_allclose(J, (1 - np.tanh(W @ X) ** 2)[:, None] * W, rtol=1e-12)

    squares = httpx.get(server.url + "/functions/least_squares").json()
    tree = squares["arguments"][0]["tree"]
    assert tree == {
        "dict": {
            "b": {"shape": [1], "dtype": "float64"},
            "w": {"shape": [2, 1], "dtype": "float64"},
        }
    }
    assert "sparsity" not in squares["operators"]  # a pytree x
    assert set(_post_example(server.url, squares)["gradient"]) == {"w", "b"}
    # the list has the same descriptions
    detailed = httpx.get(server.url + "/functions", params={"details": "true"}).json()
    assert {f["name"]: f for f in detailed["functions"]}["normal_logpdf"] == d
    # the plain list is a summary, with the address of each description
    listed = {f["name"]: f for f in httpx.get(server.url + "/functions").json()["functions"]}
    assert listed["normal_logpdf"] == {
        "name": "normal_logpdf", "kind": "module", "description": d["description"],
        "href": "/functions/normal_logpdf",
    }


def test_expression_describes_itself(server: ServerProcess) -> None:
    body = {"name": "fh_sines", "expression": "jnp.sum(jnp.sin(x) ** 2)", "replace": True}
    assert httpx.post(server.url + "/functions", json=body).status_code in (200, 201)
    try:
        d = httpx.get(server.url + "/functions/fh_sines").json()
        assert d["signature"] == {"args": ["x"], "expression": "jnp.sum(jnp.sin(x) ** 2)"}
        assert d["arguments"][0] | {"tree": None} == {
            "name": "x",
            "role": "x",
            "shape": [3],
            "dtype": "float64",
            "tree": None,
        }
        assert d["shapes_from"] == "probe"
        g = _post_example(server.url, d)["gradient"]
        x = np.array(d["example"]["body"]["x"])
        np.testing.assert_allclose(g, np.sin(2 * x), rtol=1e-12)
        with Client(server.url) as client:
            remote = client.function("fh_sines")
        assert remote.example == d["example"] and "gradient" in remote.operators
    finally:
        httpx.delete(server.url + "/functions/fh_sines")


def test_uploaded_export_describes_itself(server: ServerProcess) -> None:
    def layer(x, W):
        return jnp.tanh(W @ x)

    x32, W32 = X.astype(np.float32), W.astype(np.float32)
    with Client(server.url) as client:
        client.register(layer, x32, W32, name="fh_layer", replace=True)
    try:
        d = httpx.get(server.url + "/functions/fh_layer").json()
        assert d["kind"] == "export" and d["shapes_from"] == "export"
        assert "artifacts" in d["signature"] or "signature" in d["signature"]  # the manifest
        assert [(a["name"], a["shape"], a["dtype"]) for a in d["arguments"]] == [
            ("x", [3], "float32"),
            ("contexts[0]", [2, 3], "float32"),
        ]
        assert d["output"] == {"shape": [2], "dtype": "float32", "tree": None}
        assert "gradient" not in d["operators"] and "jacobian" in d["operators"]
        body = d["example"]["body"]
        assert body["x"]["dtype"] == "float32"  # typed: a plain list would be float64
        got = _post_example(server.url, d)["jacobian"]
        x = np.asarray(body["x"]["__ndarray__"], np.float32)
        c = np.asarray(body["contexts"][0]["__ndarray__"], np.float32)
        want = jax.jacobian(layer)(x, c)
        got = np.asarray(got["__ndarray__"] if isinstance(got, dict) else got, np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-5)
    finally:
        httpx.delete(server.url + "/functions/fh_layer")


def test_annotations_describe_a_module_function() -> None:
    """Without an example, ``jax.ShapeDtypeStruct`` (or ``float``) annotations give the
    shapes; a bare type such as ``jax.Array`` gives none."""
    from dxserve.server.describe import describe
    from dxserve.server.kinds.module import MODULE

    def scaled(x: jax.ShapeDtypeStruct((4,), np.float32), a: float):
        return a * jnp.sum(x)

    def untyped(x: jax.Array):
        return jnp.sum(x)

    built = MODULE.wrap(scaled)
    d = describe("scaled", built.signature, built.facts)
    assert d["shapes_from"] == "annotations"
    assert [(a["name"], a["shape"], a["dtype"]) for a in d["arguments"]] == [
        ("x", [4], "float32"),
        ("a", [], "float64"),
    ]
    assert d["example"]["body"]["x"] == {"__ndarray__": [0.5] * 4, "dtype": "float32", "shape": [4]}
    built = MODULE.wrap(untyped)
    assert built.facts is None
    plain = describe("untyped", built.signature, built.facts)
    assert plain["shapes_from"] is None and plain["example"] is None
    assert plain["operators"] == list(OPERATORS)


def test_descriptions_survive_a_restart_without_a_build(tmp_path: Path) -> None:
    """A stored function's shapes are kept with its record: the next server describes it
    from the record alone, before (and without) building it."""
    from dxserve.frameworks.jax.precision import float64_scope
    from dxserve.server.registry import Registry
    from dxserve.server.stores import open_store

    store = open_store(str(tmp_path / "store"))
    with float64_scope():
        Registry(store).register_body({"name": "kept", "expression": "jnp.sum(x ** 3)"})
    store.close()
    store = open_store(str(tmp_path / "store"))
    try:
        registry = Registry(store)
        registry.load_store()
        entry = registry.lookup("kept")
        assert entry.fn is None  # not built
        d = entry.describe()
        assert d["shapes_from"] == "probe" and d["arguments"][0]["shape"] == [3]
        assert d["example"]["body"] == {"function": "kept", "backend": "auto", "x": [0.5, 0.5, 0.5]}
    finally:
        store.close()


def test_second_argument_is_a_backend_only_when_it_names_one() -> None:
    from dxclient._positionals import NOT_GIVEN, is_backend, positionals

    for backend in ("auto", JaxReverse(), {"type": "jax-forward", "batch_size": 2}, None):
        assert is_backend(backend), backend
    for x in (X, X.astype(np.float32), jnp.ones(3), 1.5, [1.0, 2.0], (X, X), {"w": X}):
        assert not is_backend(x), type(x)
    assert positionals("gradient", False, X, W, NOT_GIVEN, (1.0,)) == ("auto", X, None, (W, 1.0))
    t = [X]
    assert positionals("hvp", True, X, t, W, ()) == ("auto", X, t, (W,))
    assert positionals("hvp", True, "auto", X, t, (W,)) == ("auto", X, t, (W,))
