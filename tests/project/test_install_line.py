"""The README's client install line works in a fresh venv, with only this repository.

The line is read from README.md (the ``pip install ./contract './clients/python[...]'``
line of a ``sh`` block), so the test and the README cannot drift apart. It runs, from a
copy of the repository's client and contract sources (as a fresh clone has them: no
build outputs), in a
new venv whose ``pip`` comes first on PATH; then ``dxclient`` and ``dxclient.jax`` import
there and ``dxclient.__version__`` is the version in ``clients/python/pyproject.toml``.
Needs the package index; ``slow``: CI's ``make test-slow``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
LINE = re.compile(r"^pip install \./contract '\./clients/python\[[a-z,]+\]'$")


def readme_install_line() -> str:
    blocks = re.findall(r"```sh\n(.*?)```", (REPO / "README.md").read_text(encoding="utf-8"), re.S)
    lines = [ln.strip().removeprefix("$ ") for b in blocks for ln in b.splitlines()]
    lines = [ln for ln in lines if LINE.match(ln)]
    assert lines, (
        "README.md has no `pip install ./contract './clients/python[...]'` line in a sh block"
    )
    return lines[0]


def test_readme_install_line_in_a_fresh_venv(tmp_path: Path) -> None:
    line = readme_install_line()
    clone = tmp_path / "repo"
    for part in (("contract",), ("clients", "python")):  # the client and what it shares
        shutil.copytree(
            REPO.joinpath(*part),
            clone.joinpath(*part),
            ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__", "*.pyc"),
        )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(
        ["bash", "-c", line], cwd=clone, env=env, capture_output=True, text=True, timeout=1000
    )
    assert proc.returncode == 0, f"{line}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    check = (
        "import dxclient, dxclient.jax, jax; print(dxclient.__version__); print(dxclient.__file__)"
    )
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", check],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    version, where = out.stdout.split()
    pyproject = tomllib.loads((REPO / "clients" / "python" / "pyproject.toml").read_text())
    assert version == pyproject["project"]["version"]
    assert Path(where).is_relative_to(venv), where  # the venv's copy, not the source tree
