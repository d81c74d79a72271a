"""The architecture page (docs/architecture.md) names every module, and only modules that
exist: its module tables are compared with the files, so the page cannot drift."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO

PAGE = REPO / "docs" / "architecture.md"
#: The packages whose every module the page lists, one table each.
PACKAGES = ("service/dxserve", "contract/dxcontract", "clients/python/dxclient")
HEADING = re.compile(r"^### `([^`]+)/`\s*$", re.M)
ROW = re.compile(r"^\| `([^`]+\.py)` \| (.+?) \|\s*$", re.M)


def module_tables(text: str) -> dict[str, dict[str, str]]:
    """``{package: {module path inside it: its job}}`` from the page's ``## Modules``."""
    section = text[text.index("\n## Modules\n"):]
    headings = list(HEADING.finditer(section))
    tables: dict[str, dict[str, str]] = {}
    for i, heading in enumerate(headings):
        end = headings[i + 1].start() if i + 1 < len(headings) else len(section)
        rows = ROW.findall(section[heading.end():end])
        tables[heading.group(1)] = dict(rows)
        assert len(tables[heading.group(1)]) == len(rows), f"a module listed twice in {heading.group(1)}"
    return tables


def modules_on_disk(package: str) -> set[str]:
    root = REPO / package
    return {p.relative_to(root).as_posix() for p in root.rglob("*.py") if "__pycache__" not in p.parts}


TABLES = module_tables(PAGE.read_text(encoding="utf-8"))


def test_the_page_has_a_table_per_package() -> None:
    assert set(TABLES) == set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_is_listed_and_no_other(package: str) -> None:
    listed, present = set(TABLES[package]), modules_on_disk(package)
    assert not present - listed, f"modules missing from docs/architecture.md: {sorted(present - listed)}"
    assert not listed - present, f"docs/architecture.md lists modules that do not exist: {sorted(listed - present)}"
    assert all(job.strip() for job in TABLES[package].values())


def test_paths_named_in_the_prose_exist() -> None:
    """Every `path.py` or `dir/` the page names outside its tables exists in the repository
    or in one of the packages (placeholders such as `<family>.py` aside)."""
    text = PAGE.read_text(encoding="utf-8")
    prose = text[: text.index("\n## Modules\n")]
    named = set(re.findall(r"`([A-Za-z0-9_./]+(?:\.py|/))`", prose))
    assert len(named) > 20, named
    roots = [REPO, *(REPO / p for p in PACKAGES)]
    missing = [n for n in named if not any((root / n).exists() for root in roots)]
    assert not missing, missing


def test_the_tables_are_read(tmp_path: Path) -> None:
    text = (
        "# A\n\n## Modules\n\n### `pkg/`\n\n| module | its job |\n|---|---|\n"
        "| `a.py` | does a |\n| `sub/b.py` | does b |\n\n### `other/`\n\n| module | its job |\n"
        "|---|---|\n| `c.py` | does c |\n"
    )
    assert module_tables(text) == {"pkg": {"a.py": "does a", "sub/b.py": "does b"}, "other": {"c.py": "does c"}}
