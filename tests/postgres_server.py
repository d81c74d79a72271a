"""A real PostgreSQL server for tests: ``initdb`` in a temporary directory, ``postgres``
on a free port on 127.0.0.1 (its unix socket in the same directory), stopped by PID.

Run as the ``postgres`` user (``runuser``) when the tests run as root, since
PostgreSQL refuses to run as root. The binaries are Debian's (``postgresql`` package,
``/usr/lib/postgresql/<version>/bin``) or any on ``PATH``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import free_port


def find_bin_dir() -> Path | None:
    """The directory holding ``initdb`` and ``postgres`` (newest version), or None."""
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                      key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    return Path(versions[-1]).parent if versions else None


@dataclass
class Postgres:
    url: str  # postgresql://postgres@127.0.0.1:<port>/postgres
    port: int
    proc: subprocess.Popen
    directory: Path

    def database(self, name: str) -> str:
        """Create database ``name``; its URL."""
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url.rsplit("/", 1)[0] + "/" + name


def _as_postgres(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def _postmaster_pid(data: Path) -> int | None:
    try:
        return int((data / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def running_postgres(timeout: float = 60.0) -> Iterator[Postgres]:
    """Start a fresh PostgreSQL; stop it (fast shutdown, then SIGKILL) and remove its files."""
    bins = find_bin_dir()
    if bins is None:
        raise FileNotFoundError("PostgreSQL's initdb was not found (apt-get install postgresql)")
    directory = Path(tempfile.mkdtemp(prefix="dxserve-pg-"))
    data = directory / "data"
    if os.geteuid() == 0:
        shutil.chown(directory, "postgres", "postgres")
    subprocess.run(
        _as_postgres([str(bins / "initdb"), "-D", str(data), "-U", "postgres",
                      "--auth=trust", "-E", "UTF8", "--no-sync"]),
        check=True, capture_output=True, timeout=timeout,
    )
    port = free_port()
    log = open(directory / "postgres.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        _as_postgres([str(bins / "postgres"), "-D", str(data), "-p", str(port),
                      "-k", str(directory), "-c", "listen_addresses=127.0.0.1",
                      "-c", "fsync=on", "-c", "max_connections=100"]),
        stdout=log, stderr=subprocess.STDOUT,
    )
    server = Postgres(f"postgresql://postgres@127.0.0.1:{port}/postgres", port, proc, directory)
    try:
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    "postgres exited: " + (directory / "postgres.log").read_text(errors="replace")
                )
            try:
                psycopg.connect(server.url, connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield server
    finally:
        if proc.poll() is None:
            # SIGINT to the postmaster itself (runuser's child): "fast" shutdown
            postmaster = _postmaster_pid(data) or proc.pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(postmaster, signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(postmaster, signal.SIGKILL)
                proc.kill()
                proc.wait(timeout=10)
        log.close()
        shutil.rmtree(directory, ignore_errors=True)
