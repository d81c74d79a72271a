"""The README stays a newcomer's page: short, in the order they need it, and its shell
blocks safe to paste (commands behind a ``$`` prompt, answers without one)."""

from __future__ import annotations

import re

from tests.conftest import REPO

README = REPO / "README.md"
#: Past this, a topic belongs on its docs page, with one line and a link here.
MOST_LINES = 200
SH_BLOCK = re.compile(r"^```(?:sh|bash|shell)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
COMMANDS = ("curl ", "make ", "pip ", "docker ", "dxserve ", ".venv/", "source ", "python")


def test_readme_is_at_most_200_lines() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MOST_LINES, (
        f"README.md has {lines} lines (at most {MOST_LINES}): move the newest section to "
        "its docs/*.md page and leave one line with a link"
    )


def test_readme_puts_first_things_first() -> None:
    text = README.read_text(encoding="utf-8")
    order = [
        "## Two commands",
        "## A first gradient",
        "## The library",
        "## The client",
        "## Serve your own function",
        "## Docker",
        "## Documentation",
    ]
    at = [text.find(heading) for heading in order]
    assert -1 not in at and at == sorted(at), dict(zip(order, at, strict=True))
    own = text[text.find("## Serve your own function") : text.find("## Docker")]
    assert "Stop `make serve` first" in own and "--port" in own
    assert "dxserve-store" in text and "--store" in text  # where the store is
    assert "/docs" in text


def test_readme_shell_commands_have_prompts() -> None:
    """Pasting a block runs no answer as a command: every command is behind ``$ ``."""
    text = README.read_text(encoding="utf-8")
    for block in SH_BLOCK.findall(text):
        continued = False
        for line in block.splitlines():
            if not continued:
                assert not line.startswith(COMMANDS), f"command without a '$ ' prompt: {line}"
            continued = line.endswith("\\")
        assert block.startswith("$ "), block
