"""A bare FastAPI app that echoes the request body: the latency baseline.

    .venv/bin/python bench/echo_app.py --port 8123

``POST /echo`` returns the request's bytes with its content type. Served by
uvicorn with the same settings ``dxserve serve`` uses (``dxserve/cli.py``).
"""

from __future__ import annotations

import argparse

from fastapi import FastAPI, Request
from starlette.responses import Response

app = FastAPI(title="echo")


@app.post("/echo")
async def echo(request: Request) -> Response:
    media = request.headers.get("content-type", "application/octet-stream")
    return Response(await request.body(), media_type=media)


@app.get("/health")
async def health() -> dict:
    return {"status": "ok"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="bare FastAPI echo")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)

    import uvicorn

    # the same call as dxserve.cli.main
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level.lower(),
        timeout_graceful_shutdown=10,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
