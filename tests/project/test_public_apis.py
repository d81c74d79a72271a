"""dxserve uses uvicorn, Starlette and FastAPI through their public APIs only.

Read from the source (``ast``), for every module of the server but the one quarantined
protocol module (``http/protocol.py``, plugged in through uvicorn's ``http=`` option):

* no private import: no ``_``-prefixed module or name, and nothing of
  ``uvicorn.protocols`` (the protocol implementations);
* no subclass of their classes but the documented extension points;
* no assignment to an attribute of their objects (the app, a request, a route, a
  config...), but the documented ones: ``app.state``/``request.state`` and
  ``app.openapi`` (FastAPI's way to shape the OpenAPI document);
* the service core and the library, and the request layer, import none of the three.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "service" / "dxserve"
FRAMEWORKS = ("uvicorn", "starlette", "fastapi")
#: the one module allowed to build on uvicorn's internals
QUARANTINED = PACKAGE / "http" / "protocol.py"
#: modules that may import a web framework at all: the front doors
FRONT_DOORS = {PACKAGE / "cli.py", PACKAGE / "ray_serve.py", *(PACKAGE / "http").glob("*.py")}
#: classes of theirs documented as meant to be subclassed
EXTENSION_POINTS = {
    "starlette.responses.Response", "starlette.responses.StreamingResponse",
    "starlette.endpoints.HTTPEndpoint", "starlette.middleware.base.BaseHTTPMiddleware",
}
#: attributes of their objects documented as meant to be set
SETTABLE = {"openapi", "openapi_schema"}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != QUARANTINED)


def _framework(module: str | None) -> bool:
    return module is not None and module.split(".")[0] in FRAMEWORKS


class _Reader(ast.NodeVisitor):
    """What one module does with the frameworks."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.imported: dict[str, str] = {}  # local name -> "module.name" of a framework
        self.objects: set[str] = set()  # local names holding their objects
        self.imports_framework = False

    # --- imports ---------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if _framework(alias.name):
                self.imports_framework = True
                self._check_path(alias.name, node)
                self.imported[alias.asname or alias.name.split(".")[0]] = alias.name

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not _framework(node.module):
            return
        self.imports_framework = True
        self._check_path(node.module or "", node)
        for alias in node.names:
            if alias.name.startswith("_"):
                self.problems.append(f"line {node.lineno}: private name {node.module}.{alias.name}")
            self.imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def _check_path(self, module: str, node: ast.AST) -> None:
        parts = module.split(".")
        if any(p.startswith("_") for p in parts) or module.startswith("uvicorn.protocols"):
            self.problems.append(f"line {node.lineno}: internal module {module}")

    # --- subclasses ---------------------------------------------------------------------
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for base in node.bases:
            name = self._qualified(base)
            if name is not None and name not in EXTENSION_POINTS:
                self.problems.append(f"line {node.lineno}: {node.name} subclasses {name}")
        self.generic_visit(node)

    def _qualified(self, node: ast.AST) -> str | None:
        """The framework name ``node`` refers to (``fastapi.routing.APIRoute``), if any."""
        if isinstance(node, ast.Name):
            return self.imported.get(node.id)
        if isinstance(node, ast.Attribute):
            inner = self._qualified(node.value)
            return f"{inner}.{node.attr}" if inner is not None else None
        return None

    # --- their objects ------------------------------------------------------------------
    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for arg in [*node.args.args, *node.args.kwonlyargs]:
            if arg.annotation is not None and self._names_framework_type(arg.annotation):
                self.objects.add(arg.arg)
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def _names_framework_type(self, annotation: ast.AST) -> bool:
        return any(
            isinstance(n, ast.Name) and n.id in self.imported for n in ast.walk(annotation)
        )

    def visit_Assign(self, node: ast.Assign) -> None:
        if isinstance(node.value, ast.Call) and self._qualified(node.value.func) is not None:
            for target in node.targets:
                if isinstance(target, ast.Name):
                    self.objects.add(target.id)
        for target in node.targets:
            self._check_target(target, node)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._check_target(node.target, node)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
            if self._theirs(node.args[0]):
                self.problems.append(f"line {node.lineno}: setattr on one of their objects")
        self.generic_visit(node)

    def _check_target(self, target: ast.AST, node: ast.AST) -> None:
        if not isinstance(target, ast.Attribute):
            return
        owner = target.value
        if isinstance(owner, ast.Attribute) and owner.attr == "state":
            return  # app.state.x / request.state.x: their documented place for ours
        if target.attr in SETTABLE:
            return
        if self._theirs(owner):
            self.problems.append(f"line {node.lineno}: sets .{target.attr} on one of their objects")

    def _theirs(self, node: ast.AST) -> bool:
        """Is ``node`` one of their objects (or classes, or modules)?"""
        if isinstance(node, ast.Name):
            return node.id in self.objects or node.id in self.imported
        if isinstance(node, ast.Call):
            return self._qualified(node.func) is not None
        if isinstance(node, ast.Attribute):
            return self._theirs(node.value)
        return False


def _read(path: Path) -> _Reader:
    reader = _Reader()
    reader.visit(ast.parse(path.read_text(), str(path)))
    return reader


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_public_apis_of_the_web_stack(path: Path) -> None:
    assert _read(path).problems == []


def test_only_the_front_doors_import_a_web_framework() -> None:
    importing = {p for p in PACKAGE.rglob("*.py") if _read(p).imports_framework}
    assert importing <= FRONT_DOORS, sorted(str(p.relative_to(PACKAGE)) for p in importing - FRONT_DOORS)
    # the library and the service layer never import one, whatever their depth
    below = ("core", "frameworks", "server", "pipeline")
    assert not [p for p in importing if p.relative_to(PACKAGE).parts[0] in below]


def test_the_checker_sees_what_it_forbids(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol\n"
        "from starlette._utils import is_async_callable\n"
        "from fastapi import FastAPI, Request\n"
        "from fastapi.routing import APIRoute, _thing\n"
        "from starlette.responses import Response\n"
        "class Route(APIRoute): pass\n"
        "class Fine(Response): pass\n"
        "app = FastAPI()\n"
        "app.build_middleware_stack = None\n"
        "app.state.service = None\n"
        "app.openapi = None\n"
        "def handler(request: Request):\n"
        "    request.scope_thing = 1\n"
        "    request.state.ok = 1\n"
        "    setattr(app, 'x', 1)\n"
    )
    problems = _read(bad).problems
    assert len(problems) == 7, problems
    for what in ("internal module uvicorn.protocols", "private name", "internal module starlette._utils",
                 "Route subclasses fastapi.routing.APIRoute", ".build_middleware_stack",
                 ".scope_thing", "setattr"):
        assert any(what in p for p in problems), (what, problems)


def test_the_architecture_page_lists_every_module_of_the_http_layer() -> None:
    page = (PACKAGE.parents[1] / "docs" / "architecture.md").read_text()
    table = page[page.index("### `service/dxserve/`"):]
    table = table[: table.index("\n\n", table.index("| module |"))]
    listed = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `http/")}
    modules = {f"http/{p.name}" for p in (PACKAGE / "http").glob("*.py")}
    assert listed == modules
