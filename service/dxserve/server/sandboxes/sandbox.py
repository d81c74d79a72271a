"""Bounded child processes: work that could exhaust the server, done where it cannot.

A ``Sandbox`` is a *fork server*, started lazily with ``python -I`` and a minimal
environment (nothing of the server's: no tokens, no paths but those passed). It imports
what its jobs need once, runs ``prepare`` once (e.g. to load compiled code), then forks
one child per job, ahead of time: the next child is forked as soon as the last job is
answered and runs ``warm`` while it waits (what every job needs but the fork server
must not do, e.g. start JAX's backend), so a job pays only for itself. Given its job,
the child sets its own limits (``RLIMIT_AS``: its address space plus
``memory_bytes``; ``RLIMIT_CPU``; no core file; killed if the fork server exits), runs
the job and writes its answer; the fork server kills it at the wall-clock deadline and
reports how it ended (``Outcome``). Jobs run one at a time, which bounds a sandbox's
memory to one running child (and one waiting).

A job is a function ``job(header: dict, payload: bytes) -> (reply: dict, payload: bytes)``
of an importable module, named ``"module:function"``. Headers and replies are JSON,
payloads raw bytes: nothing is pickled either way. A job's own refusals belong in its
reply; an exception escaping it is status ``"error"``, a ``MemoryError`` ``"memory"``.

The fork server imports JAX but never starts its backend (the XLA client's threads
would not survive a fork); children start it when they need it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Limits", "Outcome", "Sandbox"]

log = logging.getLogger("dxserve.sandbox")

_READY = b"dxserve-sandbox ready\n"
_FRAME = struct.Struct(">IQ")  # header length, payload length
#: Seconds the fork server may take to start (python, JAX, the job's imports, prepare).
START_TIMEOUT = 180.0
#: Largest reply header (JSON) a child may write.
MAX_HEADER_BYTES = 1 << 20


@dataclass(frozen=True)
class Limits:
    """What one job may use: address space beyond the fork server's, wall-clock (and
    CPU) seconds, and bytes of reply payload."""

    memory_bytes: int
    seconds: float
    reply_bytes: int


@dataclass(frozen=True)
class Outcome:
    """How a job ended.

    ``status``: "ok" (the job answered: ``reply`` and ``payload``), "timeout" (killed at
    the deadline), "memory" (``MemoryError``), "crashed" (a signal: ``signal``),
    "error" (the job raised: ``detail``), "failed" (exited without an answer),
    "too_large" (its answer was over ``reply_bytes``) or "unavailable" (no fork server).
    ``detail`` also carries the tail of a crashed child's stderr.
    """

    status: str
    reply: dict[str, Any] = field(default_factory=dict)
    payload: bytes = b""
    seconds: float = 0.0
    signal: int = 0
    detail: str = ""


_BOOT = """\
import os, sys
sys.path[:0] = [p for p in sys.argv[1].split(os.pathsep) if p]
from dxserve.server.sandboxes.sandbox import _fork_server_main
_fork_server_main(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
"""


def _child_env(workdir: str) -> dict[str, str]:
    """The fork server's whole environment: nothing of the server's (tokens, paths)."""
    return {
        "PATH": os.defpath,
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "JAX_PLATFORMS": "cpu",
        "PYTHONDONTWRITEBYTECODE": "1",
        # One thread per maths library and few malloc arenas: the address-space limit
        # then bounds real allocations, not per-thread reservations.
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "NUMBA_NUM_THREADS": "1",
        "MALLOC_ARENA_MAX": "2",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }


class Sandbox:
    """A fork server running ``job`` ("module:function") in bounded children.

    ``paths``: ``sys.path`` entries the fork server imports from (``-I`` ignores
    ``PYTHONPATH``); by default the directories holding dxserve and dxcontract.
    ``prepare``: "module:function" the fork server runs once before its first job;
    ``warm``: one each child runs before it is given its job, while the server is idle
    (things the fork server must not do, like starting JAX's backend); "" for none.
    ``name`` goes into log lines; ``env``: variables added to the fork server's minimal
    environment.
    """

    def __init__(
        self, job: str, *, prepare: str = "", warm: str = "",
        paths: Sequence[str] | None = None, name: str = "sandbox",
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.job, self.prepare, self.warm, self.name = job, prepare, warm, name
        self.env = dict(env or {})
        self.paths = list(paths) if paths is not None else _own_paths()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._workdir: tempfile.TemporaryDirectory | None = None

    @property
    def pid(self) -> int | None:
        """The fork server's process id (None until started)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def run(self, header: dict[str, Any], payload: bytes, limits: Limits) -> Outcome:
        """Run one job in a child within ``limits`` (waits for the one before it)."""
        frame = {
            "job": header, "memory": int(limits.memory_bytes), "seconds": float(limits.seconds),
            "reply_bytes": int(limits.reply_bytes),
        }
        with self._lock:
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._proc = self._start()
            except OSError as e:
                self._proc = None
                return Outcome("unavailable", detail=str(e)[:300])
            proc = self._proc
            assert proc.stdin is not None and proc.stdout is not None
            head = json.dumps(frame).encode()
            try:
                proc.stdin.write(_FRAME.pack(len(head), len(payload)) + head)
                proc.stdin.write(payload)
                proc.stdin.flush()
                deadline = time.monotonic() + limits.seconds + 30.0
                nh, npay = _FRAME.unpack(_read_exact_until(proc.stdout, _FRAME.size, deadline))
                if nh > MAX_HEADER_BYTES + 4096 or npay > limits.reply_bytes:
                    raise ValueError("reply over its bounds")
                reply = json.loads(_read_exact_until(proc.stdout, nh, deadline))
                body = _read_exact_until(proc.stdout, npay, deadline) if npay else b""
                if not isinstance(reply, dict):
                    raise ValueError("not an object")
            except (OSError, ValueError) as e:
                # The fork server itself failed (it never runs a job itself, so this is
                # rare): a fresh one next time.
                log.error("%s: fork server failed: %s", self.name, e)
                self._kill(proc)
                self._proc = None
                return Outcome("unavailable", detail="the sandbox stopped")
        return Outcome(
            str(reply.get("status", "failed")), reply.get("reply") or {}, body,
            float(reply.get("seconds", 0.0)), int(reply.get("signal", 0)),
            str(reply.get("detail", ""))[:2000],
        )

    def stop(self) -> None:
        """Stop the fork server (it also exits when this process does)."""
        with self._lock:
            if self._proc is not None:
                self._kill(self._proc)
                self._proc = None
            if self._workdir is not None:
                self._workdir.cleanup()
                self._workdir = None

    def _start(self) -> subprocess.Popen:
        self._workdir = self._workdir or tempfile.TemporaryDirectory(prefix=f"dxserve-{self.name}-")
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _BOOT, os.pathsep.join(self.paths), self.job,
             self.prepare, self.warm, self.name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # the children's crash messages go to the server's log
            env={**_child_env(self._workdir.name), **self.env},
            cwd=self._workdir.name,
            close_fds=True,
            start_new_session=True,  # a terminal's Ctrl-C does not reach it
        )
        try:
            line = _read_line(proc.stdout, time.monotonic() + START_TIMEOUT)
        except OSError as e:
            self._kill(proc)
            raise OSError(f"the {self.name} did not start: {e}") from None
        if line != _READY:
            self._kill(proc)
            raise OSError(f"the {self.name} did not start (said {line[:200]!r})")
        log.info("%s: fork server started (pid %d)", self.name, proc.pid)
        return proc

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.wait(timeout=10)


def _own_paths() -> list[str]:
    """The directories dxserve and dxcontract are imported from."""
    import dxcontract
    import dxserve

    return [os.path.dirname(os.path.dirname(os.path.abspath(m.__file__)))
            for m in (dxserve, dxcontract)]


def _read_line(stream: Any, deadline: float) -> bytes:
    """One line from a pipe, or ``OSError`` at EOF or the deadline."""
    fd = stream.fileno()
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise OSError("timed out")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                raise OSError("it exited")
            buf += chunk
    return buf


def _read_exact_until(stream: Any, n: int, deadline: float) -> bytes:
    """``n`` bytes from a pipe, or ``OSError`` at EOF or the deadline."""
    fd = stream.fileno()
    out = bytearray()
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise OSError("timed out waiting for the fork server")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, min(n - len(out), 1 << 20))
            if not chunk:
                raise OSError("the fork server exited")
            out += chunk
    return bytes(out)


# --- the fork server and its children (their own processes) ----------------------------
def _resolve(target: str) -> Any:
    import importlib

    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _read_exact(fd: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, min(n - len(out), 1 << 20))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


def _fork_server_main(job: str, prepare: str, warm: str, name: str) -> None:
    """Import the job once, run ``prepare``, then hand each job read from stdin to a
    child: a *spare* forked ahead of time, which ran ``warm`` while it waited (so the
    job does not pay for it), or a fresh child if the spare died.

    It exits at EOF on stdin, i.e. when the server exits. (No ``PR_SET_PDEATHSIG``
    here: it fires when the *thread* that started this process exits, and the server
    starts it from a pool thread that may retire while another thread uses it.)
    """
    reply = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the replies
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a dead spare: EPIPE, not death
    fn = _resolve(job)
    warm_fn = _resolve(warm) if warm else None
    if prepare:
        try:
            _resolve(prepare)()
        except Exception as e:  # noqa: BLE001 - a slower first job, not a failure
            print(f"{name}: prepare failed: {e!r}", file=sys.stderr)
    reply.write(_READY)
    reply.flush()
    spare = _Spare.fork(fn, warm_fn)
    while True:
        try:
            nh, nb = _FRAME.unpack(_read_exact(0, _FRAME.size))
            frame = json.loads(_read_exact(0, nh))
            payload = _read_exact(0, nb)
        except EOFError:
            spare.discard()
            os._exit(0)
        if not spare.give(frame, payload):  # it died while it waited: a fresh one
            spare = _Spare.fork(fn, None)
            spare.give(frame, payload)
        outcome, body = spare.wait(frame)
        head = json.dumps(outcome).encode()
        reply.write(_FRAME.pack(len(head), len(body)) + head)
        reply.write(body)
        reply.flush()
        spare = _Spare.fork(fn, warm_fn)  # warms while the server is idle


def _vm_size() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _limit(memory: int, seconds: float) -> None:
    """Address space: what this process has now plus ``memory``; CPU: what it used so
    far (a spare's warm-up) plus ``seconds``; no core file."""
    import resource

    space = _vm_size() + memory
    resource.setrlimit(resource.RLIMIT_AS, (space, space))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = max(1, math.ceil(usage.ru_utime + usage.ru_stime + seconds))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class _Spare:
    """A forked child waiting for one job on a pipe (in the fork server)."""

    def __init__(self, pid: int, jobs: int, answer: int, stderr: int) -> None:
        self.pid, self.jobs, self.answer, self.stderr = pid, jobs, answer, stderr
        self.started = 0.0

    @classmethod
    def fork(cls, fn: Any, warm: Any) -> _Spare:
        jr, jw = os.pipe()  # the job, in
        r, w = os.pipe()  # the answer, out
        er, ew = os.pipe()  # its stderr: kept, and its tail reported when it crashes
        pid = os.fork()
        if pid == 0:
            os.close(jw)
            os.close(r)
            os.close(er)
            os.dup2(ew, 2)
            _die_with_parent()
            _spare_main(fn, warm, jr, w)
        for fd in (jr, w, ew):
            os.close(fd)
        return cls(pid, jw, r, er)

    def give(self, frame: dict[str, Any], payload: bytes) -> bool:
        """Hand it the job; False if it is gone (it died while it waited)."""
        self.started = time.monotonic()
        head = json.dumps(frame).encode()
        try:
            _write_all(self.jobs, _FRAME.pack(len(head), len(payload)) + head)
            _write_all(self.jobs, payload)
        except OSError:
            self.discard()
            return False
        os.close(self.jobs)
        self.jobs = -1
        return True

    def discard(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        for fd in (self.jobs, self.answer, self.stderr):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.jobs = self.answer = self.stderr = -1

    def wait(self, frame: dict[str, Any]) -> tuple[dict, bytes]:
        """Its answer, or how it ended: killed at the deadline, or past the reply bound."""
        seconds = float(frame.get("seconds", 60.0))
        limit = int(frame.get("reply_bytes", 0)) + MAX_HEADER_BYTES + _FRAME.size
        r, er = self.answer, self.stderr
        deadline = self.started + seconds
        out, err = bytearray(), b""
        open_fds = {r, er}
        ended = ""
        while r in open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                ended = "timeout"
                break
            ready, _, _ = select.select(list(open_fds), [], [], left)
            for fd in ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    open_fds.discard(fd)
                elif fd == r:
                    out += chunk
                    if len(out) > limit:
                        ended = "too_large"
                else:
                    err = (err + chunk)[-4096:]
            if ended:
                break
        took = round(time.monotonic() - self.started, 6)
        if ended:
            self.discard()
            return {"status": ended, "seconds": took}, b""
        for fd in (r, er):
            os.close(fd)
        self.answer = self.stderr = -1
        _, status = os.waitpid(self.pid, 0)  # the pipe closed: it has exited or is exiting
        tail = err.decode("utf-8", "replace")[-600:]
        if os.WIFSIGNALED(status):
            return {"status": "crashed", "signal": os.WTERMSIG(status), "detail": tail,
                    "seconds": took}, b""
        try:
            nh, nb = _FRAME.unpack_from(out, 0)
            if _FRAME.size + nh + nb != len(out):
                raise ValueError("a short answer")
            result = json.loads(bytes(out[_FRAME.size:_FRAME.size + nh]))
            if not isinstance(result, dict):
                raise ValueError("not an object")
        except (ValueError, struct.error):
            code = os.WEXITSTATUS(status)
            return {"status": "memory" if code == 3 else "failed", "code": code,
                    "detail": tail, "seconds": took}, b""
        result["seconds"] = took
        if result.get("status") != "ok":
            result.setdefault("detail", tail)
            return result, b""
        return result, bytes(out[_FRAME.size + nh:])


def _spare_main(fn: Any, warm: Any, jobs: int, w: int) -> None:
    """In a spare child: warm up, wait for one job, run it within its limits, answer on
    ``w``; never returns."""
    if warm is not None:
        try:
            warm()
        except Exception as e:  # noqa: BLE001 - the job pays for it instead
            print(f"sandbox: warm-up failed: {e!r}", file=sys.stderr)
    try:
        nh, nb = _FRAME.unpack(_read_exact(jobs, _FRAME.size))
        frame = json.loads(_read_exact(jobs, nh))
        payload = _read_exact(jobs, nb)
    except (EOFError, OSError, ValueError):
        os._exit(0)  # the fork server is gone, or this spare was never used
    os.close(jobs)
    code = 0
    body = b""
    try:
        _limit(int(frame["memory"]), float(frame["seconds"]))
        answer, body = fn(frame["job"], payload)
        result: dict[str, Any] = {"status": "ok", "reply": answer}
    except MemoryError:
        result, body, code = {"status": "memory"}, b"", 3
    except BaseException as e:  # noqa: BLE001 - report, never raise out of a forked child
        result, body, code = {"status": "error", "detail": f"{type(e).__name__}: {e}"[:1000]}, b"", 4
    with contextlib.suppress(BaseException):
        head = json.dumps(result).encode()
        _write_all(w, _FRAME.pack(len(head), len(body)) + head)
        _write_all(w, body)
    os._exit(code)
