"""A soak: many clients for minutes, a share of them hostile, against one real server.

    .venv/bin/python bench/soak.py                   # 16 clients, 180 s, 10% hostile
    .venv/bin/python bench/soak.py --seconds 30      # a short one

Starts ``dxserve serve`` (example functions, a fresh store, the memory limits below) on
127.0.0.1 and stops it by PID. ``--clients`` threads each loop for ``--seconds``: with
probability ``--hostile`` a hostile request (drawn from ``ATTACKS``), else a valid one
(drawn from ``VALID``) whose answer is checked against its closed form. Every answer is
counted by kind and status; a valid answer that is not 200 (503 with Retry-After
excepted, counted apart) or whose values are wrong is an error, as is any 5xx but 503.
The server's RSS is sampled every second.

Prints (and saves as ``results/soak-cpu.md``) a table per request kind, and RSS at the
start, after the first minute, the peak and at the end: "flat" means the last minute's
median is within 15% (or 64 MiB) of the first minute's.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
from _common import PYTHON, Server, Tee, free_port, machine_line, markdown_table

JSON = {"content-type": "application/json"}
#: the server's limits for the soak: small enough that attacks meet them
SERVER_ENV = {
    "DXSERVE_MAX_INFLIGHT_BYTES": str(256 * 2**20),
    "DXSERVE_WRITE_TIMEOUT": "5",
    "DXSERVE_HEADER_TIMEOUT": "5",
    "DXSERVE_BODY_TIMEOUT": "10",
    "DXSERVE_REQUEST_TIMEOUT": "60",
}


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
    return r.status_code, r.status_code != 200 or _close(r.json()["gradient"], rosenbrock_gradient(x))


def valid_hvp(http: httpx.Client, rng: random.Random) -> tuple[int, bool]:
    x = np.asarray([rng.uniform(-2, 2) for _ in range(10)])
    t = np.asarray([rng.uniform(-1, 1) for _ in range(10)])
    r = http.post("/hvp", json={"function": "rosenbrock", "x": x.tolist(), "tangents": [t.tolist()]})
    ok = r.status_code != 200 or _close(r.json()["hvps"][0], rosenbrock_hessian(x) @ t)
    return r.status_code, ok


def valid_hessian(http: httpx.Client, rng: random.Random) -> tuple[int, bool]:
    x = np.asarray([rng.uniform(-2, 2) for _ in range(rng.choice((5, 40)))])
    r = http.post("/hessian", json={"function": "rosenbrock", "x": x.tolist()})
    return r.status_code, r.status_code != 200 or _close(r.json()["hessian"], rosenbrock_hessian(x))


def valid_jacobian(http: httpx.Client, rng: random.Random) -> tuple[int, bool]:
    x = np.asarray([rng.uniform(-2, 2) for _ in range(20)])
    r = http.post("/jacobian", json={"function": "sin_cumsum", "backend": "jax-forward", "x": x.tolist()})
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
        dense[row, indices[indptr[row]:indptr[row + 1]]] = data[indptr[row]:indptr[row + 1]]
    return r.status_code, _close(dense, rosenbrock_hessian(x))


VALID: dict[str, Callable[[httpx.Client, random.Random], tuple[int, bool]]] = {
    "gradient": valid_gradient, "hvp": valid_hvp, "hessian": valid_hessian,
    "jacobian": valid_jacobian, "sparse hessian": valid_sparse,
}


# --------------------------------------------------------------------------- hostile


def _raw(url: str, data: bytes, read: bool = True, hold: float = 0.0) -> int:
    """Send ``data`` on a new connection; the answer's status (0 if none)."""
    host, port = url.rsplit("//", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
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
    body = rng.choice([b"{", b"[1,2]", b'{"function": 1, "x": []}', b'{"x": "a"}',
                       b'{"function": "rosenbrock", "x": [1, "a"]}', bytes(rng.randbytes(64))])
    return http.post("/gradient", content=body, headers=JSON).status_code


def attack_huge_shape(http: httpx.Client, rng: random.Random) -> int:
    x = {"__ndarray__": "", "dtype": "float64", "shape": [0, 2**40]}
    return http.post("/hessian", json={"function": "rosenbrock", "x": x}).status_code


def attack_bad_dtype(http: httpx.Client, rng: random.Random) -> int:
    x = {"__ndarray__": "AAAA", "dtype": rng.choice(["object", "<U4", "float128", "V8"]), "shape": [1]}
    return http.post("/gradient", json={"function": "rosenbrock", "x": x}).status_code


def attack_quartic(http: httpx.Client, rng: random.Random) -> int:
    x = [0.5] * 20_000  # a dense Hessian of 20,000^2: refused by the result limit
    return http.post("/hessian", json={"function": "rosenbrock", "x": x}).status_code


def attack_sparse_detection(http: httpx.Client, rng: random.Random) -> int:
    x = [0.5] * rng.choice((3000, 8000))  # a dense pattern: refused within the budgets
    return http.post("/sparsity", json={"function": "softmax", "backend": "sparse", "x": x}).status_code


def attack_tangent_flood(http: httpx.Client, rng: random.Random) -> int:
    body = {"function": "rosenbrock", "x": [1.0, 2.0, 3.0], "tangents": [[1.0, 1.0, 1.0]] * 16_000}
    return http.post("/hvp", json=body).status_code


def attack_leaf_flood(http: httpx.Client, rng: random.Random) -> int:
    x = {f"k{i}": [1.0] for i in range(20_000)}
    return http.post("/gradient", json={"function": "rosenbrock", "x": x}).status_code


def attack_bad_pattern(http: httpx.Client, rng: random.Random) -> int:
    sparsity = {"format": "csr", "shape": [3, 3], "indptr": [0, 2**70, 1, 1], "indices": [1e300]}
    backend = {"type": "sparse", "sparsity": sparsity}
    return http.post("/jacobian", json={"function": "sin_cumsum", "backend": backend,
                                        "x": [1.0, 2.0, 3.0]}).status_code


def attack_big_header(http: httpx.Client, rng: random.Random) -> int:
    data = b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 80_000 + b"\r\n\r\n"
    return _raw(str(http.base_url), data)


def attack_partial_head(http: httpx.Client, rng: random.Random) -> int:
    return _raw(str(http.base_url), b"POST /gradient HTTP/1.1\r\nhost: x\r\n", read=False, hold=0.5)


def attack_unread_answer(http: httpx.Client, rng: random.Random) -> int:
    body = json.dumps({"function": "rosenbrock", "x": [0.5] * 600}).encode()
    data = (b"POST /hessian HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"accept: application/vnd.dxserve.binary\r\ncontent-length: %d\r\n\r\n" % len(body)) + body
    return _raw(str(http.base_url), data, read=False, hold=0.2)


def attack_unread_stream(http: httpx.Client, rng: random.Random) -> int:
    body = json.dumps({"function": "rosenbrock", "x": [0.5] * 600}).encode()
    data = (b"POST /hessian HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"accept: text/event-stream\r\ncontent-length: %d\r\n\r\n" % len(body)) + body
    return _raw(str(http.base_url), data, read=False, hold=0.2)


def attack_oversized_body(http: httpx.Client, rng: random.Random) -> int:
    head = (b"POST /gradient HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 999999999999\r\n\r\n{")
    return _raw(str(http.base_url), head)


def attack_expression(http: httpx.Client, rng: random.Random) -> int:
    body = {"name": f"evil{rng.randrange(10**6)}", "expression": "__import__('os').system('id')"}
    return http.post("/functions", json=body).status_code


ATTACKS: dict[str, Callable[[httpx.Client, random.Random], int]] = {
    "malformed body": attack_malformed, "zero-size huge shape": attack_huge_shape,
    "bad dtype": attack_bad_dtype, "huge dense Hessian": attack_quartic,
    "sparse detection (softmax)": attack_sparse_detection, "16,000 tangents": attack_tangent_flood,
    "20,000 pytree leaves": attack_leaf_flood, "malformed pattern": attack_bad_pattern,
    "80 KB header": attack_big_header, "partial head": attack_partial_head,
    "unread answer": attack_unread_answer, "unread stream": attack_unread_stream,
    "oversized body": attack_oversized_body, "sandbox escape": attack_expression,
}


# --------------------------------------------------------------------------- the run


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--hostile", type=float, default=0.10)
    parser.add_argument("--save", default="soak-cpu.md")
    parser.add_argument("--skip", action="append", default=[], metavar="ATTACK",
                        help="leave out an attack (by the start of its name); repeatable")
    args = parser.parse_args(argv)
    for skip in args.skip:
        for name in [n for n in ATTACKS if n.startswith(skip)]:
            del ATTACKS[name]
    out = Tee()
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        server = Server(
            [PYTHON, "-m", "dxserve.cli", "serve", "--port", str(port), "--store", f"{tmp}/store",
             "--compilation-cache", "", "--log-level", "warning"],
            port, "/health", Path(tmp) / "server.log", env=SERVER_ENV,
        )
        try:
            with httpx.Client(base_url=server.url, timeout=120) as http:  # compile first
                for fn in VALID.values():
                    fn(http, random.Random(0))
            statuses: dict[str, Counter] = defaultdict(Counter)
            wrong: Counter = Counter()
            errors: Counter = Counter()
            samples: list[tuple[float, int]] = []
            lock = threading.Lock()
            stop = time.monotonic() + args.seconds

            def client(seed: int) -> None:
                rng = random.Random(seed)
                with httpx.Client(base_url=server.url, timeout=120) as http:
                    while time.monotonic() < stop:
                        try:
                            if rng.random() < args.hostile:
                                name = rng.choice(list(ATTACKS))
                                status, ok = ATTACKS[name](http, rng), True
                            else:
                                name = rng.choice(list(VALID))
                                status, ok = VALID[name](http, rng)
                        except Exception as exc:  # noqa: BLE001 - counted, the soak goes on
                            with lock:
                                errors[f"{name}: {type(exc).__name__}"] += 1
                            continue
                        with lock:
                            statuses[name][status] += 1
                            if not ok:
                                wrong[name] += 1

            threads = [threading.Thread(target=client, args=(i,), daemon=True)
                       for i in range(args.clients)]
            start = time.monotonic()
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                samples.append((time.monotonic() - start, rss(server.proc.pid)))
                time.sleep(1.0)
            alive = server.proc.poll() is None
        finally:
            server.stop()
    report(out, args, statuses, wrong, errors, samples, alive)
    if args.save:
        print(f"saved {out.save(args.save)}")
    bad = sum(wrong.values()) + sum(
        n for c in statuses.values() for s, n in c.items() if s >= 500 and s != 503
    )
    return 0 if alive and not bad else 1


def report(out: Tee, args: argparse.Namespace, statuses: dict, wrong: Counter, errors: Counter,
           samples: list[tuple[float, int]], alive: bool) -> None:
    out(f"# Soak: {args.clients} clients, {args.seconds:.0f} s, {args.hostile:.0%} hostile")
    out()
    out(f"{machine_line()}; server limits: "
        + ", ".join(f"{k}={v}" for k, v in SERVER_ENV.items()))
    out()
    rows = []
    for name in [*VALID, *ATTACKS]:
        counts = statuses.get(name, Counter())
        total = sum(counts.values())
        five = sum(n for s, n in counts.items() if s >= 500 and s != 503)
        shown = ", ".join(f"{s}: {n}" for s, n in sorted(counts.items()))
        kind = "valid" if name in VALID else "hostile"
        rows.append([kind, name, total, shown or "-", five, wrong.get(name, 0) if kind == "valid" else "-"])
    out(markdown_table(["kind", "request", "sent", "statuses", "5xx (not 503)", "wrong"], rows))
    out()
    valid = sum(sum(statuses.get(n, Counter()).values()) for n in VALID)
    ok = sum(statuses.get(n, Counter()).get(200, 0) for n in VALID)
    out(f"valid requests: {valid:,} ({ok:,} answered 200, all checked against closed forms); "
        f"wrong: {sum(wrong.values())}; 5xx other than 503: "
        f"{sum(r[4] for r in rows)}; client-side exceptions: {sum(errors.values())}"
        + (f" ({dict(errors.most_common(5))})" if errors else ""))
    mib = [(t, b / 2**20) for t, b in samples]
    if mib:
        first = [m for t, m in mib if 10 <= t <= 70] or [mib[0][1]]
        last = [m for t, m in mib if t >= mib[-1][0] - 60] or [mib[-1][1]]
        f_med, l_med = float(np.median(first)), float(np.median(last))
        flat = abs(l_med - f_med) <= max(0.15 * f_med, 64)
        out(f"server RSS (MiB): start {mib[0][1]:.0f}, first minute median {f_med:.0f}, "
            f"last minute median {l_med:.0f}, peak {max(m for _, m in mib):.0f}, "
            f"end {mib[-1][1]:.0f}: {'flat' if flat else 'NOT flat'}; server alive: {alive}")


if __name__ == "__main__":
    sys.exit(main())
