"""``dxserve serve``: the server from the command line.

Every flag has a ``DXSERVE_*`` environment variable (see ``Settings``); flags win.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from pydantic import ValidationError

from . import __version__
from .observe import configure_logging
from .settings import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dxserve", description="Differentiation as a service")
    parser.add_argument("--version", action="version", version=f"dxserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the HTTP server")
    serve.add_argument("--host", help="bind address (DXSERVE_HOST or HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (DXSERVE_PORT or PORT, default 8000)")
    serve.add_argument("--functions", help="comma-separated modules of @dxserve.function's")
    serve.add_argument(
        "--store", help="registry: a path (SQLite), postgresql://... or dir:///path (DXSERVE_STORE)"
    )
    serve.add_argument(
        "--workers", type=int,
        help="server processes sharing the port and the store (DXSERVE_WORKERS, default 1)",
    )
    serve.add_argument(
        "--worker-devices",
        help="CUDA_VISIBLE_DEVICES of each worker in turn, e.g. '0,1' (DXSERVE_WORKER_DEVICES)",
    )
    serve.add_argument("--compilation-cache", help="JAX compilation cache dir ('' disables)")
    serve.add_argument("--token", help="bearer token for registry writes (DXSERVE_TOKEN)")
    serve.add_argument("--log-level", help="debug, info, warning, error")
    args = parser.parse_args(argv)

    overrides = {
        k: v for k, v in vars(args).items() if k != "command" and v is not None
    }
    if "functions" in overrides:
        overrides["functions"] = [m.strip() for m in overrides["functions"].split(",") if m.strip()]
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        print(f"dxserve: {setting_problem(exc, overrides)}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    worker = os.environ.get(WORKER_INDEX)
    if settings.workers > 1 and worker is None:
        from .supervisor import supervise

        return supervise(settings, argv if argv is not None else sys.argv[1:])

    import uvicorn

    from .http import create_app
    from .runtime import bootstrap
    from .store import StoreLockedError

    sys.path.insert(0, os.getcwd())  # so --functions can name modules of the working directory
    bootstrap(settings)
    try:
        app = create_app(settings)
    except StoreLockedError as exc:
        print(f"dxserve: {exc}; give this server its own --store", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        print(f"dxserve: cannot import a --functions module: {exc}", file=sys.stderr)
        return 2
    log = logging.getLogger("dxserve")
    log.info("access: %s", app.state.service.access_mode())
    options = {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level.lower(),
        "timeout_graceful_shutdown": 10,
        # JSON logs: uvicorn's loggers reach the root's JSON handler, and the app's own
        # request lines replace uvicorn's access lines
        **({"log_config": None, "access_log": False} if settings.log_format == "json" else {}),
        **connection_options(settings, log),
    }
    if worker is None:
        uvicorn.run(app, **options)
        return 0
    # One of --workers N processes: its own listening socket on the shared port
    # (SO_REUSEPORT), so the kernel spreads new connections over the processes.
    from prometheus_client import Gauge

    from .supervisor import reuse_port_socket

    # which process answered a scrape: one series per worker (index, pid)
    Gauge("dxserve_worker", "This --workers process (always 1)", ["index", "pid"],
          registry=app.state.metrics.registry).labels(worker, str(os.getpid())).set(1)
    sock = reuse_port_socket(settings.host, settings.port, settings.backlog)
    log.info("worker %s (pid %d) listening on %s:%d", worker, os.getpid(), settings.host,
             settings.port)
    uvicorn.Server(uvicorn.Config(app, **options)).run(sockets=[sock])
    return 0


#: Set by ``supervisor.supervise`` in each worker process: its index (0 .. N-1).
WORKER_INDEX = "DXSERVE_WORKER_INDEX"


def setting_problem(exc: ValidationError, flags: dict[str, Any]) -> str:
    """One line per bad setting: the flag or variable that set it, what it takes and
    the value given (pydantic's own report spans many lines)."""
    from pydantic_core import PydanticUndefined

    lines = []
    for error in exc.errors():
        name = str(error["loc"][0]) if error["loc"] else "?"
        if name in flags:
            where = f"--{name.replace('_', '-')}"
        elif name in ("host", "port") and f"DXSERVE_{name.upper()}" not in os.environ:
            where = name.upper()  # the container spelling (see Settings)
        else:
            where = f"DXSERVE_{name.upper()}"
        field = Settings.model_fields.get(name)
        takes = ""
        if field is not None:
            kind = getattr(field.annotation, "__name__", None) or str(field.annotation)
            default = "" if field.default is PydanticUndefined else f", default {field.default!r}"
            takes = f" ({where} takes {kind}{default})"
        msg = error["msg"][0].lower() + error["msg"][1:]
        lines.append(f"bad setting {where}={error.get('input')!r}: {msg}{takes}")
    return "\n".join(lines)


def connection_options(settings: Settings, log: logging.Logger) -> dict[str, Any]:
    """uvicorn's options that bound connections, from ``settings``: its own where it has
    them, and the httptools protocol of ``http.connections`` for read timeouts, the
    header size and a hard connection cap (which uvicorn lacks)."""
    from .http.connections import ConnectionLimits, bounded_protocol

    _raise_open_files(settings.max_connections + 256, log)
    limits = ConnectionLimits(
        settings.header_timeout, settings.body_timeout, settings.max_header_bytes,
        settings.max_connections, max_body_bytes=settings.max_body_bytes,
    )
    protocol = bounded_protocol(limits)
    if protocol is None:  # pragma: no cover - uvicorn[standard] brings httptools
        log.warning("httptools is missing: no header or body read timeouts (use a proxy)")
    log.info(
        "connections: headers within %g s, bodies within %g s, at most %d header bytes, "
        "%d open, idle keep-alive %d s",
        limits.header_timeout, limits.body_timeout, limits.max_header_bytes,
        limits.max_connections, settings.keep_alive_timeout,
    )
    return {
        "http": protocol or "auto",
        "limit_concurrency": settings.max_connections,
        "timeout_keep_alive": settings.keep_alive_timeout,
        "h11_max_incomplete_event_size": settings.max_header_bytes,
        "backlog": settings.backlog,
    }


def _raise_open_files(wanted: int, log: logging.Logger) -> None:
    """Raise the soft limit on open files towards ``wanted`` (at most the hard limit),
    so the connection cap, not the descriptor table, is what refuses connections."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        target = soft
    if target < wanted:
        log.warning(
            "only %d open files allowed: fewer connections than DXSERVE_MAX_CONNECTIONS fit",
            target,
        )


if __name__ == "__main__":
    raise SystemExit(main())
