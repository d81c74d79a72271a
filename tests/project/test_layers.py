"""The folders of ``service/dxserve/`` and what each may import, checked against the tree.

The rules are read from the table under "Folders and layers" in docs/architecture.md, so
the page and the code cannot drift apart. Two rules:

* a module imports, when it loads, only the folders its folder's row names (imports
  inside a function run when the function is called, and are the way to reach a
  framework's own folder from above it);
* no module outside ``frameworks/`` (the example functions aside) imports JAX or torch,
  at any level of its file, nor loads them through the modules it imports when it loads.

Where today's code still falls short, the offenders are listed below by name. The lists
may only shrink: a test fails when a listed module no longer offends, so each fix
removes its line.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "service" / "dxserve"
PAGE = REPO / "docs" / "architecture.md"
FRAMEWORK_TOPS = ("jax", "jaxlib", "torch", "functorch")

#: Modules outside ``frameworks/`` whose file still imports JAX or torch (at any level).
DIRECT_OFFENDERS: set[str] = set()

#: Modules outside ``frameworks/`` that still load JAX or torch when imported, directly or
#: through the modules they import when they load.
LOADING_OFFENDERS: set[str] = set()

#: Load-time imports that break the folders' rules: ``(module, the module it imports)``.
LAYER_OFFENDERS: set[tuple[str, str]] = set()


# --- reading the tree ------------------------------------------------------------------


def _modules() -> dict[str, Path]:
    """``{dotted name: file}`` of every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _load_time_nodes(tree: ast.Module) -> list[ast.stmt]:
    """The statements that run when the module loads: not inside a function (or a
    lambda), not under ``if TYPE_CHECKING:``."""
    out: list[ast.stmt] = []
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.stmt):
            out.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return out


def _targets(node: ast.Import | ast.ImportFrom, name: str) -> set[str]:
    """The modules (of any package) an import statement in module ``name`` loads."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if node.level:
        base = name.split(".") if _is_package(name) else name.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    found = {module}
    found.update(f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in MODULES)
    return found


def _with_parents(module: str) -> set[str]:
    """A module and the packages Python loads before it."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def _load_time_imports(name: str) -> set[str]:
    """The modules ``name``'s import statements name, run when it loads."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in _load_time_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= _targets(node, name)
    return found - {name}


def _any_level_imports(name: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8"))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= _targets(node, name)
    return found


LOADS = {name: _load_time_imports(name) for name in MODULES}


def _outside_frameworks(name: str) -> bool:
    return not (name.startswith("dxserve.frameworks.") and name != "dxserve.frameworks") \
        and name != "dxserve.examples"


# --- the folders' rules, from the page -----------------------------------------------

ROW = re.compile(r"^\| (`[^|]+`) \| [^|]+ \| ([^|]+) \|\s*$", re.M)


def _units(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _rules() -> dict[str, set[str] | None]:
    """``{folder or file: the folders and files it may import}`` (None: anything)."""
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index("\n## Folders and layers\n"):]
    section = section[: section.index("\n## ", 1)]
    rules: dict[str, set[str] | None] = {}
    for owners, allowed in ROW.findall(section):
        may = None if allowed.strip() == "anything" else set(_units(allowed))
        for owner in _units(owners):
            rules[owner] = may
    return rules


RULES = _rules()


def _unit(name: str) -> str | None:
    """The row of the table a module belongs to (None: outside ``dxserve``)."""
    if name != "dxserve" and not name.startswith("dxserve."):
        return None
    rel = name.split(".")[1:]
    candidates = ["/".join(rel[:i]) + "/" for i in range(len(rel), 0, -1)]
    file = "/".join(rel) + ".py" if rel else "__init__.py"
    if name in MODULES and _is_package(name):
        file = "/".join([*rel, "__init__.py"])
    for unit in [file, *candidates]:
        if unit in RULES:
            return unit
    return None


def test_the_page_has_a_rule_for_every_module() -> None:
    assert len(RULES) >= 10, RULES
    assert {name: None for name in MODULES if _unit(name) is None} == {}


def _layer_breaks() -> set[tuple[str, str]]:
    breaks = set()
    for name, loads in LOADS.items():
        may = RULES[_unit(name)]
        if may is None:
            continue
        for target in loads:
            unit = _unit(target)
            if target == "dxserve" or unit is None or target not in MODULES:
                continue  # the top package (its __init__ loads nothing), or not dxserve
            if unit != _unit(name) and unit not in may:
                breaks.add((name, target))
    return breaks


def test_each_folder_imports_only_what_its_row_allows_when_it_loads() -> None:
    breaks = _layer_breaks()
    assert breaks - LAYER_OFFENDERS == set(), "new imports against the layers"
    assert LAYER_OFFENDERS - breaks == set(), "fixed: remove these from LAYER_OFFENDERS"


def test_only_frameworks_import_jax_or_torch() -> None:
    """At any level of the file: inside a function too."""
    importing = {
        name for name in MODULES if _outside_frameworks(name)
        and any(t.split(".")[0] in FRAMEWORK_TOPS for t in _any_level_imports(name))
    }
    assert importing - DIRECT_OFFENDERS == set(), "new imports of JAX or torch"
    assert DIRECT_OFFENDERS - importing == set(), "fixed: remove these from DIRECT_OFFENDERS"


def _loading_framework() -> dict[str, str]:
    """``{module: what it loads that loads JAX or torch}``, from load-time imports (a
    module's own packages load before it)."""
    deps = {
        name: set().union(*(_with_parents(t) for t in LOADS[name] | {name})) - {name}
        for name in MODULES
    }
    found = {
        name: target for name, loads in deps.items() for target in sorted(loads)
        if target.split(".")[0] in FRAMEWORK_TOPS
    }
    grew = True
    while grew:  # until no module is added: what loads a loader is one
        grew = False
        for name, loads in deps.items():
            if name not in found:
                by = sorted(t for t in loads if t in found)
                if by:
                    found[name], grew = by[0], True
    return found


def test_nothing_outside_frameworks_loads_jax_or_torch() -> None:
    loading = {name for name in _loading_framework() if _outside_frameworks(name)}
    assert loading - LOADING_OFFENDERS == set(), {
        n: c for n, c in _loading_framework().items() if n in loading - LOADING_OFFENDERS
    }
    assert LOADING_OFFENDERS - loading == set(), "fixed: remove these from LOADING_OFFENDERS"


_PROBE = """
import importlib, json, sys
for name in {names!r}:
    importlib.import_module(name)
print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules}} & {tops!r})))
"""


def test_importing_every_module_outside_frameworks_loads_neither() -> None:
    """What the reading of the files says, checked by importing them: every module
    outside ``frameworks/`` and off the list, in one fresh process."""
    names = sorted(
        name for name in MODULES
        if _outside_frameworks(name) and name not in LOADING_OFFENDERS
    )
    assert "dxserve.core.preparation" in names or "dxserve.core.preparation" in LOADING_OFFENDERS
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(names=names, tops=set(FRAMEWORK_TOPS))],
        capture_output=True, text=True, timeout=240, check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_offenders_are_real_modules() -> None:
    listed = DIRECT_OFFENDERS | LOADING_OFFENDERS | {m for pair in LAYER_OFFENDERS for m in pair}
    assert listed - set(MODULES) == set()


#: modules the package may keep at its top, beside its folders by layer
MOST_TOP_MODULES = 8


def test_the_package_keeps_a_handful_of_modules_at_its_top() -> None:
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= MOST_TOP_MODULES, top
