"""Schemathesis against a live server: its OpenAPI document holds for what it answers.

``st run`` reads ``/openapi.json`` from a real ``dxserve serve`` (the example functions,
its own store: the run also registers and deletes functions) and sends generated
requests to every operation: the document's examples, then property-based fuzzing
(``--max-examples`` per operation, fixed seed). Checks: no 5xx
(``not_a_server_error``), every status documented (``status_code_conformance``), the
documented media types (``content_type_conformance``) and bodies that match the
response schemas (``response_schema_conformance``). ``slow``: CI's ``make test-slow``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import start_server, stop_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


def schemathesis(
    url: str, *, phases: str, max_examples: int, seed: int, cwd: Path, extra: tuple[str, ...] = ()
) -> None:
    cmd = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json",
        "--checks", CHECKS, "--phases", phases, "--max-examples", str(max_examples),
        "--seed", str(seed), "--workers", "1", "--no-color", "--output-truncate", "false",
        "--request-timeout", "300",  # the server's own deadline: a busy machine is slow, not wrong
        *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1100, cwd=cwd)
    report = proc.stdout[-20000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, f"schemathesis found failures:\n{report}"
    assert " passed" in proc.stdout.split("SUMMARY")[-1], report  # it did run cases


# The coverage phase walks each schema's boundary values (about 500 cases per operation,
# whatever --max-examples says); /prepare/{op} takes the same bodies as /{op}, so it
# skips them there. Examples and fuzzing cover every operation.
@pytest.mark.parametrize(
    ("phases", "max_examples", "extra"),
    [("examples,fuzzing", 10, ()), ("coverage", 1, ("--exclude-path-regex", "^/prepare/"))],
    ids=["examples-and-fuzzing", "coverage"],
)
def test_schemathesis_finds_nothing(
    tmp_path: Path, phases: str, max_examples: int, extra: tuple[str, ...]
) -> None:
    server = start_server(tmp_path / "server", modules=("dxserve.examples",))
    try:
        schemathesis(
            server.url, phases=phases, max_examples=max_examples, seed=15, cwd=tmp_path, extra=extra
        )
        assert server.proc.poll() is None, "the server died"
    finally:
        stop_server(server)
