"""The documentation site: its configuration page comes from ``Settings`` and cannot drift,
and the site builds with ``mkdocs build --strict`` (``make docs``; ``slow``, as CI runs it)."""

from __future__ import annotations

import importlib.util
import os
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
