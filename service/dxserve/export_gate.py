"""The export gate: an uploaded bundle is first read and compiled outside the server.

Deserializing a JAX export runs native code (the StableHLO bytecode reader behind
``Exported.mlir_module()``), and a corrupted bundle can crash it: a segfault or heap
corruption there would take the whole server down. So before the server reads a
bundle in process, a short-lived, resource-limited child process does everything
the server is about to do with it: ``load_exported`` (deserialize every artifact,
build its MLIR module, check the manifest), then compile and run, once, on the
signature's example shapes, the value, JVP, VJP and both second-order maps. Only a
bundle whose child finished and said "ok" is loaded in process; a child that
crashes, runs out of memory or CPU time, or does not finish in time is a 422
``InvalidExportError`` naming ``export``.

How the children are made (cheaply): a *fork server* is started once, lazily, with
``python -I`` and a minimal environment. It imports JAX and dxserve (no backend, no
threads), then, for each bundle, forks a child that sets its limits
(``RLIMIT_AS``: the fork server's own address space plus ``memory_bytes``;
``RLIMIT_CPU``; no core file), checks the bundle and writes one JSON line. The fork
server never reads a bundle itself; it only forks, waits (killing the child at the
wall-clock timeout) and reports how the child ended. One bundle is checked at a
time, which also bounds the gate's memory to one child.

A pass is bound to the content's sha256: ``passed`` digests are kept in memory and
``stamp`` gives the metadata the registry persists beside the store record
(``{"export_gate": {"sha256", "version", "jax", "platform"}}``). At load, a record
whose stamp matches its content, this gate's version, this JAX and this platform is
trusted (``admit``); any other record (older versions of dxserve wrote none) is
gated again, in a child, before it is read in process. ``require`` is what the
export kind calls before it deserializes anything.

On a GPU server the child runs on the CPU: it reads and inspects every artifact but
compiles only when the bundle has a CPU lowering too (a CUDA lowering compiles on
the GPU, in process, on first use).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dxcontract.errors import InvalidExportError, OverloadedError
from dxcontract.lru import LRU

__all__ = ["GATE_VERSION", "ExportGate", "GateConfig", "check", "default"]

log = logging.getLogger("dxserve.export_gate")

#: Bumped when the gate checks more: stamps of an older version are gated again.
GATE_VERSION = 1
_STAMP_KEY = "export_gate"
_READY = b"dxserve-export-gate ready\n"


@dataclass(frozen=True)
class GateConfig:
    """How bundles are gated (``DXSERVE_EXPORT_GATE*`` settings)."""

    enabled: bool = True
    #: Address space a child may add to the fork server's own (``RLIMIT_AS``).
    memory_bytes: int = 4 << 30
    #: Wall-clock seconds a check may take; also its CPU-time limit.
    timeout: float = 60.0
    #: "refuse": exports with loops of no static trip count are refused; "allow".
    unbounded_loops: str = "refuse"

    @classmethod
    def from_settings(cls, settings: Any) -> GateConfig:
        """The gate's fields of a ``Settings``."""
        return cls(
            enabled=bool(getattr(settings, "export_gate", True)),
            memory_bytes=int(getattr(settings, "export_gate_memory_bytes", cls.memory_bytes)),
            timeout=float(getattr(settings, "export_gate_timeout", cls.timeout)),
            unbounded_loops=str(getattr(settings, "export_unbounded_loops", cls.unbounded_loops)),
        )


def _digest(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def _platform() -> str:
    from .exported import server_platform

    return server_platform()


def _make_stamp(hexdigest: str, platform: str) -> dict[str, Any]:
    import jax

    return {
        "sha256": hexdigest,
        "version": GATE_VERSION,
        "jax": jax.__version__,
        "platform": platform,
    }


class ExportGate:
    """One server's gate: its configuration, the passes it has seen (bound to content
    hashes) and its fork server, started on first use. A ``Service`` owns one."""

    def __init__(self, config: GateConfig | None = None) -> None:
        self.config = config or GateConfig()
        if not self.config.enabled:
            log.warning("export gate is OFF: uploaded bundles are deserialized in the server process")
        self._passed: LRU[str, dict[str, Any]] = LRU(65536)  # sha256 hex -> stamp
        self._server = _ForkServer()

    def passed(self, content: bytes) -> bool:
        """Whether ``content`` (these exact bytes) passed this gate or was admitted."""
        return self._passed.peek(_digest(content)) is not None

    def stamp(self, content: bytes) -> dict[str, Any]:
        """Metadata recording that ``content`` passed (``{}`` if it did not)."""
        found = self._passed.peek(_digest(content))
        return {_STAMP_KEY: dict(found)} if found is not None else {}

    def admit(self, content: bytes, metadata: Mapping[str, Any] | None) -> None:
        """Trust a stored record's stamp if it matches ``content``; else gate it now."""
        hexdigest = _digest(content)
        if self._passed.peek(hexdigest) is not None or not self.config.enabled:
            return
        found = (metadata or {}).get(_STAMP_KEY)
        platform = _platform()
        if isinstance(found, dict) and found == _make_stamp(hexdigest, platform):
            self._passed.put(hexdigest, dict(found))
            return
        log.info("export gate: checking a stored bundle without a current stamp (sha256 %s)",
                 hexdigest[:16])  # fmt: skip
        self.check(content)

    def require(self, content: bytes) -> None:
        """Before ``content`` is deserialized in process: it must have passed (gated now
        if not)."""
        if self.config.enabled and not self.passed(content):
            self.check(content)

    def check(self, content: bytes, *, _fault: str | None = None) -> dict:
        """Gate ``content`` (see ``check``), remembering its pass."""
        found = check(content, cfg=self.config, server=self._server, _fault=_fault)
        self._passed.put(found["sha256"], found)
        return found

    def shutdown(self) -> None:
        """Stop the fork server (it also exits when this process does)."""
        self._server.stop()


_default: list[ExportGate] = []
_default_lock = threading.Lock()


def default() -> ExportGate:
    """The gate of code that runs outside any ``Service`` (the library, a script), made
    on first use from the ``DXSERVE_*`` environment variables."""
    with _default_lock:
        if not _default:
            from .settings import Settings

            _default.append(ExportGate(GateConfig.from_settings(Settings())))
        return _default[0]


def _bad(detail: str) -> InvalidExportError:
    return InvalidExportError(detail, field="export")


def check(
    content: bytes, *, cfg: GateConfig | None = None, server: _ForkServer | None = None,
    _fault: str | None = None,
) -> dict:
    """Gate ``content`` with ``cfg`` in ``server``'s children (the default gate's when not
    given): returns its stamp, or raises ``InvalidExportError(field="export")``.

    The container (magic, manifest, per-artifact sha256, size) is checked here, in
    plain Python, so garbage is refused without a child. ``_fault`` makes the child
    misbehave (``"abort"``, ``"hang"``, ``"exit"``, ``"oom"``); tests only, not reachable
    over HTTP.
    """
    from dxcontract.bundle import split_bundle

    from .exported import DEFAULT_MAX_BUNDLE_BYTES

    if cfg is None or server is None:
        gate = default()
        cfg, server = cfg or gate.config, server or gate._server
    content = bytes(content)
    if len(content) > DEFAULT_MAX_BUNDLE_BYTES:
        raise _bad(f"the export is {len(content)} bytes; the limit is {DEFAULT_MAX_BUNDLE_BYTES}")
    try:
        split_bundle(content)
    except ValueError as e:
        raise _bad(str(e)) from None
    hexdigest = _digest(content)
    platform = _platform()
    header = {"platform": platform, "timeout": cfg.timeout, "memory": cfg.memory_bytes,
              "unbounded_loops": cfg.unbounded_loops}
    if _fault:
        header["fault"] = _fault
    started = time.monotonic()
    reply = server.run(header, content, cfg.timeout)
    seconds = time.monotonic() - started
    status = reply.get("status")
    if status == "ok":
        result = _make_stamp(hexdigest, platform)
        log.info("export gate: passed sha256 %s in %.2f s", hexdigest[:16], seconds)
        return dict(result)
    # refusals are the normal answer to bad input; a dead or stuck child is worth a warning
    level = logging.INFO if status == "refused" else logging.WARNING
    log.log(level, "export gate: refused sha256 %s in %.2f s: %s", hexdigest[:16], seconds, reply)
    if status == "refused":  # load_exported's own refusal, message kept
        raise _bad(str(reply.get("detail", "invalid export")))
    if status == "timeout":
        raise _bad(f"checking the export timed out after {cfg.timeout:g} s; it was not stored")
    if status == "crashed":
        sig = int(reply.get("signal", 0))
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and seconds >= cfg.timeout * 0.9):
            raise _bad(f"checking the export exceeded its CPU-time limit ({cfg.timeout:g} s)")
        raise _bad(
            f"the export crashed the process that checked it ({_signame(sig)}); "
            "it is corrupt or hostile and was not stored"
        )
    if status == "memory":
        raise _bad(f"checking the export exceeded its memory limit ({cfg.memory_bytes >> 20} MiB)")
    if status == "error":
        raise _bad(f"the export failed when compiled and run: {str(reply.get('detail'))[:500]}")
    if status == "unavailable":
        raise OverloadedError(
            f"the export checker could not run ({reply.get('detail')}); retry later",
            field="export",
        )
    raise _bad(
        "the process that checked the export exited without an answer "
        f"(status {reply.get('code', '?')}); it was not stored"
    )


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


# --- the parent's side: one fork server ------------------------------------------------------
_BOOT = """\
import os, sys
sys.path[:0] = [p for p in sys.argv[1].split(os.pathsep) if p]
from dxserve.export_gate import _fork_server_main
_fork_server_main()
"""


def _child_env(workdir: str) -> dict[str, str]:
    """The fork server's whole environment: nothing of the server's (tokens, paths) leaks."""
    return {
        "PATH": os.defpath,
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "JAX_PLATFORMS": "cpu",
        "PYTHONDONTWRITEBYTECODE": "1",
        # One thread per maths library, few malloc arenas: the address-space limit
        # then bounds real allocations, not per-thread reservations.
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MALLOC_ARENA_MAX": "2",
        # Freed memory is overwritten, so a use-after-free in the reader is more
        # likely to fail in the child than to pass there and fail in the server.
        "GLIBC_TUNABLES": "glibc.malloc.perturb=165",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }


class _ForkServer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._workdir: tempfile.TemporaryDirectory | None = None

    def _start(self) -> subprocess.Popen:
        import dxcontract
        import dxserve

        paths = os.pathsep.join(
            str(Path(m.__file__).resolve().parents[1]) for m in (dxserve, dxcontract)
        )
        self._workdir = tempfile.TemporaryDirectory(prefix="dxserve-gate-")
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _BOOT, paths],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # the children's crash messages go to the server's log
            env=_child_env(self._workdir.name),
            cwd=self._workdir.name,
            close_fds=True,
            start_new_session=True,  # a terminal's Ctrl-C does not reach it
        )
        line = _read_line(proc.stdout, time.monotonic() + 120.0)
        if line != _READY:
            self._kill(proc)
            raise OSError(f"the export checker did not start (said {line[:200]!r})")
        log.info("export gate: fork server started (pid %d)", proc.pid)
        return proc

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.wait(timeout=10)

    def stop(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._kill(self._proc)
                self._proc = None
            if self._workdir is not None:
                self._workdir.cleanup()
                self._workdir = None

    def run(self, header: dict[str, Any], bundle: bytes, timeout: float) -> dict[str, Any]:
        with self._lock:
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._proc = self._start()
            except OSError as e:
                self._proc = None
                return {"status": "unavailable", "detail": str(e)[:200]}
            proc = self._proc
            assert proc.stdin is not None and proc.stdout is not None
            head = json.dumps(header).encode()
            try:
                proc.stdin.write(struct.pack(">IQ", len(head), len(bundle)) + head + bundle)
                proc.stdin.flush()
                line = _read_line(proc.stdout, time.monotonic() + timeout + 30.0)
                reply = json.loads(line)
                if not isinstance(reply, dict):
                    raise ValueError("not an object")
                return reply
            except (OSError, ValueError) as e:
                # The fork server itself failed (it never reads bundles, so this is
                # rare): start a fresh one next time.
                log.error("export gate: fork server failed: %s", e)
                self._kill(proc)
                self._proc = None
                return {"status": "unavailable", "detail": "the checker stopped"}


def _read_line(stream: Any, deadline: float) -> bytes:
    """One line from a pipe, or ``OSError`` at EOF or the deadline."""
    fd = stream.fileno()
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise OSError("timed out waiting for the export checker")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                raise OSError("the export checker exited")
            buf += chunk
    return buf


# --- the fork server and its children (run in the gate's own processes) -----------------------
def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _read_exact(fd: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, min(n - len(out), 1 << 20))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


def _fork_server_main() -> None:
    """Import JAX once, then fork one child per bundle read from stdin.

    It exits at EOF on stdin, i.e. when the server exits. (No ``PR_SET_PDEATHSIG``
    here: it fires when the *thread* that started this process exits, and the server
    starts it from a pool thread that may retire while another thread uses it.)
    """
    reply = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the replies
    import jax  # noqa: F401  imported (not initialised) once, so children start fast

    from . import exported  # noqa: F401

    reply.write(_READY)
    reply.flush()
    while True:
        try:
            nh, nb = struct.unpack(">IQ", _read_exact(0, 12))
            header = json.loads(_read_exact(0, nh))
            bundle = _read_exact(0, nb)
        except EOFError:
            os._exit(0)
        result = _fork_and_check(header, bundle)
        reply.write(json.dumps(result).encode() + b"\n")
        reply.flush()


def _vm_size() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _fork_and_check(header: dict[str, Any], bundle: bytes) -> dict[str, Any]:
    timeout = float(header.get("timeout", 60.0))
    r, w = os.pipe()
    er, ew = os.pipe()  # the child's stderr: kept, and its tail reported when it crashes
    pid = os.fork()
    if pid == 0:  # the child
        code = 0
        try:
            os.close(r)
            os.close(er)
            os.dup2(ew, 2)
            _die_with_parent()
            _limit(int(header.get("memory", 4 << 30)), timeout)
            result = _child_check(header, bundle)
        except MemoryError:
            result, code = {"status": "memory"}, 3
        except BaseException as e:  # report, never raise out of a forked child
            result, code = {"status": "error", "detail": f"{type(e).__name__}: {e}"[:500]}, 4
        with contextlib.suppress(BaseException):
            os.write(w, json.dumps(result).encode())
        os._exit(code)
    os.close(w)
    os.close(ew)
    deadline = time.monotonic() + timeout
    out, err = b"", b""
    open_fds = {r, er}
    timed_out = False
    while r in open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select(list(open_fds), [], [], left)
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.discard(fd)
            elif fd == r:
                out += chunk
            else:
                err = (err + chunk)[-4096:]
    for fd in (r, er):
        os.close(fd)
    if timed_out:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return {"status": "timeout"}
    _, status = os.waitpid(pid, 0)  # the pipe closed: the child has exited or is exiting
    tail = err.decode("utf-8", "replace")[-600:]
    if os.WIFSIGNALED(status):
        return {"status": "crashed", "signal": os.WTERMSIG(status), "stderr": tail}
    try:
        result = json.loads(out)
    except ValueError:
        return {"status": "failed", "code": os.WEXITSTATUS(status), "stderr": tail}
    return result if isinstance(result, dict) else {"status": "failed", "stderr": tail}


def _limit(memory: int, timeout: float) -> None:
    import math
    import resource

    space = _vm_size() + memory
    resource.setrlimit(resource.RLIMIT_AS, (space, space))
    cpu = max(1, math.ceil(timeout))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _child_check(header: dict[str, Any], bundle: bytes) -> dict[str, Any]:
    """In the child: everything the server will do with the bundle, once."""
    fault = header.get("fault")
    if fault == "abort":
        os.abort()
    elif fault == "hang":
        while True:
            time.sleep(1)
    elif fault == "exit":
        os._exit(7)
    elif fault == "oom":
        _ = bytearray(1 << 62)

    import jax

    from dxcontract.errors import DxError

    from .exported import exercise, load_exported, refuse_unbounded_loops

    platform = str(header["platform"])
    try:
        with jax.enable_x64(True):  # float64 exports are checked as they will run
            loaded = load_exported(bundle, platform=platform)
            if header.get("unbounded_loops", "refuse") != "allow":
                refuse_unbounded_loops(loaded)  # before running it: it might not end
            ran = exercise(loaded) if "cpu" in loaded.platforms else []
    except InvalidExportError as e:
        return {"status": "refused", "detail": e.detail}
    except DxError as e:
        return {"status": "error", "detail": f"{type(e).__name__}: {e.detail}"[:500]}
    return {"status": "ok", "ran": ran}
