"""``dxserve serve``: the server from the command line.

Every flag has a ``DXSERVE_*`` environment variable (see ``Settings``); flags win.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .settings import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dxserve", description="Differentiation as a service")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the HTTP server")
    serve.add_argument("--host", help="bind address (DXSERVE_HOST or HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (DXSERVE_PORT or PORT, default 8000)")
    serve.add_argument("--functions", help="comma-separated modules of @dxserve.function's")
    serve.add_argument("--store", help="registry directory (DXSERVE_STORE)")
    serve.add_argument("--compilation-cache", help="JAX compilation cache dir ('' disables)")
    serve.add_argument("--token", help="bearer token for registry writes (DXSERVE_TOKEN)")
    serve.add_argument("--log-level", help="debug, info, warning, error")
    args = parser.parse_args(argv)

    overrides = {
        k: v for k, v in vars(args).items() if k != "command" and v is not None
    }
    if "functions" in overrides:
        overrides["functions"] = [m.strip() for m in overrides["functions"].split(",") if m.strip()]
    settings = Settings(**overrides)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

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
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=10,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
