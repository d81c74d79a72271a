"""``dxserve serve --workers N``: N server processes on one port, one store.

The supervisor (the process ``dxserve serve`` starts as) runs no server itself: it
starts N copies of the same command with ``DXSERVE_WORKER_INDEX`` set, and each binds
its own listening socket on the shared port with ``SO_REUSEPORT``, so the kernel
spreads new connections over the processes (a listening socket inherited by every
process would not: asyncio accepts a burst of connections in whichever process wakes
first). Each worker has its own event loop, device worker threads and JAX runtime;
they share the store (an SQLite file or PostgreSQL, see ``stores``) and the JAX
compilation cache directory (entries are written to a temporary name and renamed).

Worker ``i`` gets ``CUDA_VISIBLE_DEVICES=worker_devices[i % len]`` when
``--worker-devices`` is given, so each process owns its GPU.

A worker that dies (a crash, the OOM killer, SIGKILL) is started again; one that dies
within ``FAST_EXIT`` seconds of starting five times in a row stops the whole server
(it would only die again: a bad setting, a port in use). SIGTERM or SIGINT to the
supervisor stops every worker gracefully (SIGTERM, then SIGKILL once their
``shutdown_timeout`` and ``STOP_GRACE`` have passed).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

from dxserve.settings import Settings

log = logging.getLogger("dxserve.supervisor")

#: A worker that exits sooner than this after starting counts as failing to start.
FAST_EXIT = 10.0
#: Seconds beyond ``shutdown_timeout`` a worker gets to close its service on shutdown.
STOP_GRACE = 15.0


def reuse_port_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket on ``(host, port)`` that other processes may bind too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def supervise(settings: Settings, argv: list[str]) -> int:
    """Run ``settings.workers`` copies of ``dxserve <argv>`` until SIGTERM/SIGINT."""
    if not hasattr(socket, "SO_REUSEPORT"):  # pragma: no cover - not Linux/BSD/macOS
        print("dxserve: --workers needs SO_REUSEPORT (Linux, BSD, macOS)", file=sys.stderr)
        return 2
    if settings.store.lower().startswith("dir:"):
        print("dxserve: --workers needs a shared store (a path: SQLite, or postgresql://); "
              "a dir:// store belongs to one process", file=sys.stderr)
        return 2
    port = settings.port or _free_port(settings.host)
    # The port is reserved for the workers: held (bound, never listening) while they start,
    # so a port already in use is reported here, once.
    try:
        holder = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind((settings.host, port))
    except OSError as exc:
        print(f"dxserve: cannot bind {settings.host}:{port}: {exc}", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "dxserve.cli", *argv, "--port", str(port)]
    devices = settings.worker_devices

    def start(index: int) -> subprocess.Popen:
        env = dict(os.environ, DXSERVE_WORKER_INDEX=str(index))
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = devices[index % len(devices)]
        return subprocess.Popen(command, env=env)

    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    workers = {i: (start(i), time.monotonic()) for i in range(settings.workers)}
    log.info("supervisor (pid %d): %d workers on %s:%d: %s", os.getpid(), len(workers),
             settings.host, port, " ".join(str(p.pid) for p, _ in workers.values()))
    fast_exits = 0
    code = 0
    try:
        while not stopping:
            time.sleep(0.2)
            for index, (proc, started) in list(workers.items()):
                if stopping or proc.poll() is None:
                    continue
                lived = time.monotonic() - started
                fast_exits = fast_exits + 1 if lived < FAST_EXIT else 0
                log.warning("worker %d (pid %d) exited with %s after %.1f s; starting it again",
                            index, proc.pid, proc.returncode, lived)
                if fast_exits >= 5:
                    log.error("workers keep failing to start; stopping")
                    stopping, code = True, 1
                    break
                workers[index] = (start(index), time.monotonic())
    finally:
        for proc, _ in workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + settings.shutdown_timeout + STOP_GRACE
        for proc, _ in workers.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        holder.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return code
