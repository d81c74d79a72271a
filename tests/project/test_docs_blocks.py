"""Every code block of the documentation runs as printed, against a real server.

```python blocks come from ``README.md`` and ``docs/*.md``. A block runs in a fresh
``python`` process, from a temporary directory, with the repository on the path; the
documented address ``http://127.0.0.1:8000`` (or ``localhost:8000``) is rewritten to the
test server's. An HTML comment on the line before a block changes how it runs:

* ``<!-- continue -->``: the block continues the one before it (the page's earlier
  blocks run first, in the same process), as a reader who ran them would have it;
* ``<!-- skip: reason -->``: the block is not run; the reason is reported;
* ``<!-- needs: mod1, mod2 -->``: the block needs optional packages (the page says which
  in words too); it runs where they import and is skipped, naming them, elsewhere.

A python block whose first line is ``# <name>.py`` is a module the pages tell the reader
to serve (``dxserve serve --functions dxserve.examples,<name>``): the test server serves
it as printed, beside the examples, and nothing else, so the pages can use only what a
reader's server has.

```sh blocks: a ``curl`` command (after a ``$`` prompt) against ``localhost:8000`` followed by a line of JSON
is run against the test server and its answer compared with that line (numbers to
1e-9; the string ``"..."`` matches anything). The block's curl commands before it run
first, in order (registering what it then uses), and must not answer a problem.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, ServerProcess, start_server, stop_server

DOCS = sorted((REPO / "docs").glob("*.md"))
README = REPO / "README.md"
#: What the pages call the server.
DOCUMENTED_URLS = ("http://127.0.0.1:8000", "http://localhost:8000")
BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
MARK = re.compile(r"<!--\s*(continue|skip|needs)\s*(?::\s*(.*?))?\s*-->\s*$")
MODULE = re.compile(r"\A# ([A-Za-z_][A-Za-z0-9_]*)\.py\n")
#: A shell block's prompt: the line is a command; a line without one after it, its answer.
PROMPT = "$ "
SH_BLOCK = re.compile(r"^```(?:sh|bash|shell)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)


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
        if mark and mark.group(1) == "needs":
            missing = [
                m.strip()
                for m in (mark.group(2) or "").split(",")
                if m.strip() and importlib.util.find_spec(m.strip()) is None
            ]
            found.append(
                Block(page, line, code, f"needs {', '.join(missing)}" if missing else None)
            )
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
        [sys.executable, "-c", code],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


DOC_BLOCKS = [b for page in DOCS for b in blocks(page)]
README_BLOCKS = blocks(README)


def served_modules() -> dict[str, str]:
    """``{name: code}`` of the module blocks (``# <name>.py`` first) of every page."""
    found: dict[str, str] = {}
    for block in [*README_BLOCKS, *DOC_BLOCKS]:
        match = MODULE.match(block.code)
        if match and block.skip is None:
            name = match.group(1)
            assert found.get(name, block.code) == block.code, f"two different {name}.py"
            found[name] = block.code
    return found


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server as the pages have it: the examples and the pages' own modules."""
    workdir = tmp_path_factory.mktemp("docs-server")
    modules = workdir / "modules"
    modules.mkdir()
    for name, code in served_modules().items():
        (modules / f"{name}.py").write_text(code, encoding="utf-8")
    path = os.pathsep.join(
        p for p in (str(REPO), str(modules), os.environ.get("PYTHONPATH", "")) if p
    )
    srv = start_server(
        workdir, env={"PYTHONPATH": path}, modules=("dxserve.examples", *served_modules())
    )
    try:
        yield srv
    finally:
        stop_server(srv)


def test_the_docs_have_blocks_to_run() -> None:
    assert DOCS, "docs/ has no pages"
    assert sum(b.skip is None for b in DOC_BLOCKS) >= 3, [b.id for b in DOC_BLOCKS]
    assert sum(b.skip is None for b in README_BLOCKS) >= 3, [b.id for b in README_BLOCKS]
    assert "mymodels" in served_modules()


def test_marks_are_read(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\na = 1\n```\n<!-- continue -->\n```python\nb = a + 1\n```\n"
        "<!-- skip: needs a GPU -->\n```python\nimport cupy\n```\n"
        "```python\nc = 3\n```\n"
        "<!-- needs: json, surely_not_a_module_here -->\n```python\nd = 4\n```\n"
        "<!-- needs: json -->\n```python\ne = 5\n```\n",
        encoding="utf-8",
    )
    got = blocks(page)
    assert [(b.line, b.skip) for b in got] == [
        (1, None),
        (5, None),
        (9, "needs a GPU"),
        (12, None),
        (16, "needs surely_not_a_module_here"),
        (20, None),
    ]
    assert got[1].code == "a = 1\n\nb = a + 1\n"
    assert got[3].code == "c = 3\n"


def _check(block: Block, url: str, workdir: Path) -> None:
    if block.skip is not None:
        pytest.skip(block.skip)
    proc = run_block(block, url, workdir)
    assert proc.returncode == 0, (
        f"{block.id} failed:\n{block.code}\n--- stdout\n{proc.stdout[-2000:]}"
        f"\n--- stderr\n{proc.stderr[-3000:]}"
    )


#: Pages whose every block runs in ``make test``: a newcomer's first ones.
FIRST_PAGES = ("index.md", "quickstart.md")


def _doc_params() -> list:
    """Each block of the docs; in ``make test`` every block of ``FIRST_PAGES`` and the last
    block of every other page (with the blocks it continues, the most of the page one
    process runs), the others marked slow (``make test-slow``, which CI runs): each block
    is a Python process of its own that imports JAX."""
    last = {b.page: b for b in DOC_BLOCKS}
    return [
        pytest.param(
            b,
            id=b.id,
            marks=() if b.page.name in FIRST_PAGES or last[b.page] is b else pytest.mark.slow,
        )
        for b in DOC_BLOCKS
    ]


@pytest.mark.parametrize("block", _doc_params())
def test_docs_block_runs(block: Block, docs_server: ServerProcess, tmp_path: Path) -> None:
    _check(block, docs_server.url, tmp_path)


@pytest.mark.parametrize("block", README_BLOCKS, ids=[b.id for b in README_BLOCKS])
def test_readme_block_runs(block: Block, docs_server: ServerProcess, tmp_path: Path) -> None:
    _check(block, docs_server.url, tmp_path)


# --- curl examples ------------------------------------------------------------------------
@dataclass(frozen=True)
class CurlExample:
    page: Path
    line: int  # of the checked command
    commands: tuple[str, ...]  # run in order; the last one's answer is checked
    expected: str

    @property
    def id(self) -> str:
        return f"{self.page.name}:{self.line}"


def curl_examples(page: Path) -> list[CurlExample]:
    """The page's curl commands (against localhost:8000) followed by a line of JSON."""
    text = page.read_text(encoding="utf-8")
    found: list[CurlExample] = []
    for match in SH_BLOCK.finditer(text):
        fence = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        if mark and mark.group(1) == "skip":
            continue
        lines = match.group(1).splitlines()
        commands: list[str] = []
        i = 0
        while i < len(lines):
            line = lines[i].removeprefix(PROMPT)
            if line.startswith("curl ") and "localhost:8000" in line + "".join(lines[i : i + 4]):
                command, first = line, fence + 1 + i
                while command.endswith("\\"):
                    i += 1
                    command = command[:-1] + " " + lines[i].strip()
                commands.append(command)
                nxt = lines[i + 1] if i + 1 < len(lines) else ""
                if nxt.startswith("{"):
                    found.append(CurlExample(page, first, tuple(commands), nxt))
                    commands = []
            i += 1
    return found


CURL_EXAMPLES = [c for page in [README, *DOCS] for c in curl_examples(page)]


def _matches(got: object, expected: object) -> bool:
    if expected == "...":
        return True
    if isinstance(expected, dict):
        return (
            isinstance(got, dict)
            and got.keys() == expected.keys()
            and all(_matches(got[k], v) for k, v in expected.items())
        )
    if isinstance(expected, list):
        return (
            isinstance(got, list)
            and len(got) == len(expected)
            and all(_matches(g, e) for g, e in zip(got, expected, strict=True))
        )
    if isinstance(expected, (int, float)) and not isinstance(expected, bool):
        return isinstance(got, (int, float)) and math.isclose(
            got, expected, rel_tol=1e-9, abs_tol=1e-12
        )
    return got == expected


def test_curl_examples_are_found() -> None:
    readme = [c for c in CURL_EXAMPLES if c.page == README]
    assert readme and "/gradient" in readme[0].commands[-1], CURL_EXAMPLES
    assert _matches({"a": [1.0, "x"]}, {"a": [1.0 + 1e-12, "x"]})
    assert not _matches({"a": [1.0]}, {"a": [1.1]}) and _matches({"p": "h1"}, {"p": "..."})


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl command")
@pytest.mark.parametrize("example", CURL_EXAMPLES, ids=[c.id for c in CURL_EXAMPLES])
def test_curl_example_answers_as_printed(example: CurlExample, docs_server: ServerProcess) -> None:
    host = docs_server.url.removeprefix("http://")
    answers = []
    for command in example.commands:
        command = command.replace("localhost:8000", host)
        proc = subprocess.run(
            ["bash", "-c", command + " -sS"], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, (command, proc.stderr)
        answers.append(json.loads(proc.stdout))
    for command, answer in zip(example.commands[:-1], answers[:-1], strict=True):
        assert "status" not in answer or answer["status"] < 400, (command, answer)
    expected = json.loads(example.expected)
    assert _matches(answers[-1], expected), (example.commands[-1], answers[-1], expected)
