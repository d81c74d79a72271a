"""The documentation site: its configuration page comes from ``Settings`` and cannot drift,
and the site builds with ``mkdocs build --strict`` (``make docs``; ``slow``, as CI runs it)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dxserve.settings import Settings
from tests.conftest import REPO

HOOK = REPO / "docs" / "hooks" / "settings_page.py"


def _hook():
    spec = importlib.util.spec_from_file_location("settings_page", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_setting_has_a_doc_comment() -> None:
    comments = _hook().field_comments()
    assert set(comments) == set(Settings.model_fields)
    assert not [name for name, text in comments.items() if not text]


def test_the_table_has_a_row_per_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DXSERVE_PORT", "9999")  # the page shows defaults, not this shell's
    monkeypatch.setenv("HOST", "0.0.0.0")
    table = _hook().settings_table()
    rows = table.splitlines()[2:]
    assert len(rows) == len(Settings.model_fields)
    by_name = {row.split("`")[1]: row for row in rows}
    for name in Settings.model_fields:
        assert f"DXSERVE_{name.upper()}" in by_name
    assert "| `8000` |" in by_name["DXSERVE_PORT"] and "`PORT`" in by_name["DXSERVE_PORT"]
    assert "| `127.0.0.1` |" in by_name["DXSERVE_HOST"]
    assert "| `dxserve.examples` |" in by_name["DXSERVE_FUNCTIONS"]
    assert "| `33554432` |" in by_name["DXSERVE_MAX_UPLOAD_BYTES"]
    assert "Largest `POST /functions` body" in by_name["DXSERVE_MAX_UPLOAD_BYTES"]


def _nav_pages(entries: list) -> list[str]:
    pages: list[str] = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages.extend(_nav_pages(value) if isinstance(value, list) else [value])
    return pages


def test_the_nav_lists_every_page_once() -> None:
    yaml = pytest.importorskip("yaml")
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    pages = _nav_pages(nav)
    on_disk = {
        p.relative_to(REPO / "docs").as_posix()
        for p in (REPO / "docs").rglob("*.md") if "hooks" not in p.parts
    }
    assert sorted(pages) == sorted(on_disk)


def test_the_pages_name_only_real_settings() -> None:
    """Every ``DXSERVE_<NAME>`` the README or a page names is a setting (or one that a
    setting's spelling shares, such as ``DXSERVE_EXPORT_GATE*``)."""
    settings = {f"DXSERVE_{name.upper()}" for name in Settings.model_fields}
    for path in [REPO / "README.md", *(REPO / "docs").rglob("*.md")]:
        named = set(re.findall(r"DXSERVE_[A-Z0-9_]*[A-Z0-9]", path.read_text(encoding="utf-8")))
        unknown = {n for n in named if n not in settings and n not in ("DXSERVE_URL",)}
        assert not unknown, (path.name, sorted(unknown))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO / "service"), str(REPO / "clients" / "python"),
                    os.environ.get("PYTHONPATH", "")) if p
    )
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=500,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = (tmp_path / "site" / "configuration" / "index.html").read_text()
    for name in Settings.model_fields:
        assert f"DXSERVE_{name.upper()}" in page
    assert "settings-table" not in page
