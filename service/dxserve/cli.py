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

from dxserve import __version__
from dxserve.server.observe import configure_logging
from dxserve.settings import Settings

#: ``--functions``: what is served, and how the example functions come in.
FUNCTIONS_HELP = (
    "Python modules whose @dxserve.function's are served (importable, or in the working "
    "directory). Repeat the flag or separate modules with commas: the lists add up. "
    "Default: dxserve.examples, the example functions (rosenbrock, ...). Naming modules "
    "replaces that default, so the server serves exactly what you name: add "
    "dxserve.examples to keep the examples (e.g. --functions dxserve.examples "
    "--functions mymodule). Also DXSERVE_FUNCTIONS=mod1,mod2; the flag wins."
)


#: ``--store``: what it takes, and where the default puts it.
STORE_HELP = (
    "where uploaded functions, jobs and compiled programs are kept: a path (an SQLite "
    "database), postgresql://... or dir:///path (DXSERVE_STORE). Default: dxserve-store "
    "in the working directory (with make serve: the clone's root); the start-up log "
    "prints the full path."
)


def module_list(values: list[str]) -> list[str]:
    """The modules of repeated ``--functions`` flags, each a comma list, in order and
    once each: ``["a,b", "c"]`` -> ``["a", "b", "c"]``."""
    modules: list[str] = []
    for value in values:
        for module in value.split(","):
            if module.strip() and module.strip() not in modules:
                modules.append(module.strip())
    return modules


def main(argv: list[str] | None = None) -> int:
    """Run ``dxserve`` with the arguments ``argv`` (default: the command line's); returns
    the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "ray":
        return run_ray(args)
    return serve(args, argv)


def build_parser() -> argparse.ArgumentParser:
    """The ``dxserve`` parser: its ``serve`` and ``ray`` commands and their flags."""
    parser = argparse.ArgumentParser(
        prog="dxserve",
        description="Differentiation as a service",
        epilog="Every flag has a DXSERVE_* environment variable; see 'dxserve serve --help'.",
    )
    parser.add_argument("--version", action="version", version=f"dxserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve_parser(sub)
    _add_ray_parser(sub)
    return parser


def _add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser(
        "serve",
        help="start the HTTP server",
        description="Start the HTTP server. Every flag has a DXSERVE_* environment variable "
        "(the flag wins). Without --functions the example functions are served.",
    )
    serve.add_argument("--host", help="bind address (DXSERVE_HOST or HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (DXSERVE_PORT or PORT, default 8000)")
    serve.add_argument("--functions", action="append", metavar="MODULES", help=FUNCTIONS_HELP)
    serve.add_argument("--store", help=STORE_HELP)
    serve.add_argument(
        "--workers",
        type=int,
        help="server processes sharing the port and the store (DXSERVE_WORKERS, default 1)",
    )
    serve.add_argument(
        "--worker-devices",
        help="CUDA_VISIBLE_DEVICES of each worker in turn, e.g. '0,1' (DXSERVE_WORKER_DEVICES)",
    )
    serve.add_argument("--compilation-cache", help="JAX compilation cache dir ('' disables)")
    serve.add_argument("--token", help="bearer token for registry writes (DXSERVE_TOKEN)")
    serve.add_argument("--log-level", help="debug, info, warning, error")


def _add_ray_parser(sub: Any) -> None:
    ray = sub.add_parser(
        "ray",
        help="serve on Ray Serve: replicas, GPUs, autoscaling "
        "(needs the ray extra: pip install -e '.[ray]' at the repository "
        "root; see dxserve.ray_serve)",
    )
    ray.add_argument("--address", help="Ray cluster to join (default: start a local one)")
    ray.add_argument("--host", default="127.0.0.1", help="Ray Serve's HTTP proxy address")
    ray.add_argument("--port", type=int, default=8000, help="Ray Serve's HTTP proxy port")
    ray.add_argument("--replicas", type=int, default=1, help="replicas (without autoscaling)")
    ray.add_argument("--num-gpus", type=float, default=0, help="GPUs per replica")
    ray.add_argument("--num-cpus", type=float, help="CPUs per replica (Ray's default: 1)")
    ray.add_argument("--min-replicas", type=int, help="autoscaling: fewest replicas")
    ray.add_argument("--max-replicas", type=int, help="autoscaling: most replicas")
    ray.add_argument("--store", help="shared registry: an absolute path or postgresql://...")
    ray.add_argument("--functions", action="append", metavar="MODULES", help=FUNCTIONS_HELP)
    ray.add_argument("--compilation-cache", help="JAX compilation cache dir ('' disables)")


#: Seconds closing the service may take at shutdown, after uvicorn's graceful shutdown
#: (requests in flight get ``shutdown_timeout``): past it the process exits without waiting.
CLOSE_GRACE = 15.0


def serve(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``dxserve serve``: the server until it stops (or, with ``--workers`` N, the
    supervisor of N worker processes); returns the exit status."""
    settings = _serve_settings(args)
    if settings is None:
        return 2
    worker = os.environ.get(WORKER_INDEX)
    if worker is None:  # a worker shares its supervisor's port on purpose
        problem = port_problem(settings.host, settings.port)
        if problem is not None:  # before any start-up line, so it is the last word
            print(f"dxserve: {problem}", file=sys.stderr)
            return 1
    configure_logging(settings.log_level, settings.log_format)
    log = logging.getLogger("dxserve")
    if worker is None:
        log.info("store: %s", store_location(settings))
    if settings.workers > 1 and worker is None:
        from dxserve.server.supervisor import supervise

        return supervise(settings, argv if argv is not None else sys.argv[1:])

    import uvicorn

    app = _load_app(settings)
    if app is None:
        return 2
    log.info("access: %s", app.state.service.access_mode())
    app.state.close_grace = CLOSE_GRACE  # this process exits even if closing hangs
    options = _uvicorn_options(settings, log)
    try:
        if worker is None:
            log.info(
                "API documentation: %s/docs (Swagger UI), %s/openapi.json",
                base_url(settings),
                base_url(settings),
            )
            uvicorn.run(app, **options)
        else:
            _run_worker(app, options, settings, worker, log)
    finally:  # (uvicorn raises the SIGTERM or SIGINT it caught again once it has stopped)
        computing = app.state.service.workers.computing
        if computing:
            # XLA cannot stop them, and the interpreter's exit could wait for them
            log.warning("shutdown: leaving %d computation(s) that did not end", computing)
            logging.shutdown()
            os._exit(0)
    return 0


def port_problem(host: str, port: int) -> str | None:
    """Why ``dxserve serve`` cannot listen on ``(host, port)``, with the fix; None when
    it can (checked by binding as uvicorn will, then letting go)."""
    import errno
    import socket

    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot listen on {host}:{port}: {exc.strerror}; check --host (HOST)"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        # as uvicorn binds: a port whose old connections linger in TIME_WAIT is free
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (
                    f"port {port} on {host} is already in use (another server, perhaps "
                    f"`make serve`, is listening there). Stop it, or choose another port: "
                    f"PORT={port + 1} make serve, or dxserve serve --port {port + 1}"
                )
            return f"cannot listen on {host}:{port}: {exc.strerror}"
    return None


def store_location(settings: Settings) -> str:
    """Where ``settings.store`` is, in words for the start-up log: a local store's full
    path (a relative one is in the working directory, which the line says), or the
    database's address without its password."""
    store = settings.store
    if "://" in store and not store.lower().startswith("dir:"):
        from urllib.parse import urlsplit

        parts = urlsplit(store)
        host = parts.hostname or ""
        return f"{parts.scheme}://{host}{parts.path} (a shared database)"
    path = store[len("dir://") :] if store.lower().startswith("dir:") else store
    full = os.path.abspath(path)
    if os.path.isabs(path):
        return full
    default = " (the default)" if store == Settings.model_fields["store"].default else ""
    return (
        f"{full}{default}: relative to the working directory, so a server started "
        "elsewhere has another store; --store or DXSERVE_STORE chooses one"
    )


def base_url(settings: Settings) -> str:
    """The address a browser on this machine opens: ``http://host:port``."""
    host = settings.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{settings.port}"


def _serve_settings(args: argparse.Namespace) -> Settings | None:
    """``Settings`` from the environment and ``serve``'s flags (the flags win); None,
    after saying why on stderr, where a setting is bad."""
    overrides = {k: v for k, v in vars(args).items() if k != "command" and v is not None}
    if "functions" in overrides:
        overrides["functions"] = module_list(overrides["functions"])
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        print(f"dxserve: {setting_problem(exc, overrides)}", file=sys.stderr)
        return None


def _load_app(settings: Settings) -> Any:
    """The application for ``settings``, its runtime set up; None, after saying why on
    stderr, where its store is locked or a ``--functions`` module does not import."""
    from dxserve.http import create_app
    from dxserve.server.runtime import bootstrap
    from dxserve.server.stores.directory import StoreLockedError

    sys.path.insert(0, os.getcwd())  # so --functions can name modules of the working directory
    bootstrap(settings)
    try:
        return create_app(settings)
    except StoreLockedError as exc:
        print(f"dxserve: {exc}; give this server its own --store", file=sys.stderr)
    except ModuleNotFoundError as exc:
        print(f"dxserve: cannot import a --functions module: {exc}", file=sys.stderr)
    return None


def _uvicorn_options(settings: Settings, log: logging.Logger) -> dict[str, Any]:
    """uvicorn's options for ``settings``: address, logging and the connection bounds."""
    return {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level.lower(),
        "timeout_graceful_shutdown": settings.shutdown_timeout,
        # JSON logs: uvicorn's loggers reach the root's JSON handler, and the app's own
        # request lines replace uvicorn's access lines
        **({"log_config": None, "access_log": False} if settings.log_format == "json" else {}),
        **connection_options(settings, log),
    }


def _run_worker(
    app: Any, options: dict[str, Any], settings: Settings, worker: str, log: logging.Logger
) -> None:
    """Serve ``app`` as worker ``worker`` of ``--workers`` N until it stops."""
    import uvicorn
    from prometheus_client import Gauge

    from dxserve.server.supervisor import reuse_port_socket

    # which process answered a scrape: one series per worker (index, pid)
    Gauge(
        "dxserve_worker",
        "This --workers process (always 1)",
        ["index", "pid"],
        registry=app.state.metrics.registry,
    ).labels(worker, str(os.getpid())).set(1)
    # its own listening socket on the shared port (SO_REUSEPORT), so the kernel spreads
    # new connections over the processes
    sock = reuse_port_socket(settings.host, settings.port, settings.backlog)
    log.info(
        "worker %s (pid %d) listening on %s:%d", worker, os.getpid(), settings.host, settings.port
    )
    uvicorn.Server(uvicorn.Config(app, **options)).run(sockets=[sock])


def run_ray(args: argparse.Namespace) -> int:
    """``dxserve ray``: dxserve on Ray Serve until SIGINT/SIGTERM. Replicas get this
    process's ``DXSERVE_*`` variables and the flags as their settings."""
    import signal
    import threading

    settings: dict[str, Any] = {}
    if args.store is not None:
        local = "://" not in args.store
        settings["store"] = os.path.abspath(args.store) if local else args.store
    if args.functions is not None:
        settings["functions"] = module_list(args.functions)
    if args.compilation_cache is not None:
        settings["compilation_cache"] = args.compilation_cache
    try:
        Settings(**settings)
    except ValidationError as exc:
        print(f"dxserve: {setting_problem(exc, settings)}", file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items() if k.startswith("DXSERVE_")}
    autoscaling = None
    if args.min_replicas is not None or args.max_replicas is not None:
        low = args.min_replicas if args.min_replicas is not None else 1
        autoscaling = {"min_replicas": low, "max_replicas": max(low, args.max_replicas or low)}
    try:
        import ray

        from dxserve import ray_serve
    except ImportError:
        from dxcontract.extras import SERVER, install_hint

        print(
            f"dxserve: Ray Serve is not installed: {install_hint('ray', SERVER)}", file=sys.stderr
        )
        return 2
    ray.init(address=args.address, include_dashboard=False, ignore_reinit_error=True)
    ray_serve.start(
        host=args.host,
        port=args.port,
        replicas=args.replicas,
        num_gpus=args.num_gpus,
        num_cpus=args.num_cpus,
        autoscaling=autoscaling,
        settings=settings,
        settings_env=env,
    )
    print(f"dxserve on Ray Serve: http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    from ray import serve

    serve.shutdown()
    ray.shutdown()
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
    them, and the protocol of ``http.protocol`` (through uvicorn's ``http=`` option) for
    read and write timeouts, the header size and a hard connection cap."""
    from dxserve.http.protocol import (
        H11_UNPROTECTED,
        UNPROTECTED,
        ConnectionLimits,
        bounded_h11_protocol,
        bounded_protocol,
    )

    _raise_open_files(settings.max_connections + 256, log)
    limits = ConnectionLimits(
        settings.header_timeout,
        settings.body_timeout,
        settings.max_header_bytes,
        settings.max_connections,
        settings.write_timeout,
    )
    if settings.http == "h11":
        protocol = bounded_h11_protocol(limits)
        if protocol is not None:
            log.warning("connections: DXSERVE_HTTP=h11: %s", H11_UNPROTECTED)
    else:
        protocol = bounded_protocol(limits)
    if protocol is None:
        why = (
            "DXSERVE_HTTP=h11"
            if settings.http == "h11"
            else ("httptools is missing or this uvicorn is not one http/protocol.py supports")
        )
        log.warning("connections: %s: %s", why, UNPROTECTED)
    elif settings.http != "h11":
        log.info(
            "connections: %s, idle keep-alive %d s", limits.describe(), settings.keep_alive_timeout
        )
    return {
        "http": protocol or ("h11" if settings.http == "h11" else "auto"),
        "limit_concurrency": settings.max_connections,
        "timeout_keep_alive": settings.keep_alive_timeout,
        "h11_max_incomplete_event_size": settings.max_header_bytes,
        "backlog": settings.backlog,
        # no "server: uvicorn" on every answer: it names the stack to scanners and is one
        # header more for every client to parse
        "server_header": False,
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
