"""A client generated from ``openapi/openapi.json`` by ``openapi-python-client`` works.

In a fresh venv (a temporary directory, so its dependencies never meet ours):
install ``openapi-python-client``, generate a package from the committed document
(renamed ``dxserve-openapi-client`` / ``dxserve_openapi`` so it cannot shadow
``dxclient``), pip-install it, and call ``/gradient`` and ``/hvp`` of a real server through
its generated ``sync`` functions and models. Values are checked against Rosenbrock's
closed forms. Needs the package index (the venv's pip); ``slow``: CI's ``make test-slow``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO, start_server, stop_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
GENERATOR = "openapi-python-client>=0.24,<0.29"

CONFIG = """\
project_name_override: dxserve-openapi-client
package_name_override: dxserve_openapi
post_hooks: []
"""

CALLS = r"""
import json, sys
from dxserve_openapi import Client
from dxserve_openapi.api.operators import gradient, hvp
from dxserve_openapi.models import GradientRequest, HvpRequest, GradientResponse, HvpResponse

client = Client(base_url=sys.argv[1], raise_on_unexpected_status=True)
g = gradient.sync(client=client, body=GradientRequest.from_dict(
    {"function": "rosenbrock", "backend": "jax-reverse", "x": [1.0, 2.0, 3.0]}))
assert isinstance(g, GradientResponse), g
h = hvp.sync(client=client, body=HvpRequest.from_dict({
    "function": "rosenbrock",
    "backend": {"type": "second-order", "outer": {"type": "jax-forward"}, "inner": "jax-reverse"},
    "x": [1.0, 2.0, 3.0], "tangents": [[1.0, 0.0, -1.0], [0.0, 1.0, 0.0]]}))
assert isinstance(h, HvpResponse), h
print(json.dumps({"gradient": g.gradient, "hvps": h.hvps}))
"""


def _run(cmd: list[str], timeout: float = 600, **kw) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_generated_client_gradient_and_hvp(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py, bindir = venv / "bin" / "python", venv / "bin"
    _run([str(py), "-m", "pip", "install", "-q", GENERATOR])
    (tmp_path / "config.yaml").write_text(CONFIG)
    out = tmp_path / "generated"
    _run([
        str(bindir / "openapi-python-client"), "generate", "--path", str(REPO / "openapi" / "openapi.json"),
        "--config", str(tmp_path / "config.yaml"), "--meta", "setup", "--output-path", str(out),
    ], cwd=tmp_path)  # fmt: skip
    _run([str(py), "-m", "pip", "install", "-q", str(out)])

    server = start_server(tmp_path / "server", modules=("dxserve.examples",))
    try:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only the venv's packages
        answer = json.loads(_run([str(py), "-c", CALLS, server.url], timeout=120, cwd=tmp_path, env=env))
    finally:
        stop_server(server)
    # Rosenbrock at (1, 2, 3): gradient (-400, 1002, -200); H = [[402, -400, 0],
    # [-400, 3802, -800], [0, -800, 200]]
    H = np.array([[402.0, -400.0, 0.0], [-400.0, 3802.0, -800.0], [0.0, -800.0, 200.0]])
    np.testing.assert_allclose(answer["gradient"], [-400.0, 1002.0, -200.0], rtol=1e-12)
    np.testing.assert_allclose(answer["hvps"], [H @ [1.0, 0.0, -1.0], H @ [0.0, 1.0, 0.0]], rtol=1e-12)
