"""mkdocs hook: the configuration page's table, generated from ``dxserve.settings.Settings``.

Every field becomes a row: its environment variable, type, default and the ``#:``
comment written right above it in ``settings.py``. The page holds the
marker ``<!-- settings-table -->`` where the table goes, so the page cannot drift
from the code. ``tests/test_docs_site.py`` checks that every field has a comment.
"""

from __future__ import annotations

import ast
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SETTINGS_SOURCE = ROOT / "service" / "dxserve" / "settings.py"
MARKER = "<!-- settings-table -->"
PAGE = "configuration.md"
#: Variables read besides ``DXSERVE_<NAME>`` (containers and PaaS set them).
ALSO_READ = {"host": "HOST", "port": "PORT"}


def field_comments(source: str = "") -> dict[str, str]:
    """``{field: its doc comment}`` for the fields of class ``Settings`` in ``source``
    (``settings.py`` by default): the ``#:`` lines right above each field, or ''."""
    text = source or SETTINGS_SOURCE.read_text(encoding="utf-8")
    lines = text.splitlines()
    tree = ast.parse(text)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Settings")
    comments: dict[str, str] = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        block: list[str] = []
        i = node.lineno - 2  # the line above, 0-based
        while i >= 0 and lines[i].strip().startswith("#:"):
            block.insert(0, lines[i].strip()[2:].strip())
            i -= 1
        comments[node.target.id] = " ".join(block)
    return comments


@contextmanager
def _clean_environment():
    """Defaults as a fresh shell sees them: no DXSERVE_*, HOST or PORT set."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("DXSERVE_") or k in ("HOST", "PORT")}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def _settings_class() -> Any:
    for path in (ROOT / "service", ROOT / "clients" / "python"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    from dxserve.settings import Settings

    return Settings


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "").replace("pathlib.", "")
    return text.replace("Annotated[", "").replace(", NoDecode]", "").replace("NoneType", "None")


def _default(field: Any) -> str:
    with _clean_environment():
        value = field.get_default(call_default_factory=True)
    if isinstance(value, list):
        return ",".join(str(v) for v in value) if value else '""'
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_table() -> str:
    """The Markdown table of every setting."""
    settings = _settings_class()
    comments = field_comments()
    rows = [
        "| Variable | Type | Default | Meaning |",
        "|---|---|---|---|",
    ]
    for name, field in settings.model_fields.items():
        variable = f"`DXSERVE_{name.upper()}`"
        if name in ALSO_READ:
            variable += f" / `{ALSO_READ[name]}`"
        meaning = comments.get(name, "").replace("``", "`")
        rows.append(
            f"| {variable} | `{_cell(_type_name(field.annotation))}` | "
            f"`{_cell(_default(field))}` | {_cell(meaning)} |"
        )
    return "\n".join(rows) + "\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """mkdocs: fill the configuration page's marker with the table."""
    if page.file.src_uri == PAGE:
        if MARKER not in markdown:
            raise ValueError(f"{PAGE} has no {MARKER} marker for the settings table")
        return markdown.replace(MARKER, settings_table())
    return markdown
