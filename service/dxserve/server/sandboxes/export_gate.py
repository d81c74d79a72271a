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

How the children are made (cheaply): the gate is a ``sandbox.Sandbox``, the fork server
the sparsity detector uses too, started once, lazily, with ``python -I`` and a minimal
environment. It imports JAX and dxserve (no backend, no threads), then, for each bundle,
hands it to a forked child that sets its limits (``RLIMIT_AS``: the fork server's own
address space plus ``memory_bytes``; ``RLIMIT_CPU``; no core file), checks the bundle
and answers its verdict. The fork server never reads a bundle itself; it only forks,
waits (killing the child at the wall-clock timeout) and reports how the child ended.
One bundle is checked at a time, which also bounds the gate's memory to one child.

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

import hashlib
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dxcontract.errors import InvalidExportError, OverloadedError
from dxcontract.lru import LRU
from dxserve.server.sandboxes.sandbox import Limits, Sandbox

__all__ = ["GATE_VERSION", "ExportGate", "GateConfig", "check", "default"]

log = logging.getLogger("dxserve.export_gate")

#: Bumped when the gate checks more: stamps of an older version are gated again.
GATE_VERSION = 1
_STAMP_KEY = "export_gate"


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
    from dxserve.frameworks.jax.exported import server_platform

    return server_platform()


def _make_stamp(hexdigest: str, platform: str) -> dict[str, Any]:
    from dxserve.frameworks.jax.exported import jax_version

    return {
        "sha256": hexdigest,
        "version": GATE_VERSION,
        "jax": jax_version(),
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
        self._server = _sandbox()

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
            from dxserve.settings import Settings

            _default.append(ExportGate(GateConfig.from_settings(Settings())))
        return _default[0]


def _bad(detail: str) -> InvalidExportError:
    return InvalidExportError(detail, field="export")


def check(
    content: bytes, *, cfg: GateConfig | None = None, server: Sandbox | None = None,
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
    from dxserve.frameworks.jax.exported import DEFAULT_MAX_BUNDLE_BYTES

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
    header = {"platform": platform, "unbounded_loops": cfg.unbounded_loops}
    if _fault:
        header["fault"] = _fault
    started = time.monotonic()
    outcome = server.run(header, content, Limits(cfg.memory_bytes, cfg.timeout, _REPLY_BYTES))
    seconds = time.monotonic() - started
    reply = dict(outcome.reply) if outcome.status == "ok" else {
        "status": outcome.status, "signal": outcome.signal, "detail": outcome.detail[-600:],
    }  # fmt: skip
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
        f"the process that checked the export exited without an answer ({status}); "
        "it was not stored"
    )


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


# --- the gate's children: a sandbox.Sandbox -------------------------------------------------
#: The largest reply a child may write (a few status fields).
_REPLY_BYTES = 1 << 16
#: Freed memory is overwritten in the children, so a use-after-free in the reader is
#: more likely to fail in the child than to pass there and fail in the server.
_CHILD_ENV = {"GLIBC_TUNABLES": "glibc.malloc.perturb=165"}


def _sandbox() -> Sandbox:
    """The gate's fork server (started on its first bundle)."""
    return Sandbox(
        f"{__name__}:gate_job", prepare=f"{__name__}:gate_prepare", name="export checker",
        env=_CHILD_ENV,
    )


def gate_prepare() -> None:
    """In the fork server, once: import the reader and JAX with it (JAX is not
    initialised), so children start fast."""
    from dxserve.frameworks.jax import exported  # noqa: F401


def gate_job(header: dict[str, Any], bundle: bytes) -> tuple[dict[str, Any], bytes]:
    """One check, in a bounded child (``sandbox``): its verdict as the reply."""
    return _child_check(header, bundle), b""


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

    from dxcontract.errors import DxError
    from dxserve.frameworks.jax.exported import check_bundle

    platform = str(header["platform"])
    try:  # float64 exports are checked as they will run
        ran = check_bundle(bundle, platform, header.get("unbounded_loops", "refuse") != "allow")
    except InvalidExportError as e:
        return {"status": "refused", "detail": e.detail}
    except DxError as e:
        return {"status": "error", "detail": f"{type(e).__name__}: {e.detail}"[:500]}
    return {"status": "ok", "ran": ran}
