"""Every ```python block of the documentation runs, against a real server.

Blocks come from ``docs/*.md`` (and ``README.md``, see below). A block runs in a fresh
``python`` process, from a temporary directory, with the repository on the path; the
documented address ``http://127.0.0.1:8000`` (or ``localhost:8000``) is rewritten to the
test server's. An HTML comment on the line before a block changes how it runs:

* ``<!-- continue -->``: the block continues the one before it (the page's earlier
  blocks run first, in the same process), as a reader who ran them would have it;
* ``<!-- skip: reason -->``: the block is not run; the reason is reported.

README.md's blocks are collected too, but run only with ``DXSERVE_CHECK_README=1``:
the README is being rewritten, and these tests switch on when it is (until then each
is skipped, saying so).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, ServerProcess

DOCS = sorted((REPO / "docs").glob("*.md"))
README = REPO / "README.md"
CHECK_README = os.environ.get("DXSERVE_CHECK_README") == "1"
#: What the pages call the server.
DOCUMENTED_URLS = ("http://127.0.0.1:8000", "http://localhost:8000")
BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
MARK = re.compile(r"<!--\s*(continue|skip)\s*(?::\s*(.*?))?\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    code: str  # with every block it continues before it
    skip: str | None = None

    @property
    def id(self) -> str:
        return f"{self.page.name}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The page's python blocks, each with the code it continues (see the module)."""
    text = page.read_text(encoding="utf-8")
    found: list[Block] = []
    for match in BLOCK.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        code = match.group(1)
        if mark and mark.group(1) == "skip":
            found.append(Block(page, line, code, mark.group(2) or "marked skip"))
            continue
        if mark and mark.group(1) == "continue":
            if not found:
                raise ValueError(f"{page.name}:{line}: '<!-- continue -->' on the first block")
            earlier = found[-1]
            code = earlier.code + "\n" + code
            if earlier.skip is not None:  # continuing a skipped block: skipped alike
                found.append(Block(page, line, code, f"continues a skipped block ({earlier.skip})"))
                continue
        found.append(Block(page, line, code))
    return found


def run_block(block: Block, url: str, workdir: Path) -> subprocess.CompletedProcess:
    code = block.code
    for documented in DOCUMENTED_URLS:
        code = code.replace(documented, url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DXSERVE_")}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )
    env["DXSERVE_URL"] = url
    return subprocess.run(
        [sys.executable, "-c", code], cwd=workdir, env=env, capture_output=True, text=True,
        timeout=240,
    )


DOC_BLOCKS = [b for page in DOCS for b in blocks(page)]
README_BLOCKS = blocks(README)


def test_the_docs_have_blocks_to_run() -> None:
    assert DOCS, "docs/ has no pages"
    assert sum(b.skip is None for b in DOC_BLOCKS) >= 3, [b.id for b in DOC_BLOCKS]


def test_marks_are_read(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\na = 1\n```\n<!-- continue -->\n```python\nb = a + 1\n```\n"
        "<!-- skip: needs a GPU -->\n```python\nimport cupy\n```\n"
        "```python\nc = 3\n```\n",
        encoding="utf-8",
    )
    got = blocks(page)
    assert [(b.line, b.skip) for b in got] == [(1, None), (5, None), (9, "needs a GPU"), (12, None)]
    assert got[1].code == "a = 1\n\nb = a + 1\n"
    assert got[3].code == "c = 3\n"


@pytest.mark.parametrize("block", DOC_BLOCKS, ids=[b.id for b in DOC_BLOCKS])
def test_docs_block_runs(block: Block, server: ServerProcess, tmp_path: Path) -> None:
    if block.skip is not None:
        pytest.skip(block.skip)
    proc = run_block(block, server.url, tmp_path)
    assert proc.returncode == 0, (
        f"{block.id} failed:\n{block.code}\n--- stdout\n{proc.stdout[-2000:]}"
        f"\n--- stderr\n{proc.stderr[-3000:]}"
    )


@pytest.mark.parametrize("block", README_BLOCKS, ids=[b.id for b in README_BLOCKS])
def test_readme_block_runs(block: Block, server: ServerProcess, tmp_path: Path) -> None:
    if not CHECK_README:
        pytest.skip("README blocks run with DXSERVE_CHECK_README=1 (the README is being rewritten)")
    if block.skip is not None:
        pytest.skip(block.skip)
    proc = run_block(block, server.url, tmp_path)
    assert proc.returncode == 0, (
        f"{block.id} failed:\n{block.code}\n--- stderr\n{proc.stderr[-3000:]}"
    )
