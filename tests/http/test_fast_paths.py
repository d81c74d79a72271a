"""The fast paths give the same arrays, byte for byte, as httpx's own transport.

``dxclient.transport`` (the clients' fast path for operator calls) and the server's one-buffer
receive (``pipeline.BodyBuffer``) are checked against the general path (plain httpx
transports, chunked bodies uvicorn hands over 64 KiB at a time), over real sockets:

* every dtype the codec allows, 0-d, empty, non-contiguous and big-endian arrays,
  small and past the fast-path threshold, in every encoding, through a bare uvicorn
  echo (``bench/echo_app.py``), through ``FastPath.send`` and ``asend``;
* ``/gradient`` on a real dxserve through ``Client`` and ``AsyncClient``, fast transport
  vs plain httpx, for float32/float64 inputs of those kinds.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from dxclient import AsyncClient, Client
from dxclient.transport import FastPath
from dxcontract import codec
from dxserve import JaxReverse
from tests.conftest import STARTUP_TIMEOUT, free_port

ROOT = Path(__file__).resolve().parents[2]
LARGE = 64 * 1024 // 8 + 3  # elements: past 64 KiB (the server's pieces) for every itemsize


def _arrays(dtype: str) -> dict[str, np.ndarray]:
    """Small, large, 0-d, empty, non-contiguous and big-endian arrays of ``dtype``."""
    rng = np.random.default_rng(abs(hash(dtype)) % 2**32)
    dt = np.dtype(dtype)

    def sample(n: int) -> np.ndarray:
        if dt.kind == "b":
            return rng.integers(0, 2, n).astype(bool)
        if dt.kind in "iu":
            info = np.iinfo(dt)
            return rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)
        if dt.kind == "c":
            return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dt)
        return rng.standard_normal(n).astype(dt)

    big = sample(LARGE * 8)
    out = {
        "small": sample(7),
        "large": big[: LARGE * 8 // dt.itemsize + 1],
        "zero_d": sample(1).reshape(()),
        "empty": sample(0).reshape(0, 3),
        "strided": big.reshape(-1, 2)[:, 0],  # non-contiguous
        "fortran": np.asfortranarray(sample(24 * 1024).reshape(96, 256)),
    }
    if dt.itemsize > 1:
        out["big_endian"] = big.astype(dt.newbyteorder(">"))
    return out


@pytest.fixture(scope="module")
def echo_url(tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("echo") / "echo.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "echo_app.py"), "--port", str(port),
         "--log-level", "warning"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            assert proc.poll() is None, "echo app exited"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "echo app did not start"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


def _decode(response: httpx.Response, header_length: str | None) -> np.ndarray:
    """The echoed body's x (the echo returns the body, not the header-length header)."""
    obj = codec.decode_response(
        response.content, response.headers.get("content-type"), header_length, arrays=("x",),
    )
    return obj["x"]


def _same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("encoding", ["binary", "b64", "json"])
def test_every_dtype_and_layout_round_trips_identically(echo_url: str, encoding: str) -> None:
    plain = httpx.Client()
    fast, afast = FastPath(), FastPath()
    aplain = httpx.AsyncClient()
    loop = asyncio.new_event_loop()
    checked = 0
    try:
        for dtype in codec.ALLOWED_DTYPES:
            for kind, a in _arrays(dtype).items():
                body, ctype, headers = codec.encode_body({"x": a}, encoding)
                headers = {"content-type": ctype, **headers}
                url = echo_url + "/echo"
                target = httpx.URL(url)
                answers = [
                    plain.post(url, content=body, headers=headers),
                    fast.send(plain, "POST", target, headers, (body,)),
                    loop.run_until_complete(aplain.post(url, content=body, headers=headers)),
                    loop.run_until_complete(afast.asend(aplain, "POST", target, headers, (body,))),
                ]
                arrays = [_decode(r, headers.get(codec.HEADER_LENGTH)) for r in answers]
                expected = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"))
                for r, got in zip(answers, arrays, strict=True):
                    assert r.status_code == 200, (dtype, kind)
                    assert bytes(r.content) == body, (dtype, kind)
                    _same(got, arrays[0])
                    if encoding != "json" or a.dtype.kind not in "fc":
                        assert got.tobytes() == expected.tobytes(), (dtype, kind)
                    else:  # JSON numbers: the same values (float16/32 widen, then narrow)
                        np.testing.assert_array_equal(got, expected)
                checked += 1
    finally:
        plain.close()
        fast.close()
        afast.close()
        loop.run_until_complete(aplain.aclose())
        loop.close()
    assert checked >= 14 * 6


def _inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    wide = rng.uniform(-1.5, 1.5, 2 * 40_000)
    return {
        "small": rng.uniform(-1.5, 1.5, 10),
        "large": rng.uniform(-1.5, 1.5, 100_000),
        "strided": wide[::2],
        "big_endian": wide[:50_000].astype(">f8"),
        "float32": wide[:30_000].astype(np.float32),
        "zero_d": np.asarray(0.75),
        "empty": np.zeros(0),
    }


@pytest.mark.parametrize("encoding", ["binary", "b64", "json"])
def test_gradient_identical_across_transports_and_clients(server, encoding: str) -> None:
    backend = JaxReverse()
    fast = Client(server.url, encoding=encoding)
    plain = Client(encoding=encoding, http=httpx.Client(base_url=server.url))
    assert fast._fast is not None
    loop = asyncio.new_event_loop()
    afast = AsyncClient(server.url, encoding=encoding)
    aplain = AsyncClient(encoding=encoding, http=httpx.AsyncClient(base_url=server.url))
    try:
        for kind, x in _inputs().items():
            f = "sum_of_squares" if x.ndim == 0 or x.size < 2 else "rosenbrock"
            got = [c.gradient(f, backend, x) for c in (fast, plain)]
            got += [loop.run_until_complete(c.gradient(f, backend, x)) for c in (afast, aplain)]
            for g in got:
                _same(np.asarray(g), np.asarray(got[1]))
            if f == "sum_of_squares":
                np.testing.assert_array_equal(got[0], 2 * x)
            assert got[0].dtype == (np.float32 if x.dtype == np.float32 else np.float64), kind
    finally:
        fast.close()
        plain.close()
        loop.run_until_complete(afast.aclose())
        loop.run_until_complete(aplain.aclose())
        loop.close()


def test_fast_transport_reuses_connections_and_returns_errors(server) -> None:
    """Connections are kept alive and reused; an error answer comes back as it is."""
    fast, url = FastPath(), httpx.URL(server.url + "/gradient")
    json = {"content-type": "application/json"}
    with httpx.Client() as c:
        for _ in range(3):
            r = fast.send(c, "POST", url, json, (b"{" + b" " * 64,))
            assert r is not None and r.status_code == 400
            assert r.headers["content-type"].startswith("application/problem")
        assert len(fast._idle[(url.host, url.port)]) == 1
    fast.close()


@pytest.mark.parametrize("encoding", ["json", "b64"])
def test_repeated_inline_calls_send_the_bytes_of_a_full_encoding(encoding: str) -> None:
    """The client keeps the JSON text around x for repeated calls: every body is the
    one encoding the whole payload gives."""
    from dxclient import _models
    from dxcontract.backends import backend_to_json

    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(10), np.array([np.nan, np.inf, -np.inf, 1.0]), np.asarray(2.5),
          np.zeros((0, 3)), rng.standard_normal((3, 4))[:, ::2], np.float32([1.5, -2.0]),
          np.arange(5, dtype=">i4")]
    for batch_axis in (None, 0):
        for x in xs * 2:  # the second pass reuses the kept text
            call = _models.operator_call("gradient", "rosenbrock", "jax-reverse", x, None, (),
                                         None, encoding, batch_axis=batch_axis)
            payload = {"function": "rosenbrock", "backend": backend_to_json("jax-reverse"), "x": x}
            if batch_axis is not None:
                payload["batch_axis"] = batch_axis
            body, ctype, _ = codec.encode_body(payload, encoding)
            assert call.body == body and call.headers["content-type"] == ctype


def _raw_request(x: np.ndarray) -> bytes:
    body, ctype, headers = codec.encode_body(
        {"function": "rosenbrock", "backend": {"type": "jax-reverse"}, "x": x}, "binary")
    head = (f"POST /gradient HTTP/1.1\r\nhost: t\r\ncontent-type: {ctype}\r\n"
            f"accept: {ctype}\r\n{codec.HEADER_LENGTH}: {headers[codec.HEADER_LENGTH]}\r\n"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode() + body


def _read_answers(sock, count: int) -> list[np.ndarray]:
    """``count`` HTTP answers from ``sock`` (Content-Length framed), decoded."""
    buf, out = b"", []
    while len(out) < count:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(1 << 20)
            assert chunk, "server closed the connection"
            buf += chunk
        head, buf = buf.split(b"\r\n\r\n", 1)
        fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
        assert head.startswith(b"HTTP/1.1 200"), head
        n = int(fields[b"content-length"])
        while len(buf) < n:
            chunk = sock.recv(1 << 20)
            assert chunk
            buf += chunk
        body, buf = buf[:n], buf[n:]
        obj = codec.decode_response(body, fields[b"content-type"].decode(),
                                    fields[codec.HEADER_LENGTH.lower().encode()].decode(),
                                    arrays=("gradient",))
        out.append(obj["gradient"])
    return out


def test_large_bodies_trickled_and_pipelined_on_one_connection(server) -> None:
    """A large body sent in small pieces with pauses, then two requests written back to
    back (the second right behind the first's last body byte) on the same kept-alive
    connection: each is answered with its own gradient."""
    import socket as socketlib

    rng = np.random.default_rng(11)
    xs = [rng.uniform(-1, 1, 50_000) for _ in range(3)]
    expected = [Client(server.url).gradient("rosenbrock", JaxReverse(), x) for x in xs]
    with socketlib.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        first = _raw_request(xs[0])
        for at in range(0, len(first), 97_000):  # trickled
            sock.sendall(first[at : at + 97_000])
            time.sleep(0.01)
        (got,) = _read_answers(sock, 1)
        _same(got, expected[0])
        sock.sendall(_raw_request(xs[1]) + _raw_request(xs[2]))  # pipelined
        for got, want in zip(_read_answers(sock, 2), expected[1:], strict=True):
            _same(got, want)


def test_a_client_gone_mid_body_leaves_the_server_serving(server) -> None:
    import socket as socketlib

    x = np.random.default_rng(12).uniform(-1, 1, 200_000)
    request = _raw_request(x)
    with socketlib.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(request[: len(request) // 2])
        time.sleep(0.2)
    with Client(server.url) as client:
        _same(client.gradient("rosenbrock", JaxReverse(), x),
              Client(server.url, http=httpx.Client(base_url=server.url)).gradient(
                  "rosenbrock", JaxReverse(), x))
