"""Every script in ``examples/`` runs end to end against a real server (``dxserve serve``).

Each example is a subprocess with ``DXSERVE_URL`` pointing at one server started for this
module (the served ``dxserve.examples`` functions, as ``make serve`` has). An example
checks its own result and exits non-zero on failure; the test asserts exit 0 and the
output lines that show the check ran.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.conftest import REPO, ServerProcess, start_server, stop_server

pytestmark = [pytest.mark.slow, pytest.mark.examples]
EXAMPLES = REPO / "examples"
RUN_TIMEOUT = 240.0


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path_factory.mktemp("dxserve-examples"), modules=("dxserve.examples",))
    try:
        yield srv
    finally:
        stop_server(srv)


def run_example(server: ServerProcess, cmd: Sequence[str]) -> str:
    env = {**os.environ, "DXSERVE_URL": server.url}
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{output}\n{server.output()}"
    assert "OK" in proc.stdout.splitlines()[-1], output
    return output


def test_train_mlp(served: ServerProcess) -> None:
    out = run_example(served, [sys.executable, str(EXAMPLES / "train_mlp.py")])
    assert "loss:" in out and "in 300 steps" in out


def test_scipy_trust_ncg_plot(served: ServerProcess, tmp_path: Path) -> None:
    out = run_example(served, [sys.executable, str(EXAMPLES / "scipy_trust_ncg.py"), str(tmp_path)])
    png = tmp_path / "rosenbrock-trust-ncg.png"
    assert "trust-ncg:" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000  # a drawn figure, not an empty canvas


def test_jit_composition_hessian(served: ServerProcess) -> None:
    out = run_example(served, [sys.executable, str(EXAMPLES / "jit_composition.py")])
    assert "hessian   shape (5, 5)" in out and "Hessian symmetric: True" in out


def test_curl_script(served: ServerProcess) -> None:
    if shutil.which("curl") is None:
        pytest.fail("curl is needed by examples/curl.sh")
    out = run_example(served, ["bash", str(EXAMPLES / "curl.sh")])
    assert '"gradient":[-400.0,1002.0,-200.0]' in out and '"hvps":[[402.0,400.0,-200.0]]' in out


def test_node_fetch(served: ServerProcess) -> None:
    if shutil.which("node") is None:
        pytest.skip("node (>= 18, global fetch) is not installed")
    out = run_example(served, ["node", str(EXAMPLES / "fetch.mjs")])
    assert "gradient [" in out and "hvp [" in out


def test_sparsity_pattern(tmp_path: Path) -> None:
    """The in-process example (no server): draws the Laplacian's detected pattern."""
    png = tmp_path / "pattern.png"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "sparsity_pattern.py"), str(png)],
        cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
