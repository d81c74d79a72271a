"""The raw loopback floor: the bytes of an HTTP exchange moved over a plain socket.

A client of ``echo_app.py --raw-port``. Shared by ``latency.py`` and
``client_before_after.py``; imports no dxclient, so either can time any client tree
against it.
"""

from __future__ import annotations

import socket
import struct

import httpx

_PREFIX = struct.Struct("<QQ")


class RawFloor:
    """A client of ``echo_app.py --raw-port``: one kept-open socket; each ``exchange``
    writes ``head + body`` with one ``sendmsg`` and reads ``n_out`` bytes into a fresh
    buffer with ``recv_into``."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def exchange(self, head: bytes, body: bytes, n_out: int) -> bytearray:
        parts = [_PREFIX.pack(len(head) + len(body), n_out), head, body]
        total = sum(len(p) for p in parts)
        sent = self.sock.sendmsg(parts)
        if sent < total:  # the kernel took part of it: the rest in one go
            self.sock.sendall(memoryview(b"".join(parts))[sent:])
        out = bytearray(n_out)
        view, got = memoryview(out), 0
        while got < n_out:
            n = self.sock.recv_into(view[got:])
            if not n:
                raise ConnectionError("raw floor server closed the connection")
            got += n
        return out

    def close(self) -> None:
        self.sock.close()


def request_head(url: httpx.URL, headers: dict[str, str], body: bytes) -> bytes:
    """The request line and headers httpx writes for this POST (the same byte count)."""
    request = httpx.Client().build_request("POST", url, content=body, headers=headers)
    lines = [f"POST {url.raw_path.decode()} HTTP/1.1"]
    lines += [f"{k.decode()}: {v.decode()}" for k, v in request.headers.raw]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def response_size(response: httpx.Response) -> int:
    """Bytes of a whole HTTP/1.1 answer: status line, headers, body."""
    head = f"HTTP/1.1 {response.status_code} {response.reason_phrase}\r\n"
    head += "".join(f"{k.decode()}: {v.decode()}\r\n" for k, v in response.headers.raw)
    return len(head.encode("latin-1")) + 2 + len(response.content)
