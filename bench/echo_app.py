"""A bare FastAPI app that echoes the request body: the latency baseline.

    .venv/bin/python bench/echo_app.py --port 8123

``POST /echo`` returns the request's bytes with its content type. Served by
uvicorn with the same settings ``dxserve serve`` uses (``dxserve/cli.py``).

``--raw-port P`` also serves the loopback floor on port P, in a thread of this process:
a plain socket server with no HTTP at all. Each exchange is a 16-byte prefix
``<request bytes><response bytes>`` (two little-endian uint64), then that many request
bytes, which it reads into one buffer with ``recv_into``; it answers with that many
response bytes from one buffer (``sendall``). ``bench/latency.py`` sends it exactly the
bytes an HTTP client would (request line, headers, body) and asks for exactly the bytes
dxserve answers, so it times moving the same bytes through the kernel and nothing else.
"""

from __future__ import annotations

import argparse
import socket
import struct
import threading

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


_PREFIX = struct.Struct("<QQ")


def _recv_exactly(conn: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``conn``; False if the peer closed first."""
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if not n:
            return False
        got += n
    return True


def _serve_raw_connection(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    prefix = bytearray(_PREFIX.size)
    inbox, outbox = bytearray(0), b""
    with conn:
        while _recv_exactly(conn, memoryview(prefix)):
            n_in, n_out = _PREFIX.unpack(prefix)
            if len(inbox) < n_in:
                inbox = bytearray(n_in)
            if len(outbox) != n_out:
                outbox = bytes(n_out)
            if not _recv_exactly(conn, memoryview(inbox)[:n_in]):
                return
            conn.sendall(outbox)


def serve_raw(port: int, host: str = "127.0.0.1") -> threading.Thread:
    """The loopback floor (see the module docstring) on ``port``, in a daemon thread."""
    listener = socket.create_server((host, port))

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=_serve_raw_connection, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True, name="raw-floor")
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="bare FastAPI echo")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--raw-port", type=int, default=0, help="also serve the raw floor here")
    args = parser.parse_args(argv)
    if args.raw_port:
        serve_raw(args.raw_port, args.host)

    import uvicorn

    # the same call as dxserve.cli.main
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level.lower(),
        timeout_graceful_shutdown=10,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
