"""A soak: many clients for minutes, a share of them hostile, against one real server.

    .venv/bin/python bench/soak.py                   # 16 clients, 180 s, 10% hostile
    .venv/bin/python bench/soak.py --seconds 30      # a short one
    .venv/bin/python bench/soak.py --skip unread     # leave out attacks (by name start)

Starts ``dxserve serve`` (example functions, a fresh store, the limits below) on
127.0.0.1 (a free port) and stops it by PID, and a second one with a token and private
metadata, for the probes that must learn no function names. ``--clients`` threads each
loop for ``--seconds``: with probability ``--hostile`` an attack (drawn from
``ATTACKS``, sent as an attacker would: raw sockets where a client library would be
polite), else a valid request (drawn from ``VALID``) whose answer is checked against its
closed form. Valid requests come from 127.0.0.1 and attacks from other loopback
addresses, so the caps counted per client address meet the attacker, not its victims.
Some attacks carry victims of their own (a cold gradient beside a flood of
``/sparsity``, gradients after a spinning upload): their answers are checked too, and
counted in the attack's row. A valid answer that is not 200 is not wrong (503 with
Retry-After, or 429 from the jobs' shared anonymous quota, are the limits at work);
wrong values are, as is any 5xx but 503 (overloaded, retry) and 507 (a job's result
past the job store, refused at submission).

``/health`` is probed every 0.25 s with a 1 s timeout, from a process of its own; a probe
that is not a 200 within it is a miss, charged to every kind of request in flight during
that second. The server's RSS is sampled every 0.5 s, each sample charged to the kinds
in flight then; a guard kills the server if it passes ``--max-rss`` (the run then
fails). Everything an attack opens is bounded: connections per attack, bytes offered
per connection.

Prints (and saves as ``results/soak.md``) a table per request kind, RSS per 30 s, and
RSS at the start, the first minute's and last minute's medians, the peak and at the
end: "flat" means the last minute's median is at most 15% (or 64 MiB) above the first
minute's (lower is flat too: a leak only grows). Exits 1 on any wrong answer, 5xx
other than 503/507, health miss or dead server.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
from _common import PYTHON, Server, Tee, free_port, machine_line, markdown_table

JSON = {"content-type": "application/json"}
BINARY = "application/vnd.dxserve.binary"
#: the server's limits for the soak: small enough that attacks meet them
SERVER_ENV = {
    "DXSERVE_MAX_INFLIGHT_BYTES": str(256 * 2**20),
    "DXSERVE_WRITE_TIMEOUT": "5",
    "DXSERVE_HEADER_TIMEOUT": "5",
    "DXSERVE_BODY_TIMEOUT": "10",
    "DXSERVE_REQUEST_TIMEOUT": "60",
    # compiled operators of the attacks' new shapes fill the cache: bounded small, it is
    # full within the first minute, so what grows after it is not the cache filling
    "DXSERVE_CACHE_SIZE": "64",
    "DXSERVE_CACHE_BYTES": str(128 * 2**20),
}
#: the second server: a token, and metadata (function names) only for its holders
PRIVATE_ENV = {
    "DXSERVE_TOKEN": "soak-operator-token-0123456789",
    "DXSERVE_PRIVATE_METADATA": "true",
    "DXSERVE_WARM_UP": "false",
}
#: what the attacks use, made before the clients start (job ids, the spinning upload)
FIXTURES: dict[str, str] = {}
#: each client thread's address: 127.0.0.1 for valid requests, another for attacks
_SOURCE = threading.local()


def _source() -> str:
    return getattr(_SOURCE, "address", "127.0.0.1")


def _client(url: str, source: str | None = None, timeout: float = 120) -> httpx.Client:
    transport = httpx.HTTPTransport(local_address=source or _source())
    return httpx.Client(base_url=url, timeout=timeout, transport=transport)


# --------------------------------------------------------------------------- references


def rosenbrock_gradient(x: np.ndarray) -> np.ndarray:
    g = np.zeros_like(x)
    g[:-1] = -400.0 * x[:-1] * (x[1:] - x[:-1] ** 2) - 2.0 * (1.0 - x[:-1])
    g[1:] += 200.0 * (x[1:] - x[:-1] ** 2)
    return g


def rosenbrock_hessian(x: np.ndarray) -> np.ndarray:
    n = x.size
    h = np.zeros((n, n))
    i = np.arange(n - 1)
    h[i, i] += 1200.0 * x[:-1] ** 2 - 400.0 * x[1:] + 2.0
    h[i + 1, i + 1] += 200.0
    h[i, i + 1] = h[i + 1, i] = -400.0 * x[:-1]
    return h


def sin_cumsum_jacobian(x: np.ndarray) -> np.ndarray:
    c = np.cumsum(x)
    jac = np.tril(np.ones((x.size, x.size))) * np.sin(x)[:, None]
    jac[np.arange(x.size), np.arange(x.size)] += np.cos(x) * c
    return jac


# --------------------------------------------------------------------------- valid


def _close(got: object, want: np.ndarray, rtol: float = 1e-9) -> bool:
    got = np.asarray(got, dtype=float)
    return got.shape == want.shape and bool(np.allclose(got, want, rtol=rtol, atol=1e-9))


def valid_gradient(http: httpx.Client, rng: random.Random) -> tuple[int, bool]:
    x = np.asarray([rng.uniform(-2, 2) for _ in range(rng.choice((3, 10, 50)))])
    r = http.post("/gradient", json={"function": "rosenbrock", "x": x.tolist()})
    return r.status_code, r.status_code != 200 or _close(
        r.json()["gradient"], rosenbrock_gradient(x)
    )


def valid_hvp(http: httpx.Client, rng: random.Random) -> tuple[int, bool]:
    x = np.asarray([rng.uniform(-2, 2) for _ in range(10)])
    t = np.asarray([rng.uniform(-1, 1) for _ in range(10)])
    r = http.post(
        "/hvp", json={"function": "rosenbrock", "x": x.tolist(), "tangents": [t.tolist()]}
    )
    ok = r.status_code != 200 or _close(r.json()["hvps"][0], rosenbrock_hessian(x) @ t)
    return r.status_code, ok


def valid_hessian(http: httpx.Client, rng: random.Random) -> tuple[int, bool]:
    x = np.asarray([rng.uniform(-2, 2) for _ in range(rng.choice((5, 40)))])
    r = http.post("/hessian", json={"function": "rosenbrock", "x": x.tolist()})
    return r.status_code, r.status_code != 200 or _close(r.json()["hessian"], rosenbrock_hessian(x))


def valid_jacobian(http: httpx.Client, rng: random.Random) -> tuple[int, bool]:
    x = np.asarray([rng.uniform(-2, 2) for _ in range(20)])
    r = http.post(
        "/jacobian", json={"function": "sin_cumsum", "backend": "jax-forward", "x": x.tolist()}
    )
    ok = r.status_code != 200 or _close(r.json()["jacobian"], sin_cumsum_jacobian(x))
    return r.status_code, ok


def valid_sparse(http: httpx.Client, rng: random.Random) -> tuple[int, bool]:
    x = np.asarray([rng.uniform(-2, 2) for _ in range(30)])
    r = http.post("/hessian", json={"function": "rosenbrock", "backend": "sparse", "x": x.tolist()})
    if r.status_code != 200:
        return r.status_code, True
    s = r.json()["hessian"]
    dense = np.zeros(tuple(s["shape"]))

    def array(v: object) -> np.ndarray:  # int32 indices come as typed objects
        return np.asarray(v["__ndarray__"] if isinstance(v, dict) else v)

    indptr, indices, data = array(s["indptr"]), array(s["indices"]), array(s["data"]).astype(float)
    for row in range(len(indptr) - 1):
        dense[row, indices[indptr[row] : indptr[row + 1]]] = data[indptr[row] : indptr[row + 1]]
    return r.status_code, _close(dense, rosenbrock_hessian(x))


def valid_job(http: httpx.Client, rng: random.Random) -> tuple[int, bool]:
    """A detached gradient job, its result fetched once it has ended."""
    x = np.asarray([rng.uniform(-2, 2) for _ in range(10)])
    r = http.post("/jobs/gradient", json={"function": "rosenbrock", "x": x.tolist()})
    if r.status_code != 202:
        return r.status_code, True
    job = r.json()["id"]
    for _ in range(1200):  # 409 until it has ended
        r = http.get(f"/jobs/{job}/result")
        if r.status_code != 409:
            break
        time.sleep(0.1)
    return r.status_code, r.status_code != 200 or _close(
        r.json()["gradient"], rosenbrock_gradient(x)
    )


VALID: dict[str, Callable[[httpx.Client, random.Random], tuple[int, bool]]] = {
    "gradient": valid_gradient,
    "hvp": valid_hvp,
    "hessian": valid_hessian,
    "jacobian": valid_jacobian,
    "sparse hessian": valid_sparse,
    "job gradient": valid_job,
}


# --------------------------------------------------------------------------- hostile


def _raw(url: str, data: bytes, read: bool = True, hold: float = 0.0) -> int:
    """Send ``data`` on a new connection; the answer's status (0 if none)."""
    with _connect(url) as s:
        try:
            s.sendall(data)
        except OSError:
            pass
        if hold:
            time.sleep(hold)
        if not read:
            return 0
        got = b""
        try:
            while b"\r\n" not in got:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
        except OSError:
            pass
    return int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else 0


def attack_malformed(http: httpx.Client, rng: random.Random) -> int:
    body = rng.choice(
        [
            b"{",
            b"[1,2]",
            b'{"function": 1, "x": []}',
            b'{"x": "a"}',
            b'{"function": "rosenbrock", "x": [1, "a"]}',
            bytes(rng.randbytes(64)),
        ]
    )
    return http.post("/gradient", content=body, headers=JSON).status_code


def attack_huge_shape(http: httpx.Client, rng: random.Random) -> int:
    x = {"__ndarray__": "", "dtype": "float64", "shape": [0, 2**40]}
    return http.post("/hessian", json={"function": "rosenbrock", "x": x}).status_code


def attack_bad_dtype(http: httpx.Client, rng: random.Random) -> int:
    x = {
        "__ndarray__": "AAAA",
        "dtype": rng.choice(["object", "<U4", "float128", "V8"]),
        "shape": [1],
    }
    return http.post("/gradient", json={"function": "rosenbrock", "x": x}).status_code


def attack_quartic(http: httpx.Client, rng: random.Random) -> int:
    x = [0.5] * 20_000  # a dense Hessian of 20,000^2: refused by the result limit
    return http.post("/hessian", json={"function": "rosenbrock", "x": x}).status_code


def attack_sparse_detection(http: httpx.Client, rng: random.Random) -> int:
    x = [0.5] * rng.choice((3000, 8000))  # a dense pattern: refused within the budgets
    return http.post(
        "/sparsity", json={"function": "softmax", "backend": "sparse", "x": x}
    ).status_code


def attack_tangent_flood(http: httpx.Client, rng: random.Random) -> int:
    body = {"function": "rosenbrock", "x": [1.0, 2.0, 3.0], "tangents": [[1.0, 1.0, 1.0]] * 16_000}
    return http.post("/hvp", json=body).status_code


def attack_leaf_flood(http: httpx.Client, rng: random.Random) -> int:
    x = {f"k{i}": [1.0] for i in range(20_000)}
    return http.post("/gradient", json={"function": "rosenbrock", "x": x}).status_code


def attack_bad_pattern(http: httpx.Client, rng: random.Random) -> int:
    sparsity = {"format": "csr", "shape": [3, 3], "indptr": [0, 2**70, 1, 1], "indices": [1e300]}
    backend = {"type": "sparse", "sparsity": sparsity}
    return http.post(
        "/jacobian", json={"function": "sin_cumsum", "backend": backend, "x": [1.0, 2.0, 3.0]}
    ).status_code


def attack_big_header(http: httpx.Client, rng: random.Random) -> int:
    data = b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 80_000 + b"\r\n\r\n"
    return _raw(str(http.base_url), data)


def attack_partial_head(http: httpx.Client, rng: random.Random) -> int:
    return _raw(str(http.base_url), b"POST /gradient HTTP/1.1\r\nhost: x\r\n", read=False, hold=0.5)


def attack_unread_answer(http: httpx.Client, rng: random.Random) -> int:
    body = json.dumps({"function": "rosenbrock", "x": [0.5] * 600}).encode()
    data = (
        b"POST /hessian HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"accept: application/vnd.dxserve.binary\r\ncontent-length: %d\r\n\r\n" % len(body)
    ) + body
    return _raw(str(http.base_url), data, read=False, hold=0.2)


def attack_unread_stream(http: httpx.Client, rng: random.Random) -> int:
    body = json.dumps({"function": "rosenbrock", "x": [0.5] * 600}).encode()
    data = (
        b"POST /hessian HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"accept: text/event-stream\r\ncontent-length: %d\r\n\r\n" % len(body)
    ) + body
    return _raw(str(http.base_url), data, read=False, hold=0.2)


def attack_oversized_body(http: httpx.Client, rng: random.Random) -> int:
    head = (
        b"POST /gradient HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 999999999999\r\n\r\n{"
    )
    return _raw(str(http.base_url), head)


def attack_expression(http: httpx.Client, rng: random.Random) -> int:
    body = {"name": f"evil{rng.randrange(10**6)}", "expression": "__import__('os').system('id')"}
    return http.post("/functions", json=body).status_code


# --- the attacks of the third adversarial pass: job answers, trailers, uploads, streams


def _connect(url: str) -> socket.socket:
    host, port = url.rsplit("//", 1)[1].rstrip("/").split(":")
    return socket.create_connection((host, int(port)), timeout=60, source_address=(_source(), 0))


def _status_line(s: socket.socket) -> int:
    """The answer's status, reading no more than its first kilobyte (0 if none)."""
    got = b""
    try:
        while b"\r\n" not in got:
            chunk = s.recv(1024)
            if not chunk:
                break
            got += chunk
    except OSError:
        pass
    return int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else 0


def _unread_many(url: str, request: bytes, n: int, hold: float) -> list[tuple[int, bool]]:
    """``n`` connections send ``request``, read its status line and nothing more for
    ``hold`` seconds (past the write timeout or not), then go."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = _connect(url)
            socks.append(s)
            s.sendall(request)
        statuses = [(_status_line(s), True) for s in socks]
        time.sleep(hold)
    finally:
        for s in socks:
            s.close()
    return statuses


def attack_unread_job_result(http: httpx.Client, rng: random.Random) -> list[tuple[int, bool]]:
    request = b"GET /jobs/%s/result HTTP/1.1\r\nhost: x\r\naccept: %s\r\n\r\n" % (
        FIXTURES["big job"].encode(),
        BINARY.encode(),
    )
    return _unread_many(str(http.base_url), request, 4, rng.choice((1.0, 7.0)))


def attack_unread_job_events(http: httpx.Client, rng: random.Random) -> list[tuple[int, bool]]:
    request = b"GET /jobs/%s/events HTTP/1.1\r\nhost: x\r\n\r\n" % FIXTURES["big job"].encode()
    return _unread_many(str(http.base_url), request, 4, rng.choice((1.0, 7.0)))


TRAILER_BODY = json.dumps({"function": "rosenbrock", "x": [1.0, 2.0, 3.0]}).encode()
TRAILER_LINE = b"x-trailer: " + b"a" * 1000 + b"\r\n"


def attack_endless_trailers(http: httpx.Client, rng: random.Random) -> int:
    """One valid chunk, the last chunk, then trailer lines without end (1 MiB offered)."""
    with _connect(str(http.base_url)) as s:
        try:
            s.sendall(
                b"POST /gradient HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n"
                % (len(TRAILER_BODY), TRAILER_BODY)
            )
            for _ in range(16):
                s.sendall(TRAILER_LINE * 64)
        except OSError:  # closed by the server: what should happen
            pass
        return _status_line(s)


def spin(x):  # noqa: ANN001, ANN201 - traced by JAX
    """Σ c, c = 1.5 c + 1 while c[0] > 1: exits at once on the export gate's example
    (ones: 1 > 1 is false) and never on x[0] > 1."""
    import jax.numpy as jnp
    from jax import lax

    return jnp.sum(lax.while_loop(lambda c: c[0] > 1.0, lambda c: 1.5 * c + 1.0, x))


def spin_upload() -> str:
    """The base64 bundle of ``spin`` as ``dxclient`` uploads it."""
    from dxclient.export import export_function

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its reverse mode is computed by the server
        return base64.b64encode(export_function(spin, np.ones(3))).decode("ascii")


def attack_spinning_upload(http: httpx.Client, rng: random.Random) -> list[tuple[int, bool]]:
    """Upload a data-dependent ``lax.while_loop`` (422 by default), call it on data that
    would spin, then three Rosenbrock gradients, checked."""
    name = f"spin{rng.randrange(10**9)}"
    r = http.post(
        "/functions",
        json={"name": name, "description": "", "replace": False, "export": FIXTURES["spin"]},
    )
    out = [(r.status_code, r.status_code == 422)]
    if r.status_code in (200, 201):  # accepted: it must still never hold the server
        out.append(
            (
                http.post("/gradient", json={"function": name, "x": [2.0, 0.0, 0.0]}).status_code,
                True,
            )
        )
        http.delete(f"/functions/{name}")
    return out + [valid_gradient(http, rng) for _ in range(3)]


def attack_huge_job_result(http: httpx.Client, rng: random.Random) -> tuple[int, bool]:
    """A ~100 KB job whose Jacobian would take 1-3 GB: refused at submission."""
    n = rng.choice((11_584, 20_000))
    r = http.post("/jobs/jacobian", json={"function": "sin_cumsum", "x": [0.5] * n})
    return r.status_code, r.status_code in (422, 507)


def _cursor(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


BAD_CURSORS = [
    _cursor(b"[" + b"9" * 320 + b', "abcdefgh"]'),  # a created past any float
    _cursor(b'[1.5, "\\ud800abcdefgh"]'),  # a lone surrogate in the id
    _cursor(b'[1e400, "abcdefgh"]'),
    _cursor(b'[NaN, "abcdefgh"]'),
    _cursor(b"\xff\xfe"),
    "%ED%A0%80",
    "!!!",
    "9" * 4000,
]


def attack_bad_cursor(http: httpx.Client, rng: random.Random) -> tuple[int, bool]:
    r = http.get(f"/jobs?after={rng.choice(BAD_CURSORS)}&limit={rng.choice((1, 100, 10**30))}")
    return r.status_code, 400 <= r.status_code < 500


def attack_invented_tokens(http: httpx.Client, rng: random.Random) -> list[tuple[int, bool]]:
    """Four jobs, each under a bearer token made up for it: one anonymous quota."""
    out = []
    for _ in range(4):
        token = f"invented-{rng.randrange(10**12)}"
        r = http.post(
            "/jobs/gradient",
            json={"function": "rosenbrock", "x": [1.0, 2.0, 3.0]},
            headers={"authorization": f"Bearer {token}"},
        )
        out.append((r.status_code, r.status_code in (202, 429)))
    return out


def _final_event(response: httpx.Response) -> tuple[int, object]:
    """Read a job's event stream to its final event: (200, the result document) for a
    result, (the problem's status, None) for an error, (0, None) if it ended without."""
    name = None
    try:
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: ") and name in ("result", "error"):
                doc = json.loads(line[6:])
                return (200, doc) if name == "result" else (int(doc["status"]), None)
    except httpx.HTTPError:
        pass
    return 0, None


def attack_watchers(http: httpx.Client, rng: random.Random) -> list[tuple[int, bool]]:
    """32 event streams on one new job (1,100 Rosenbrock gradients in 10 chunks, a 65 KB
    result), opened at once and then each read to its end; every result is checked."""
    x = np.asarray([[rng.uniform(-2, 2) for _ in range(3)] for _ in range(1100)])
    body = {"function": "rosenbrock", "x": x.tolist(), "batch_axis": 0}
    r = http.post("/jobs/gradient", json=body)
    out = [(r.status_code, r.status_code in (202, 429))]
    if r.status_code != 202:
        return out
    want = np.stack([rosenbrock_gradient(row) for row in x])
    path = f"/jobs/{r.json()['id']}/events"
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=0)
    transport = httpx.HTTPTransport(local_address=_source(), limits=limits)
    with (
        httpx.Client(base_url=http.base_url, timeout=120, transport=transport) as watcher,
        contextlib.ExitStack() as streams,
    ):
        opened = [streams.enter_context(watcher.stream("GET", path)) for _ in range(32)]
        for response in opened:
            status, doc = response.status_code, None
            if status == 200:  # the stream began: what its final event said
                status, doc = _final_event(response)
            ok = status in (429, 503) or (status == 200 and _close(doc["gradient"], want))
            out.append((status, ok))
    return out


def attack_sparsity_flood(http: httpx.Client, rng: random.Random) -> list[tuple[int, bool]]:
    """12 cheap ``/sparsity`` calls on distinct shapes from 3 addresses at once, and a
    victim's first gradient on a new shape from 127.0.0.1, checked."""
    url = str(http.base_url)
    out: list[tuple[int, bool]] = []
    lock = threading.Lock()

    def detect(n: int, source: str) -> None:
        with _client(url, source) as h:
            try:
                status = h.post(
                    "/sparsity",
                    json={"function": "rosenbrock", "backend": "sparse", "x": [0.5] * n},
                ).status_code
            except httpx.HTTPError:
                status = 0
        with lock:
            out.append((status, status in (200, 429, 503)))

    base = _source().rsplit(".", 1)[0]
    threads = [
        threading.Thread(target=detect, args=(n, f"{base}.{200 + i % 3}"))
        for i, n in enumerate(rng.sample(range(20, 4000), 12))
    ]
    for t in threads:
        t.start()
    x = np.asarray([rng.uniform(-2, 2) for _ in range(rng.randrange(4000, 60_000))])
    with _client(url, "127.0.0.1") as victim:
        r = victim.post("/gradient", json={"function": "rosenbrock", "x": x.tolist()})
    ok = r.status_code != 200 or _close(r.json()["gradient"], rosenbrock_gradient(x))
    for t in threads:
        t.join()
    return [*out, (r.status_code, ok)]


def attack_private_probe(http: httpx.Client, rng: random.Random) -> list[tuple[int, bool]]:
    """Near-miss names on the private-metadata server, with no token or an invented
    one: the 404s must name no function."""
    out = []
    with _client(FIXTURES["private"]) as h:
        headers = rng.choice(({}, {"authorization": "Bearer nope"}))
        body = {"function": rng.choice(("rosenbrok", "rosenbrock2", "sin_cumsun")), "x": [1.0]}
        for r in (
            h.post(
                rng.choice(("/gradient", "/jobs/gradient", "/prepare/gradient")),
                json=body,
                headers=headers,
            ),
            h.get(f"/functions/{body['function']}", headers=headers),
        ):
            text = r.text.lower()
            leak = "rosenbrock" in text.replace("rosenbrock2", "") or "sin_cumsum" in text
            out.append((r.status_code, not leak and "did you mean" not in text))
    return out


ATTACKS: dict[str, Callable[[httpx.Client, random.Random], int]] = {
    "malformed body": attack_malformed,
    "zero-size huge shape": attack_huge_shape,
    "bad dtype": attack_bad_dtype,
    "huge dense Hessian": attack_quartic,
    "sparse detection (softmax)": attack_sparse_detection,
    "16,000 tangents": attack_tangent_flood,
    "20,000 pytree leaves": attack_leaf_flood,
    "malformed pattern": attack_bad_pattern,
    "80 KB header": attack_big_header,
    "partial head": attack_partial_head,
    "unread answer": attack_unread_answer,
    "unread stream": attack_unread_stream,
    "oversized body": attack_oversized_body,
    "sandbox escape": attack_expression,
    "unread job result (4 x 8 MB)": attack_unread_job_result,
    "unread job events (4 x 8 MB)": attack_unread_job_events,
    "endless trailers": attack_endless_trailers,
    "spinning upload + 3 gradients": attack_spinning_upload,
    "job with a 1-3 GB result": attack_huge_job_result,
    "bad jobs cursor": attack_bad_cursor,
    "invented bearer tokens (4 jobs)": attack_invented_tokens,
    "32 event watchers on a job": attack_watchers,
    "12 /sparsity + a victim's cold gradient": attack_sparsity_flood,
    "private-metadata 404 probes": attack_private_probe,
}


# --------------------------------------------------------------------------- the run


#: the /health prober (its own process): argv url, until (time.monotonic, which is
#: the same clock in every process); prints "<time> [miss]" per probe
PROBER = """
import sys, time, httpx
url, until = sys.argv[1], float(sys.argv[2])
with httpx.Client(timeout=1.0) as http:
    while time.monotonic() < until:
        t = time.monotonic()
        try:
            status = http.get(url + "/health").status_code
            miss = "" if status == 200 else f"status-{status}"
        except httpx.HTTPError as exc:
            miss = type(exc).__name__
        print(f"{t:.3f} {miss}", flush=True)
        time.sleep(max(0.0, 0.25 - (time.monotonic() - t)))
"""


def rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # gone
        pass
    return 0


def outcomes(result: object) -> list[tuple[int, bool]]:
    """An attack's answers as (status, as expected) pairs."""
    if isinstance(result, int):
        return [(result, True)]
    if isinstance(result, tuple):
        return [result]
    return list(result)


class Tally:
    """What every kind of request got, and what the server did while it was in flight."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.statuses: dict[str, Counter] = defaultdict(Counter)
        self.wrong: Counter = Counter()
        self.errors: Counter = Counter()
        self.active: Counter = Counter()
        self.misses: Counter = Counter()
        self.probes = 0
        self.missed: list[str] = []
        self.spans: list[tuple[str, float, float]] = []
        self.samples: list[tuple[float, int, frozenset]] = []

    def probed(self, lines: str) -> None:
        """Count the prober's lines (``<monotonic time> [miss]``): a miss is charged to
        every kind with a request in flight during that probe's second."""
        for line in lines.splitlines():
            at, _, miss = line.partition(" ")
            self.probes += 1
            if miss:
                self.missed.append(miss)
                t = float(at)
                for name in {n for n, began, ended in self.spans if began <= t + 1 and ended >= t}:
                    self.misses[name] += 1

    def in_flight(self) -> frozenset:
        with self.lock:
            return frozenset(k for k, n in self.active.items() if n)


def prepare(url: str, private_url: str) -> None:
    """Warm the valid requests, finish an 8 MB Jacobian job (what the unread job answers
    ask for), export the spinning function."""
    with _client(url) as http:
        for fn in VALID.values():
            fn(http, random.Random(0))
        r = http.post(
            "/jobs/jacobian",
            json={
                "function": "sin_cumsum",
                "backend": "jax-forward",
                "x": np.linspace(0.1, 1.3, 1000).tolist(),
            },
        )
        assert r.status_code == 202, r.text
        FIXTURES["big job"] = r.json()["id"]
        for _ in range(1200):
            if http.get(f"/jobs/{FIXTURES['big job']}").json()["status"] not in (
                "queued",
                "running",
            ):
                break
            time.sleep(0.1)
    FIXTURES["private"] = private_url
    FIXTURES["spin"] = spin_upload()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--hostile", type=float, default=0.10)
    parser.add_argument(
        "--max-rss",
        type=float,
        default=4.0,
        metavar="GIB",
        help="kill the server past this resident memory (GiB)",
    )
    parser.add_argument("--save", default="soak.md")
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="ATTACK",
        help="leave out an attack (by the start of its name); repeatable",
    )
    args = parser.parse_args(argv)
    for skip in args.skip:
        for name in [n for n in ATTACKS if n.startswith(skip)]:
            del ATTACKS[name]
    out = Tee()
    tally = Tally()
    killed = False
    with tempfile.TemporaryDirectory() as tmp:
        servers = []
        try:
            for name, env in (("main", SERVER_ENV), ("private", PRIVATE_ENV)):
                port = free_port()
                servers.append(
                    Server(
                        [
                            PYTHON,
                            "-m",
                            "dxserve.cli",
                            "serve",
                            "--port",
                            str(port),
                            "--store",
                            f"{tmp}/{name}-store",
                            "--compilation-cache",
                            "",
                            "--log-level",
                            "warning",
                        ],
                        port,
                        "/health",
                        Path(tmp) / f"{name}.log",
                        env=env,
                    )
                )
            server, private = servers
            prepare(server.url, private.url)
            stop = time.monotonic() + args.seconds
            start = time.monotonic()

            def client(seed: int) -> None:
                rng = random.Random(seed)
                hostile_source = f"127.0.{1 + seed // 200}.{2 + seed % 200}"
                with (
                    _client(server.url, "127.0.0.1") as valid,
                    _client(server.url, hostile_source) as hostile,
                ):
                    while time.monotonic() < stop:
                        attack = rng.random() < args.hostile
                        name = rng.choice(list(ATTACKS if attack else VALID))
                        _SOURCE.address = hostile_source if attack else "127.0.0.1"
                        with tally.lock:
                            tally.active[name] += 1
                        began = time.monotonic()
                        try:
                            if attack:
                                got = outcomes(ATTACKS[name](hostile, rng))
                            else:
                                got = [VALID[name](valid, rng)]
                        except Exception as exc:  # noqa: BLE001 - counted, the soak goes on
                            with tally.lock:
                                tally.errors[f"{name}: {type(exc).__name__}"] += 1
                            continue
                        finally:
                            with tally.lock:
                                tally.active[name] -= 1
                                tally.spans.append((name, began, time.monotonic()))
                        with tally.lock:
                            for status, ok in got:
                                tally.statuses[name][status] += 1
                                tally.wrong[name] += not ok

            # /health from a process of its own: the soak's threads share one GIL, and a
            # probe must wait on the server only
            prober = subprocess.Popen(
                [PYTHON, "-c", PROBER, server.url, str(stop)],
                stdout=subprocess.PIPE,
                text=True,
            )

            threads = [
                threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)
            ]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                used = rss(server.proc.pid)
                tally.samples.append((time.monotonic() - start, used, tally.in_flight()))
                if used > args.max_rss * 2**30 and server.proc.poll() is None:
                    os.kill(server.proc.pid, signal.SIGKILL)  # the guard: this machine is shared
                    killed = True
                time.sleep(0.5)
            alive = server.proc.poll() is None and private.proc.poll() is None
            tally.probed(prober.communicate(timeout=60)[0])
        finally:
            for s in servers:
                s.stop()
    report(out, args, tally, alive and not killed, killed)
    if args.save:
        print(f"saved {out.save(args.save)}")
    bad = (
        sum(tally.wrong.values())
        + len(tally.missed)
        + sum(
            n
            for c in tally.statuses.values()
            for s, n in c.items()
            if s >= 500 and s not in (503, 507)
        )
    )
    return 0 if alive and not killed and not bad else 1


def report(out: Tee, args: argparse.Namespace, tally: Tally, alive: bool, killed: bool) -> None:
    out(f"# Soak: {args.clients} clients, {args.seconds:.0f} s, {args.hostile:.0%} hostile")
    out()
    out(
        f"{machine_line()}; server limits: "
        + ", ".join(f"{k}={v}" for k, v in SERVER_ENV.items())
        + f"; RSS guard {args.max_rss:g} GiB; private-metadata probes on a second server ("
        + ", ".join(f"{k}={v}" for k, v in PRIVATE_ENV.items() if k != "DXSERVE_TOKEN")
        + ")"
    )
    out()
    rows = []
    for name in [*VALID, *ATTACKS]:
        counts = tally.statuses.get(name, Counter())
        five = sum(n for s, n in counts.items() if s >= 500 and s not in (503, 507))
        shown = ", ".join(f"{s}: {n}" for s, n in sorted(counts.items()))
        mib = [b / 2**20 for _, b, busy in tally.samples if name in busy and b]
        memory = f"{mib[0]:.0f} / {max(mib):.0f} / {mib[-1]:.0f}" if mib else "-"
        kind = "valid" if name in VALID else "hostile"
        rows.append(
            [
                kind,
                name,
                sum(counts.values()),
                shown or "-",
                five,
                tally.wrong.get(name, 0),
                tally.misses.get(name, 0),
                memory,
            ]
        )
    out(
        markdown_table(
            [
                "kind",
                "request",
                "requests",
                "statuses",
                "5xx (not 503/507)",
                "wrong",
                "health misses",
                "RSS MiB in flight: first / peak / last",
            ],
            rows,
        )
    )
    out()
    out(
        "A hostile row's requests include its victims' (checked: a cold gradient beside the "
        "/sparsity flood, gradients after a spinning upload); its 'wrong' counts wrong victim "
        "answers and answers other than the expected refusal. A health miss is charged to "
        "every kind in flight during its second; RSS samples (every 0.5 s) to every kind "
        "in flight then."
    )
    out()
    valid = sum(sum(tally.statuses.get(n, Counter()).values()) for n in VALID)
    ok = sum(tally.statuses.get(n, Counter()).get(200, 0) for n in VALID)
    out(
        f"valid requests: {valid:,} ({ok:,} answered 200, all checked against closed forms); "
        f"wrong: {sum(tally.wrong.values())}; 5xx other than 503/507: {sum(r[4] for r in rows)}; "
        f"client-side exceptions: {sum(tally.errors.values())}"
        + (f" ({dict(tally.errors.most_common(5))})" if tally.errors else "")
    )
    out(
        f"/health probes (1 s timeout, every 0.25 s): {tally.probes:,}, missed: {len(tally.missed)}"
        + (f" ({dict(Counter(tally.missed))})" if tally.missed else "")
    )
    mib = [(t, b / 2**20) for t, b, _ in tally.samples if b]
    if mib:
        first = [m for t, m in mib if 10 <= t <= 70] or [mib[0][1]]
        last = [m for t, m in mib if t >= mib[-1][0] - 60] or [mib[-1][1]]
        f_med, l_med = float(np.median(first)), float(np.median(last))
        flat = l_med - f_med <= max(0.15 * f_med, 64)  # a leak grows; falling is no leak
        spans = [(lo, lo + 30) for lo in range(0, int(mib[-1][0]) + 1, 30)]
        parts = []
        for lo, hi in spans:
            got = [m for t, m in mib if lo <= t < hi]
            if got:
                parts.append(f"{lo}-{hi} s {np.median(got):.0f}/{max(got):.0f}")
        out("server RSS by 30 s (median/peak MiB): " + ", ".join(parts))
        out(
            f"server RSS (MiB): start {mib[0][1]:.0f}, first minute median {f_med:.0f}, "
            f"last minute median {l_med:.0f}, peak {max(m for _, m in mib):.0f}, "
            f"end {mib[-1][1]:.0f}: {'flat (no growth)' if flat else 'GROWING'}; "
            f"server alive: {alive}" + ("; KILLED by the RSS guard" if killed else "")
        )


if __name__ == "__main__":
    sys.exit(main())
