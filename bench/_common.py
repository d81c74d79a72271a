"""Helpers shared by the benchmarks: interleaved timing, servers by PID, tables.

Not a test module. The machine these run on is small and noisy, so every
benchmark times its candidates interleaved (round robin, rotating the starting
candidate each round) and reports medians and ratios.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"


# --- timing ---------------------------------------------------------------
def calibrate(fn: Callable[[], object], min_seconds: float) -> int:
    """Calls per sample so that one sample lasts at least ``min_seconds``."""
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    return max(1, int(min_seconds / once + 0.999))


class SelfTimed:
    """A candidate that times itself: calling it returns the seconds to count (e.g. a
    coroutine's own time inside its event loop, without the loop's start and stop)."""

    def __init__(self, fn: Callable[[], float]) -> None:
        self.fn = fn

    def __call__(self) -> float:
        return self.fn()


def sample(fn: Callable[[], object], inner: int) -> float:
    """Seconds per call, averaged over ``inner`` back-to-back calls."""
    if isinstance(fn, SelfTimed):
        return sum(fn() for _ in range(inner)) / inner
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner


def interleaved(
    candidates: dict[str, Callable[[], object]],
    rounds: int,
    *,
    min_sample_seconds: float = 0.0,
    budget_seconds: float | None = None,
    shuffle: bool = False,
) -> dict[str, list[float]]:
    """Time every candidate once per round, round robin; returns seconds per call.

    Each candidate is warmed up (one call) before timing. ``min_sample_seconds``
    batches fast calls so timer and loop overhead vanish; ``budget_seconds``
    stops early (after at least 3 rounds) when the rounds run long. ``shuffle``: a
    new random order each round (seeded), so no candidate always follows the same
    neighbour (a rotation keeps neighbours: one that leaves XLA's threads spinning or
    frees a lot of memory would always tax the next).
    """
    names = list(candidates)
    inner = {}
    for name in names:
        candidates[name]()  # warm up (compile, caches, connection)
        inner[name] = calibrate(candidates[name], min_sample_seconds) if min_sample_seconds else 1
    times: dict[str, list[float]] = {name: [] for name in names}
    started = time.perf_counter()
    rng = random.Random(0)
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        if shuffle:
            rng.shuffle(order)
        for name in order:
            times[name].append(sample(candidates[name], inner[name]))
        if budget_seconds is not None and r >= 2 and time.perf_counter() - started > budget_seconds:
            break
    return times


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def ms(seconds: float) -> str:
    value = seconds * 1e3
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 0.1:
        return f"{value:.2f}"
    return f"{value:.4f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


# --- tables and output ----------------------------------------------------
def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


class Tee:
    """Print and remember, so the same text can be saved under bench/results/."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def save(self, name: str) -> Path:
        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / name
        path.write_text("\n".join(self.lines) + "\n")
        return path


def machine_line() -> str:
    import platform

    import jax
    import numpy as np

    return (
        f"{platform.node() or 'host'}: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"jax {jax.__version__} ({jax.default_backend()}), numpy {np.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}"
    )


def commit_of(tree: Path, watched: str = ".") -> str:
    """``tree``'s commit (short hash and subject), and whether ``watched`` in it has
    uncommitted changes."""
    git = ["git", "-C", str(tree)]
    out = subprocess.run([*git, "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "status", "--porcelain", watched], capture_output=True, text=True)
    return out.stdout.strip()[:72] + (" (+ uncommitted changes)" if dirty.stdout.strip() else "")


# --- servers --------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A subprocess serving HTTP on 127.0.0.1:port; stopped by its own PID."""

    def __init__(
        self, argv: list[str], port: int, ready_path: str, log: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self._log_file = open(log, "wb")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, **(env or {})}
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "bench"), *filter(None, [env.get("PYTHONPATH")])]
        )
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )
        self._wait_ready(ready_path)

    def _wait_ready(self, path: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(self.url + path, timeout=1.0).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log_file.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


PYTHON = sys.executable
