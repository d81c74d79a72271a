"""The shape of the code: what importing does, the service core without HTTP, no cycles."""

from __future__ import annotations

import ast
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dxserve.server.service import Service
from dxserve.settings import Settings

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "service" / "dxserve"

_CONFIG_PROBE = """
import json, sys
import jax
def snapshot():
    return {name: repr(getattr(jax.config, name, None)) for name in sorted(jax.config.values)}
before, interval = snapshot(), sys.getswitchinterval()
import numpy as np
import dxserve
after_import = snapshot()
g64 = dxserve.gradient(lambda x: (x ** 3).sum(), "jax-reverse", np.array([1.0, 2.0, 1e-9]))
g32 = dxserve.gradient(lambda x: (x ** 3).sum(), "jax-reverse", np.array([1.0, 2.0], np.float32))
h = dxserve.hvp(lambda x: (x ** 3).sum(), "auto", np.array([1.0, 2.0]), (np.ones(2),))
print(json.dumps({
    "import_changed": [k for k in before if before[k] != after_import[k]],
    "call_changed": [k for k in before if before[k] != snapshot()[k]],
    "interval_same": sys.getswitchinterval() == interval,
    "x64": bool(jax.config.jax_enable_x64),
    "g64": [str(np.asarray(g64).dtype), float(np.asarray(g64)[2])],
    "g32": str(np.asarray(g32).dtype),
    "h": [str(np.asarray(h[0]).dtype), np.asarray(h[0]).tolist()],
}))
"""


def test_import_leaves_jax_configuration_untouched_and_float64_still_computes() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CONFIG_PROBE], capture_output=True, text=True, timeout=120,
        check=True,
    )
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["import_changed"] == [] and found["call_changed"] == []
    assert found["interval_same"] and found["x64"] is False
    # d/dx x^3 = 3x^2: 3e-18 survives only in float64 (float32 would round x to 1e-9f)
    assert found["g64"][0] == "float64"
    assert found["g64"][1] == pytest.approx(3e-18, rel=1e-12)
    assert found["g32"] == "float32"
    assert found["h"] == ["float64", [6.0, 12.0]]  # H = diag(6x)


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (never run)."""
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        out.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return out


def _imports(path: Path, module: str) -> set[str]:
    """Every dxserve module ``module`` imports when it runs, at any depth of the file
    (imports inside functions count too: a cycle broken by a late import is a cycle)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("dxserve"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("dxserve"):
                target = node.module
            else:
                continue
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
    return found


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def test_no_import_cycles_inside_the_package() -> None:
    modules = _modules()
    graph = {
        name: {m for m in _imports(path, name) if m in modules and m != name}
        for name, path in modules.items()
    }
    # A package's __init__ re-exports its modules; an edge into a package means its
    # __init__, and __init__ -> own submodule edges are how packages are built.
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt.startswith(node + "."):  # a package importing its own submodules
                continue
            if node.startswith(nxt + "."):  # its own package: always loaded before it
                continue
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert cycles == []


def test_service_runs_without_http(tmp_path: Path) -> None:
    settings = Settings(store=tmp_path / "store", compilation_cache="", warm_up=False)
    x = np.array([1.0, 2.0, 3.0])

    async def drive() -> None:
        service = Service(settings)
        try:
            assert "rosenbrock" in {f["name"] for f in service.functions()}
            g = await service.gradient("rosenbrock", "jax-reverse", x)
            np.testing.assert_allclose(g, [-400.0, 1002.0, -200.0], rtol=1e-12)
            v, g2 = await service.value_and_gradient("rosenbrock", "auto", x)
            assert float(v) == pytest.approx(201.0, rel=1e-12)
            np.testing.assert_array_equal(g, g2)
            out = await service.call("hvp", "rosenbrock", "auto", x, (np.eye(3)[0],))
            # Rosenbrock Hessian, first column at (1, 2, 3): 1200 x1^2 - 400 x2 + 2, -400 x1, 0
            np.testing.assert_allclose(out["hvps"][0], [402.0, -400.0, 0.0], rtol=1e-12)
            handle = await service.prepare("gradient", "rosenbrock", "jax-reverse", x)
            np.testing.assert_array_equal(
                await service.gradient("rosenbrock", "jax-reverse", x, prep=handle["prep"]), g
            )
            described, created = await service.register(
                {"name": "sq", "expression": "jnp.sum(x ** 2)", "args": ["x"]}
            )
            assert created and described["kind"] == "expression"
            np.testing.assert_allclose(await service.gradient("sq", "auto", x), 2 * x, rtol=1e-14)
            assert await service.delete("sq") == "sq"
            from dxcontract.errors import UnauthorizedError, UnknownFunctionError

            with pytest.raises(UnknownFunctionError):
                await service.gradient("sq", "auto", x)
            service.authorize(None, "write")  # no tokens configured: open
            locked = Service.__new__(Service)
            locked.settings = settings.model_copy(update={"require_token_for_compute": True})
            locked._tokens = frozenset({"secret"})
            with pytest.raises(UnauthorizedError):
                locked.authorize("wrong", "compute")
            locked.authorize("secret", "compute")
            assert {b["type"] for b in service.backends()} >= {"jax-forward", "auto"}
        finally:
            service.close()

    asyncio.run(drive())


def _all_imports(path: Path) -> set[str]:
    """Every module ``path`` imports when it runs (absolute names only)."""
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return found


def test_the_server_imports_nothing_of_the_client_distribution() -> None:
    importing = sorted(
        str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
        if any(m == "dxclient" or m.startswith("dxclient.") for m in _all_imports(path))
    )
    assert importing == []


#: the client's one module that speaks HTTP over sockets itself (its fast path), and its size
CLIENT_FAST_PATH, FAST_PATH_MOST_LINES = "transport.py", 250


def test_socket_level_http_in_the_client_is_one_small_module() -> None:
    client = REPO / "clients" / "python" / "dxclient"
    speaking = sorted(
        path.name for path in client.rglob("*.py")
        if _all_imports(path) & {"socket", "select", "h11", "httpcore", "urllib3", "selectors"}
    )
    assert speaking == [CLIENT_FAST_PATH]
    lines = len((client / CLIENT_FAST_PATH).read_text().splitlines())
    assert lines <= FAST_PATH_MOST_LINES, f"the fast path grew to {lines} lines"


def test_the_contract_imports_neither_side_nor_jax() -> None:
    """The contract imports no jax except ``dxcontract/jax_rules.py`` (the JAX bridges'
    shared rules, imported only by them), and no other contract module imports it."""
    contract = REPO / "contract" / "dxcontract"
    jax_rules = contract / "jax_rules.py"
    assert jax_rules.is_file()
    for path in contract.rglob("*.py"):
        for module in _all_imports(path):
            top = module.split(".")[0]
            assert top not in ("dxserve", "dxclient", "httpx"), (path, module)
            if path != jax_rules:
                assert top not in ("jax", "jaxlib"), (path, module)
        tree = ast.parse(path.read_text())
        relative = {
            alias.name for node in _runtime_nodes(tree)
            if isinstance(node, ast.ImportFrom) and node.level and not node.module
            for alias in node.names
        } | {
            node.module.split(".")[0] for node in _runtime_nodes(tree)
            if isinstance(node, ast.ImportFrom) and node.level and node.module
        }
        assert "jax_rules" not in relative, path
        assert not any(m.startswith("dxcontract.jax_rules") for m in _all_imports(path)), path


# --- layers --------------------------------------------------------------------------
#: The library: operators own the maths, backends the mechanics; preparation, chunking
#: and what they use make a prepared executable of them. In process, no server runs.
LIBRARY_ROOTS = ("dxserve.core.operators", "dxserve.core.backends", "dxserve.core.preparation", "dxserve.core.chunking")
#: The service (registry, stores, workers, admission) and the doors into it (the request
#: pipeline, HTTP, the Ray handle, the CLI): what the library must never reach.
SERVER_LAYERS = ("dxserve.server", "dxserve.pipeline", "dxserve.http", "dxserve.ray_serve",
                 "dxserve.cli")
WEB_FRAMEWORKS = ("fastapi", "starlette", "uvicorn", "httptools", "h11", "prometheus_client")


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _reached_from(roots: tuple[str, ...]) -> dict[str, str]:
    """Every dxserve module the ``roots`` import, directly or not: ``{module: importer}``."""
    modules = _modules()
    graph = {name: {m for m in _imports(path, name) if m in modules and m != name}
             for name, path in modules.items()}
    seen: dict[str, str] = {}
    stack = [name for name in modules if _within(name, roots)]
    seen.update({name: name for name in stack})
    while stack:
        node = stack.pop()
        for nxt in graph[node]:
            if nxt not in seen:
                seen[nxt] = node
                stack.append(nxt)
    return seen


def test_the_library_imports_nothing_of_the_service_or_its_doors() -> None:
    reached = _reached_from(LIBRARY_ROOTS)
    assert {m: by for m, by in reached.items() if _within(m, SERVER_LAYERS)} == {}


def test_the_service_imports_no_web_framework() -> None:
    """Only the doors (``http/``, the Ray handle, the CLI that starts uvicorn) know one."""
    doors = ("dxserve.http", "dxserve.ray_serve", "dxserve.cli")
    modules = _modules()
    offending = {
        name: sorted(m for m in _all_imports(path) if m.split(".")[0] in WEB_FRAMEWORKS)
        for name, path in modules.items() if not _within(name, doors)
    }
    assert {name: found for name, found in offending.items() if found} == {}


#: Modules written against ``frameworks.Framework`` alone: they reach JAX (or any other
#: array framework) only through the function's framework, never by importing it.
FRAMEWORK_NEUTRAL = ("core", "frameworks/__init__.py")


def _neutral_files() -> list[Path]:
    out = []
    for name in FRAMEWORK_NEUTRAL:
        path = PACKAGE / name
        out.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return out


def _imported(path: Path, tops: tuple[str, ...]) -> list[str]:
    """Every import of a top-level package in ``tops`` anywhere in ``path`` (at module
    level, inside functions, for type checking)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in tops]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] in tops:
                found.append(node.module)
    return found


@pytest.mark.parametrize("path", _neutral_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_neutral_core_imports_no_jax_nor_torch(path: Path) -> None:
    """Not at module level, not inside a function, not for type checking: the one
    JAX-specific place is ``frameworks/jax.py`` (with the JAX engines and kinds), the one
    torch-specific place ``frameworks/torch.py`` (with the torch engines)."""
    assert _imported(path, ("jax", "jaxlib", "torch")) == []


#: The only modules that import torch, and only when a torch function or backend is used.
TORCH_MODULES = {"frameworks/torch/framework.py", "frameworks/torch/modes.py"}


def test_torch_lives_in_its_own_modules() -> None:
    importing = {
        str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
        if _imported(path, ("torch", "functorch"))
    }
    assert importing == TORCH_MODULES
    for path in (REPO / "contract", REPO / "clients" / "python"):
        assert [p for p in path.rglob("*.py") if _imported(p, ("torch",))] == []


_NO_TORCH_PROBE = """
import json, sys
import numpy as np
import dxserve, dxserve.http.app, dxserve.server.service, dxclient
from dxserve.core.backends import PLUGINS
g = dxserve.gradient(lambda x: (x ** 2).sum(), "auto", np.array([1.0, 2.0]))
print(json.dumps({"torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch"),
                  "backends": sorted(PLUGINS), "g": np.asarray(g).tolist()}))
"""


def test_importing_and_using_dxserve_imports_no_torch() -> None:
    """Torch's backends are registered without torch: it is imported when a torch
    function or engine is first used, never by dxserve itself."""
    out = subprocess.run(
        [sys.executable, "-c", _NO_TORCH_PROBE], capture_output=True, text=True, timeout=120,
        check=True,
    )
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["torch"] == []
    assert {"torch-forward", "torch-reverse", "jax-forward"} <= set(found["backends"])
    assert found["g"] == [2.0, 4.0]
