"""What ``dxserve serve`` says before it serves: a port that is taken, where the store
is, where the API's pages are, and nothing a newcomer must learn to ignore."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DXSERVE_")}
    env.pop("PORT", None)
    env.pop("HOST", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def test_a_port_in_use_is_an_error_before_the_banner(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "dxserve.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--store",
                str(tmp_path / "store"),
            ],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert f"port {port}" in out and "already in use" in out, out
    assert f"PORT={port + 1} make serve" in out and "--port" in out, out
    # said first, and instead of a start-up log that looks like success
    assert "functions:" not in out and "Uvicorn running" not in out, out
    assert out.strip().startswith("dxserve: port"), out
    assert not (tmp_path / "store").exists(), "the store was opened before the port check"


def test_a_free_port_passes_the_check() -> None:
    from dxserve.cli import port_problem

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert port_problem("127.0.0.1", port) is None
    assert port_problem("127.0.0.1", 0) is None


@pytest.mark.parametrize("host", ["no-such-host.invalid"])
def test_an_unknown_host_is_named(host: str) -> None:
    from dxserve.cli import port_problem

    problem = port_problem(host, 8000)
    assert problem is not None and host in problem and "--host" in problem


def test_the_log_names_the_store_and_the_docs_and_carries_no_noise(
    make_server, tmp_path: Path
) -> None:
    cache = tmp_path / "fresh-jax-cache"  # not there yet, as on a first start
    srv = make_server(args=["--compilation-cache", str(cache)])
    log = srv.log.read_text()
    assert f"store: {srv.store}" in log, log  # the full path, as given
    assert f"API documentation: {srv.url}/docs" in log, log
    assert "not pruned" not in log, log
    assert "Unable to initialize backend" not in log, log  # JAX's TPU line
    assert "Deprecat" not in log and "BuildBackendWarning" not in log, log
    # said before the server says it is running
    assert log.index("store:") < log.index("Uvicorn running"), log


def test_a_relative_store_says_it_follows_the_working_directory() -> None:
    from dxserve.cli import store_location
    from dxserve.settings import Settings

    default = store_location(Settings(store="dxserve-store"))
    assert default.startswith(os.path.join(os.getcwd(), "dxserve-store"))
    assert "(the default)" in default and "working directory" in default
    assert "--store" in default
    assert store_location(Settings(store="dir:///srv/dx")) == "/srv/dx"
    remote = store_location(Settings(store="postgresql://dx:secret@db:5432/dxserve"))
    assert "secret" not in remote and "db" in remote


def test_help_states_the_store_default() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dxserve.cli", "serve", "--help"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "Default: dxserve-store in the working directory" in text, text


def test_help_imports_no_jax() -> None:
    """``dxserve --help`` answers at once: building the parser and printing help load
    neither JAX nor the server (no timing here: what is imported is what costs)."""
    code = (
        "import sys, contextlib, io\n"
        "import dxserve.cli\n"
        "parser = dxserve.cli.build_parser()\n"
        "for argv in (['--help'], ['serve', '--help'], ['ray', '--help']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        dxserve.cli.main(argv)\n"
        "heavy = sorted(m for m in ('jax', 'jaxlib', 'torch', 'fastapi', 'uvicorn')\n"
        "               if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


def test_lazy_names_are_the_operators() -> None:
    import dxserve
    import dxserve.core.operators

    assert set(dxserve._OPERATOR_NAMES) == set(dxserve.core.operators.__all__)
    for name in dxserve.__all__:
        assert getattr(dxserve, name) is not None, name
    assert "gradient" in dir(dxserve)
