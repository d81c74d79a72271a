"""Hostile inputs against the real server: every one is a 4xx (or a documented 503/507)
with ``application/problem+json``, and the keep-alive connection it came on still works.

Also: concurrent registrations (no 5xx, never past the function cap), secure-by-default
registration, a full disk (507), device out of memory (503), and slow or partial
connections (closed after the configured timeouts while normal requests go on).
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import contextlib
import errno
import hashlib
import json
import os
import socket
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from dxcontract import codec
from dxcontract.bundle import ARTIFACTS, FORMAT_NAME, FORMAT_VERSION, MAGIC, split_bundle
from dxcontract.encodings.common import MAX_ELEMENTS, loads_checked
from dxcontract.errors import StorageFullError

PROBLEM = "application/problem+json"
GOOD_X = [1.0, 2.0, 3.0]
GOOD_GRADIENT = np.array([-400.0, 1002.0, -200.0])  # rosenbrock at (1, 2, 3), by hand
HUGE = [0, 2**62, 2**62]


# --------------------------------------------------------------------------- helpers


def local_port(r: httpx.Response) -> int:
    """The client-side port of the connection a response came on."""
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


def expect_problem(r: httpx.Response, statuses: tuple[int, ...], field: str | None = None) -> dict:
    assert r.status_code in statuses, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith(PROBLEM), r.headers
    doc = r.json()
    assert doc["status"] == r.status_code and doc["detail"]
    if field is not None:
        assert doc.get("field") == field, doc
    return doc


def good_gradient(http: httpx.Client) -> httpx.Response:
    r = http.post("/gradient", json={"function": "rosenbrock", "x": GOOD_X})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["gradient"], GOOD_GRADIENT)
    return r


def still_alive(http: httpx.Client, bad: httpx.Response) -> None:
    """The next request on the same keep-alive connection works."""
    assert "close" not in bad.headers.get("connection", "").lower(), bad.headers
    assert local_port(good_gradient(http)) == local_port(bad), "the connection was dropped"


def typed(shape: list, data: Any = "", dtype: str = "float64") -> dict:
    return {"__ndarray__": data, "dtype": dtype, "shape": shape}


def binary_body(tree: dict, refs: dict[str, tuple[list, int]]) -> tuple[bytes, dict]:
    """A binary body whose header has the buffer references ``refs`` (field -> (shape,
    nbytes)) and no buffers: the header alone lies about the shapes."""
    header = dict(tree)
    for key, (shape, nbytes) in refs.items():
        header[key] = {"__ndarray__": {"offset": 0, "nbytes": nbytes}, "dtype": "float64",
                       "shape": shape}
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 64)
    return head, {"content-type": codec.BINARY_TYPE, codec.HEADER_LENGTH: str(len(head))}


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url) as client:
        yield client


# --------------------------------------------------------------------------- 1. shapes

SHAPE_CASES: list[tuple[str, str, dict, str]] = [
    ("b64-huge", "/gradient", {"function": "rosenbrock", "x": typed(HUGE)}, "x"),
    ("list-huge", "/gradient", {"function": "rosenbrock", "x": typed(HUGE, [])}, "x"),
    ("hessian-2**40", "/hessian", {"function": "rosenbrock", "x": typed([0, 2**40])}, "x"),
    ("jacobian-2**40", "/jacobian", {"function": "rosenbrock", "x": typed([0, 2**40])}, "x"),
    ("one-dim-too-big", "/gradient", {"function": "rosenbrock", "x": typed([MAX_ELEMENTS + 1])},
     "x"),
    ("complex-huge", "/gradient",
     {"function": "rosenbrock", "x": typed(HUGE, [], "complex128")}, "x"),
    ("pytree-leaf", "/gradient", {"function": "rosenbrock", "x": {"w": typed(HUGE)}}, "x.w"),
    ("tangent", "/hvp",
     {"function": "rosenbrock", "x": GOOD_X, "tangents": [typed([0, 2**40, 2**40])]},
     "tangents[0]"),
    ("context", "/gradient",
     {"function": "ss_poly_ctx", "x": GOOD_X, "contexts": [typed([2**33, 0])]}, "contexts[0]"),
    # within the decoder's bound, but the result rule over the nominal sizes refuses them
    ("hessian-zero-size", "/hessian", {"function": "rosenbrock", "x": typed([0, 2**31])}, "x"),
    ("hessian-zero-size-2**20", "/hessian",
     {"function": "rosenbrock", "x": typed([0, 2**20])}, "x"),
    ("jacobian-zero-size", "/jacobian", {"function": "sv_powers", "x": typed([0, 2**20])}, "x"),
    ("prepare-hessian", "/prepare/hessian",
     {"function": "rosenbrock", "x": typed([0, 2**31])}, "x"),
]


@pytest.mark.parametrize(
    ("path", "body", "field"), [c[1:] for c in SHAPE_CASES], ids=[c[0] for c in SHAPE_CASES]
)
def test_zero_size_huge_shapes_are_4xx(http, path, body, field):
    r = http.post(path, json=body)
    expect_problem(r, (400, 422), field)
    still_alive(http, r)


@pytest.mark.parametrize("shape", [HUGE, [0, 2**40], [2**31 + 1]])
def test_binary_header_huge_shapes_are_400(http, shape):
    body, headers = binary_body({"function": "rosenbrock"}, {"x": (shape, 0)})
    r = http.post("/hessian", content=body, headers=headers)
    expect_problem(r, (400,), "x")
    still_alive(http, r)


def test_zero_size_inputs_in_bounds_never_5xx(http):
    for path, shape in [("/gradient", [0]), ("/gradient", [0, 3]), ("/hessian", [0, 64]),
                        ("/jacobian", [4, 0])]:
        r = http.post(path, json={"function": "rosenbrock", "x": typed(shape)})
        assert r.status_code < 500, (path, shape, r.text)
        still_alive(http, r)


# --------------------------------------------------------------------------- 2. JSON


def nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


JSON_CASES: list[tuple[str, str, bytes]] = [
    ("infinity-shape", "/gradient",
     b'{"function":"rosenbrock","x":{"__ndarray__":"","dtype":"float64","shape":[Infinity]}}'),
    ("nan-shape", "/gradient",
     b'{"function":"rosenbrock","x":{"__ndarray__":"","dtype":"float64","shape":[NaN, 2]}}'),
    ("overflow-shape", "/gradient",
     b'{"function":"rosenbrock","x":{"__ndarray__":"","dtype":"float64","shape":[1e999]}}'),
    ("bare-infinity-x", "/gradient", b'{"function":"rosenbrock","x":[1, Infinity, 3]}'),
    ("deep-x-600", "/gradient", b'{"function":"rosenbrock","x":' + nested(600).encode() + b"}"),
    ("deep-x-5000", "/gradient", b'{"function":"rosenbrock","x":' + nested(5000).encode() + b"}"),
    ("deep-backend", "/gradient",
     b'{"function":"rosenbrock","x":[1,2,3],"backend":' + nested(700, "{}").encode() + b"}"),
    ("deep-contexts", "/gradient",
     b'{"function":"ss_poly_ctx","x":[1,2,3],"contexts":' + nested(800).encode() + b"}"),
    ("deep-register", "/functions",
     b'{"name":"deep","expression":"jnp.sum(x)","args":' + nested(900, '"x"').encode() + b"}"),
    ("deep-description", "/functions",
     b'{"name":"deep","expression":"jnp.sum(x)","description":' + nested(900).encode() + b"}"),
]


@pytest.mark.parametrize(("path", "raw"), [c[1:] for c in JSON_CASES], ids=[c[0] for c in JSON_CASES])
def test_non_finite_and_deep_json_are_4xx(http, path, raw):
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    expect_problem(r, (400, 422))
    still_alive(http, r)


def bundle(manifest_text: bytes) -> bytes:
    """A bundle container whose manifest is ``manifest_text`` with the artifacts filled in
    (valid blobs and checksums, so the manifest's own numbers are what is tested)."""
    blobs = [bytes([i]) * 16 for i in range(len(ARTIFACTS))]
    artifacts = {
        name: {"offset": 16 * i, "length": 16, "sha256": hashlib.sha256(blob).hexdigest()}
        for i, (name, blob) in enumerate(zip(ARTIFACTS, blobs, strict=True))
    }
    text = manifest_text.replace(b'"ARTIFACTS"', json.dumps(artifacts).encode())
    return MAGIC + struct.pack(">I", len(text)) + text + b"".join(blobs)


HEAD = f'"format":"{FORMAT_NAME}","format_version":{FORMAT_VERSION}'.encode()
MANIFESTS: list[tuple[str, bytes]] = [
    ("infinity-leaves", b"{" + HEAD + b',"artifacts":"ARTIFACTS","platforms":["cpu"],'
     b'"signature":{"n_x_leaves":Infinity,"n_context_leaves":0,"n_output_leaves":1}}'),
    ("nan-leaves", b"{" + HEAD + b',"artifacts":"ARTIFACTS","platforms":["cpu"],'
     b'"signature":{"n_x_leaves":NaN,"n_context_leaves":0,"n_output_leaves":1}}'),
    ("1e999-leaves", b"{" + HEAD + b',"artifacts":"ARTIFACTS","platforms":["cpu"],'
     b'"signature":{"n_x_leaves":1e999,"n_context_leaves":0,"n_output_leaves":1}}'),
    ("deep-signature", b"{" + HEAD + b',"artifacts":"ARTIFACTS","platforms":["cpu"],'
     b'"signature":{"n_x_leaves":1,"n_context_leaves":0,"n_output_leaves":1,"x":'
     + ('{"list":[' * 700 + "null" + "]}" * 700).encode() + b"}}"),
    ("deep-platforms", b"{" + HEAD + b',"artifacts":"ARTIFACTS","platforms":'
     + nested(3000, '"cpu"').encode() + b"}"),
]


@pytest.mark.parametrize("manifest", [m[1] for m in MANIFESTS], ids=[m[0] for m in MANIFESTS])
def test_export_manifest_non_finite_or_deep_is_422(http, manifest):
    with pytest.raises(ValueError, match="manifest is not JSON"):
        split_bundle(bundle(manifest))
    body = {"name": "hostile_export", "export": base64.b64encode(bundle(manifest)).decode()}
    r = http.post("/functions", json=body)
    expect_problem(r, (400, 422), "export")
    still_alive(http, r)


def test_loads_checked_refuses_non_finite_and_depth():
    assert loads_checked(b'{"a":[1,2.5,{"b":null}]}') == {"a": [1, 2.5, {"b": None}]}
    assert loads_checked(nested(64)) == json.loads(nested(64))
    for bad in (b"[NaN]", b"[Infinity]", b"[-Infinity]", b"[1e999]", nested(65).encode(),
                nested(100_000).encode(), b"\xff"):
        with pytest.raises(ValueError):
            loads_checked(bad)


# --------------------------------------------------------------------------- 3. out of memory


def _oom(*args: Any, **kwargs: Any) -> Any:
    from jax.errors import JaxRuntimeError

    raise JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8 TiB")


@pytest.fixture
def in_process(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """``make(**settings)`` -> a TestClient on an in-process app (closed at the end)."""
    from starlette.testclient import TestClient

    from dxserve.http import create_app
    from dxserve.settings import Settings

    clients: list[TestClient] = []

    def make(**kw: Any) -> TestClient:
        settings = Settings(store=tmp_path / f"store{len(clients)}", compilation_cache="",
                            executable_cache_mb=0, warm_up=False, **kw)
        client = TestClient(create_app(settings), raise_server_exceptions=False)
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.mark.parametrize("max_batch", [1, 32])
def test_device_out_of_memory_outside_prep_run_is_503(in_process, monkeypatch, max_batch):
    """``np.asarray`` of a device result (``service._host``) running out of memory."""
    import dxserve.server.service

    client = in_process(max_batch=max_batch)
    good = client.post("/gradient", json={"function": "rosenbrock", "x": GOOD_X})
    assert good.status_code == 200
    monkeypatch.setattr(dxserve.server.service, "_host", _oom)
    for _ in range(3):  # first call and warm (batched or inline) calls
        r = client.post("/gradient", json={"function": "rosenbrock", "x": GOOD_X})
        doc = expect_problem(r, (503,))
        assert doc["type"].endswith("overloaded") and "out of memory" in doc["detail"]
        assert r.headers["retry-after"] == "5"
    monkeypatch.undo()
    assert client.post("/gradient", json={"function": "rosenbrock", "x": GOOD_X}).status_code == 200


def test_out_of_memory_anywhere_in_the_http_layer_is_503(in_process, monkeypatch):
    from dxserve.pipeline import OperatorCall

    client = in_process()
    monkeypatch.setattr(OperatorCall, "encode", _oom)
    r = client.post("/gradient", json={"function": "rosenbrock", "x": GOOD_X})
    expect_problem(r, (503,))
    assert "retry-after" in r.headers

    def host_oom(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError()

    monkeypatch.setattr(OperatorCall, "encode", host_oom)
    expect_problem(client.post("/gradient", json={"function": "rosenbrock", "x": GOOD_X}), (503,))


# --------------------------------------------------------------------------- 4. full disk


def test_store_full_disk_is_storage_full(tmp_path, monkeypatch):
    from dxserve.server.stores.directory import DirectoryStore

    store = DirectoryStore(tmp_path / "store")
    try:
        for code in (errno.ENOSPC, errno.EDQUOT):
            def full(fd: int, code: int = code) -> None:
                raise OSError(code, os.strerror(code))

            monkeypatch.setattr(os, "fsync", full)
            with pytest.raises(StorageFullError, match="no space left"):
                store.put("f", "expression", b'{"e": 1}', {})
            monkeypatch.undo()
            assert store.get("f") is None
            leftovers = [p.name for p in (tmp_path / "store").rglob("*.tmp")]
            assert leftovers == []
        store.put("f", "expression", b'{"e": 1}', {})  # space again: it works
        assert store.get("f") is not None
    finally:
        store.close()


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs (needs root and mount); skipped where it cannot be mounted."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_full_filesystem_is_507_and_the_connection_lives(make_server, tiny_fs):
    srv = make_server(args=("--store", str(tiny_fs / "store")))
    filler = tiny_fs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:  # fill the disk to the last block
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    with httpx.Client(base_url=srv.url) as http:
        body = {"name": "full_disk", "expression": "jnp.sum(x ** 2) + " + " + ".join(
            f"{i}.0 * x[0]" for i in range(200)
        )}
        r = http.post("/functions", json=body)
        doc = expect_problem(r, (507,))
        assert doc["type"].endswith("insufficient-storage") and "no space" in doc["detail"]
        still_alive(http, r)
        assert http.get("/functions/full_disk").status_code == 404
        filler.unlink()
        assert http.post("/functions", json=body).status_code == 201


# --------------------------------------------------------------------------- 5./6. concurrency


def long_expression(i: int) -> str:
    terms = [f"jnp.sin(x[{k % 3}] * {i}.{k}) * jnp.cos(x[{(k + 1) % 3}])" for k in range(110)]
    return "jnp.sum(x ** 2) + " + " + ".join(terms)


def test_16_concurrent_long_registrations_no_5xx(server):
    def register(i: int) -> int:
        with httpx.Client(base_url=server.url) as client:
            body = {"name": f"long_{i}", "expression": long_expression(i), "replace": True}
            return client.post("/functions", json=body).status_code

    for _ in range(3):
        with cf.ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(register, range(16)))
        assert all(s in (200, 201) for s in statuses), statuses
    with httpx.Client(base_url=server.url) as client:
        for i in range(16):
            assert client.delete(f"/functions/long_{i}").status_code == 200


def test_concurrent_registrations_never_pass_the_cap(make_server):
    cap = 20
    srv = make_server(env={"DXSERVE_MAX_FUNCTIONS": str(cap)})
    with httpx.Client(base_url=srv.url) as client:
        for i in range(cap - 5):
            body = {"name": f"pre_{i}", "expression": f"jnp.sum(x) * {i}"}
            assert client.post("/functions", json=body).status_code == 201

    def register(i: int) -> int:
        with httpx.Client(base_url=srv.url) as client:
            body = {"name": f"race_{i}", "expression": long_expression(i)}
            return client.post("/functions", json=body).status_code

    with cf.ThreadPoolExecutor(32) as pool:
        statuses = list(pool.map(register, range(64)))
    assert sorted(set(statuses)) == [201, 429], statuses
    assert statuses.count(201) == 5
    with httpx.Client(base_url=srv.url) as client:
        listed = client.get("/functions").json()["functions"]
        stored = [f for f in listed if f["kind"] != "module"]
        assert len(stored) == cap
        # a freed slot is usable again; a name already taken does not take another
        assert client.delete("/functions/pre_0").status_code == 200
        again = {"name": "race_again", "expression": "jnp.sum(x)"}
        assert client.post("/functions", json=again).status_code == 201
        assert client.post("/functions", json=again).status_code == 200
        expect_problem(client.post("/functions", json={**again, "name": "one_more"}), (429,))


# --------------------------------------------------------------------------- 7. secure by default


@pytest.mark.parametrize(
    ("host", "env", "writes"),
    [
        ("127.0.0.1", {}, True),
        ("127.8.9.10", {}, True),
        ("localhost", {}, True),
        ("::1", {}, True),
        ("0.0.0.0", {}, False),
        ("::", {}, False),
        ("10.1.2.3", {}, False),
        ("myhost.example", {}, False),
        ("0.0.0.0", {"allow_anonymous_registration": True}, True),
    ],
)
def test_registry_writes_are_closed_beyond_loopback_without_a_token(tmp_path, host, env, writes):
    from dxcontract.errors import ForbiddenError
    from dxserve.server.service import Service
    from dxserve.settings import Settings

    service = Service(Settings(host=host, store=tmp_path / "s", compilation_cache="",
                               functions=[], **env))
    try:
        service.authorize(None, "compute")  # computing is never refused for this
        if writes:
            service.authorize(None, "write")
            assert "open" in service.access_mode()
        else:
            with pytest.raises(ForbiddenError, match="DXSERVE_TOKEN") as info:
                service.authorize(None, "write")
            assert "DXSERVE_ALLOW_ANONYMOUS_REGISTRATION=true" in info.value.detail
            assert "refused" in service.access_mode()
    finally:
        service.close()


def test_a_token_decides_on_any_host(tmp_path):
    from dxcontract.errors import UnauthorizedError
    from dxserve.server.service import Service
    from dxserve.settings import Settings

    service = Service(Settings(host="0.0.0.0", token="s3cret", store=tmp_path / "s",
                               compilation_cache="", functions=[]))
    try:
        service.authorize("s3cret", "write")
        with pytest.raises(UnauthorizedError):
            service.authorize(None, "write")
        assert "bearer token" in service.access_mode()
    finally:
        service.close()


def test_forbidden_over_http_and_the_mode_is_logged(in_process, server):
    client = in_process(host="0.0.0.0")
    r = client.post("/functions", json={"name": "nope", "expression": "jnp.sum(x)"})
    doc = expect_problem(r, (403,), "Authorization")
    assert "DXSERVE_TOKEN" in doc["detail"]
    expect_problem(client.delete("/functions/nope"), (403,))
    assert client.post("/gradient", json={"function": "rosenbrock", "x": GOOD_X}).status_code == 200
    log = server.log.read_text(errors="replace")
    assert "access: registry writes are open without a token (loopback only: 127.0.0.1)" in log


# --------------------------------------------------------------------------- 8. connections


def raw_connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


# Only a hang guard: what a test checks is what the server sent before it closed (a 408
# proves the header or body deadline fired), never how soon.
HANG_GUARD_S = 60.0


def read_until_closed(s: socket.socket) -> bytes:
    """What the server sends on ``s`` until it closes the connection."""
    s.settimeout(HANG_GUARD_S)
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except TimeoutError:
        raise AssertionError(f"the server kept the connection open; it sent {got[:200]!r}") from None
    except ConnectionResetError:
        pass
    return got


@pytest.fixture
def slow_server(make_server):
    return make_server(env={"DXSERVE_HEADER_TIMEOUT": "1.5", "DXSERVE_BODY_TIMEOUT": "2.5",
                            "DXSERVE_MAX_HEADER_BYTES": "8192"})


@pytest.mark.protocol
def test_slow_headers_and_bodies_are_closed_while_others_are_served(slow_server):
    port = slow_server.port
    idle = [raw_connect(port) for _ in range(20)]  # connect, send nothing
    partial = [raw_connect(port) for _ in range(20)]  # headers trickled, never finished
    bodies = [raw_connect(port) for _ in range(10)]  # headers done, body trickled
    start = time.monotonic()
    for s in partial:
        s.sendall(b"POST /gradient HTTP/1.1\r\nHost: x\r\n")
    for s in bodies:
        s.sendall(b"POST /gradient HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 100000\r\n\r\n{")
    with httpx.Client(base_url=slow_server.url) as http:
        while time.monotonic() - start < 1.2:  # trickle a byte each, keep serving others
            for s in partial + bodies:
                s.sendall(b"a")
            assert http.get("/health").status_code == 200
            good_gradient(http)
            time.sleep(0.1)

        for s in idle + partial:
            got = read_until_closed(s)
            assert got.startswith(b"HTTP/1.1 408 "), got[:200]
            assert b"application/problem+json" in got and b'"field":"headers"' in got
        for s in bodies:
            got = read_until_closed(s)
            assert got.startswith(b"HTTP/1.1 408 ") and b'"field":"body"' in got, got[:300]
        good_gradient(http)  # the server is fine afterwards
    for s in idle + partial + bodies:
        s.close()


@pytest.mark.protocol
def test_keep_alive_request_after_idle_gets_its_own_header_deadline(slow_server):
    s = raw_connect(slow_server.port)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        while b'{"status":"ok"}' not in got:
            got += s.recv(65536)
        assert got.startswith(b"HTTP/1.1 200")
        time.sleep(1.0)  # under uvicorn's keep-alive timeout (5 s)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # then nothing more
        got = read_until_closed(s)  # a 408, not keep-alive's silent close
        assert got.startswith(b"HTTP/1.1 408 "), got[:200]
    finally:
        s.close()


@pytest.mark.protocol
def test_oversized_headers_are_431(slow_server):
    s = raw_connect(slow_server.port)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # closed at 8 KiB
            for _ in range(12):
                s.sendall(b"x-filler: " + b"a" * 1000 + b"\r\n")
                time.sleep(0.01)
        got = read_until_closed(s)
        assert got.startswith(b"HTTP/1.1 431 "), got[:200]
    finally:
        s.close()
    with httpx.Client(base_url=slow_server.url) as http:
        good_gradient(http)


@pytest.mark.protocol
def test_connection_cap_refuses_with_503_and_recovers(make_server):
    srv = make_server(env={"DXSERVE_MAX_CONNECTIONS": "12", "DXSERVE_HEADER_TIMEOUT": "1.5"})
    held = [raw_connect(srv.port) for _ in range(12)]
    time.sleep(0.2)
    extra = [raw_connect(srv.port) for _ in range(5)]
    for s in extra:  # a 503 (not the 408 an admitted one gets): refused on arrival
        got = read_until_closed(s)
        assert got.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in got.lower(), got[:200]
    for s in held:  # the held ones time out (408) and free their slots
        got = read_until_closed(s)
        assert got.startswith(b"HTTP/1.1 408 "), got[:200]
    with httpx.Client(base_url=srv.url) as http:
        good_gradient(http)
    for s in held + extra:
        s.close()
