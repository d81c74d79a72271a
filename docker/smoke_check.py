"""Smoke check of the running container, from the host.

Run by ``make docker-test`` (and CI) through ``docker/oci/build-and-run.sh``, which
builds docker/Dockerfile, starts it and sets

    DX_URL        http://127.0.0.1:PORT of the healthy container
    DX_CONTAINER  the container's name, for ``podman restart/stop/start/exec/logs``

Checks, in order:
  1. the image: size (printed), non-root user, PID 1 is ``dxserve serve``, no compilers
     or test tools inside, /data is a volume owned by the service user;
  2. GET /ready reports the JAX platform and devices;
  3. POST /gradient and /hvp with JSON and with the Python client's default (binary)
     encoding, against closed-form references;
  4. POST /functions registers an expression (and the client uploads a jax.export
     bundle, when the host has jax); ``podman restart`` with the same volume; both are
     found again and still compute;
  5. SIGTERM: slow requests in flight, ``podman stop -t 10``; every request that had
     started completes with 200 and a correct result, the container exits 0 in < 10 s;
     ``podman start`` and the registered function is still there.
Exit status 0 iff every check passed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import httpx
import numpy as np

from dxclient import Client, JaxReverse
from dxcontract import codec

URL = os.environ["DX_URL"]
CONTAINER = os.environ["DX_CONTAINER"]
PODMAN = shutil.which("podman") or "podman"
STOP_TIMEOUT = 10  # seconds podman waits after SIGTERM before SIGKILL
FAILURES: list[str] = []


# --- helpers -----------------------------------------------------------------------
def say(msg: str) -> None:
    print(f"[smoke] {msg}", flush=True)


def check(ok: bool, what: str) -> bool:
    say(("ok    " if ok else "FAIL  ") + what)
    if not ok:
        FAILURES.append(what)
    return ok


def podman(*args: str, check_rc: bool = True) -> str:
    proc = subprocess.run([PODMAN, *args], capture_output=True, text=True)
    if check_rc and proc.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)} -> {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def in_container(*cmd: str) -> str:
    return podman("exec", CONTAINER, *cmd, check_rc=False)


def wait_healthy(timeout: float = 120.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if httpx.get(f"{URL}/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"container not healthy after {timeout} s:\n{podman('logs', CONTAINER)[-3000:]}")


def post_json(path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{URL}{path}", json=body, timeout=120)


def close(a, b, rtol: float = 1e-6, atol: float = 1e-8) -> bool:
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=rtol, atol=atol))


# --- closed-form references ----------------------------------------------------------
def rosenbrock_grad(x: np.ndarray) -> np.ndarray:
    g = np.zeros_like(x)
    d = x[1:] - x[:-1] ** 2
    g[:-1] += -400.0 * x[:-1] * d - 2.0 * (1.0 - x[:-1])
    g[1:] += 200.0 * d
    return g


def rosenbrock_hess(x: np.ndarray) -> np.ndarray:
    n = x.size
    h = np.zeros((n, n))
    i = np.arange(n - 1)
    h[i, i] += 1200.0 * x[:-1] ** 2 - 400.0 * x[1:] + 2.0
    h[i + 1, i + 1] += 200.0
    h[i, i + 1] = h[i + 1, i] = -400.0 * x[:-1]
    return h


def sin_cumsum_jac(x: np.ndarray) -> np.ndarray:
    """d/dx of sin(x) * cumsum(x)."""
    n = x.size
    jac = np.tril(np.repeat(np.sin(x)[:, None], n, axis=1))
    jac[np.diag_indices(n)] += np.cos(x) * np.cumsum(x)
    return jac


# --- 1. the image ------------------------------------------------------------------------
def check_image() -> None:
    image_id = podman("inspect", "-f", "{{.Image}}", CONTAINER)
    size = int(podman("image", "inspect", "-f", "{{.Size}}", image_id))
    say(f"image size: {size} bytes ({size / 2**20:.0f} MiB)")
    check(size < 1500 * 2**20, f"image size {size / 2**20:.0f} MiB < 1500 MiB")

    uid = in_container("id", "-u")
    check(uid not in ("", "0"), f"runs as a non-root user (uid {uid})")
    pid1 = in_container("cat", "/proc/1/cmdline").replace("\x00", " ").strip()
    check("dxserve serve" in pid1, f"PID 1 is the server ({pid1!r})")

    tools = in_container("sh", "-c", "for t in gcc cc c++ g++ clang make ld; do command -v $t; done")
    check(tools == "", f"no compilers/build tools in the image ({tools or 'none found'})")
    py_tools = in_container(
        "python", "-c",
        "import importlib.util as u; print(' '.join(m for m in "
        "('pytest', 'hypothesis', 'ruff', 'pip_audit') if u.find_spec(m)))",
    )
    check(py_tools == "", f"no test tools installed ({py_tools or 'none found'})")
    driver = in_container("python", "-c", "import psycopg; print(psycopg.__version__)")
    check(bool(re.fullmatch(r"3\.\d+\.\d+.*", driver)),
          f"the PostgreSQL driver for a postgresql:// store is installed (psycopg {driver})")
    sources = in_container("sh", "-c", "ls -d /tests /app/tests /tmp/src /tmp/deps 2>/dev/null")
    check(sources == "", "no tests or build leftovers in the image")

    mounts = json.loads(podman("inspect", "-f", "{{json .Mounts}}", CONTAINER))
    check(any(m.get("Destination") == "/data" for m in mounts), "/data is a volume")
    owner = in_container("stat", "-c", "%u", "/data")
    check(owner == uid, f"/data owned by the service user (uid {owner})")

    health = podman("inspect", "-f", "{{json .Config.Healthcheck}}", CONTAINER, check_rc=False)
    if health in ("", "null", "<nil>", "{}"):
        say("note  image carries no HEALTHCHECK (OCI format drops it; build with "
            "BUILDAH_FORMAT=docker, as `make docker-test` does)")
    else:
        check("/health" in health, f"HEALTHCHECK probes /health: {health}")
        probe = subprocess.run(
            [PODMAN, "exec", CONTAINER, *json.loads(health)["Test"][1:]],
            capture_output=True, text=True,
        )
        check(probe.returncode == 0, "the HEALTHCHECK command succeeds inside the container")


# --- 2.-3. computations ------------------------------------------------------------------------
def check_ready() -> dict:
    ready = httpx.get(f"{URL}/ready", timeout=30).json()
    say(f"/ready: platform={ready.get('platform')} devices={ready.get('devices')} "
        f"jax={ready.get('jax_version')} functions={ready.get('functions')}")
    check(ready.get("status") == "ready" and bool(ready.get("devices")) and
          bool(ready.get("platform")), "GET /ready lists the JAX platform and devices")
    return ready


def check_json_operators() -> None:
    x = np.array([1.0, 2.0, 3.0, -0.5])
    r = post_json("/gradient", {"function": "rosenbrock", "backend": "jax-reverse", "x": x.tolist()})
    check(r.status_code == 200 and r.headers["content-type"].startswith(codec.JSON_TYPE)
          and close(r.json()["gradient"], rosenbrock_grad(x)),
          f"JSON POST /gradient rosenbrock ({r.status_code})")

    t1, t2 = np.array([1.0, 0.0, -1.0, 2.0]), np.array([0.5, 0.5, 0.5, 0.5])
    h = rosenbrock_hess(x)
    for backend in ("jax-reverse",
                    {"type": "second-order", "outer": {"type": "jax-forward"},
                     "inner": {"type": "jax-reverse"}}):
        r = post_json("/hvp", {"function": "rosenbrock", "backend": backend, "x": x.tolist(),
                               "tangents": [t1.tolist(), t2.tolist()]})
        hvps = r.json().get("hvps") if r.status_code == 200 else None
        check(hvps is not None and len(hvps) == 2 and close(hvps[0], h @ t1)
              and close(hvps[1], h @ t2), f"JSON POST /hvp rosenbrock, backend {json.dumps(backend)} "
              f"({r.status_code})")

    r2 = post_json("/gradient", {"function": "no-such-function", "backend": "auto", "x": [1.0]})
    check(r2.status_code == 404 and r2.headers["content-type"].startswith("application/problem+json"),
          f"unknown function -> 404 problem+json ({r2.status_code})")


def client_with_wire_log() -> tuple[Client, list[str]]:
    client = Client(URL, timeout=120)
    seen: list[str] = []
    client.http.event_hooks = {
        "request": [lambda req: seen.append(req.headers.get("content-type", ""))
                    if req.method == "POST" else None],
        "response": [lambda resp: seen.append("<- " + resp.headers.get("content-type", ""))
                     if resp.request.method == "POST" else None],
    }
    return client, seen


def check_client_operators() -> None:
    client, seen = client_with_wire_log()
    check(client.encoding == "binary", f"the client's default encoding is {client.encoding!r}")
    rng = np.random.default_rng(0)
    x = rng.normal(size=12)
    g = client.gradient("rosenbrock", JaxReverse(), x)
    check(close(g, rosenbrock_grad(x)), "client (binary) gradient rosenbrock")
    ts = (rng.normal(size=12), rng.normal(size=12))
    hv1, hv2 = client.hvp("rosenbrock", "auto", x, ts)
    h = rosenbrock_hess(x)
    check(close(hv1, h @ ts[0]) and close(hv2, h @ ts[1]), "client (binary) hvp rosenbrock")
    check(bool(seen) and all(codec.BINARY_TYPE in s for s in seen),
          f"requests and responses used {codec.BINARY_TYPE} ({sorted(set(seen))})")
    client.close()


# --- 4. registry across a restart ------------------------------------------------------------
SQ = {"name": "sq", "expression": "jnp.sum(x**2)", "args": ["x"],
      "description": "registered by the container smoke check"}


def check_sq(when: str) -> None:
    r = httpx.get(f"{URL}/functions/sq", timeout=30)
    check(r.status_code == 200 and r.json().get("name") == "sq",
          f"{when}: GET /functions/sq ({r.status_code})")
    x = np.array([1.0, -2.0, 3.5])
    r = post_json("/gradient", {"function": "sq", "backend": "jax-reverse", "x": x.tolist()})
    check(r.status_code == 200 and close(r.json()["gradient"], 2 * x),
          f"{when}: JSON gradient of sq ({r.status_code})")
    with Client(URL, timeout=120) as client:
        (hv,) = client.hvp("sq", "auto", x, (np.ones(3),))
        check(close(hv, 2 * np.ones(3)), f"{when}: client (binary) hvp of sq")


def cube_sum(x):  # uploaded as a jax.export bundle by the client
    return (x**3).sum()


def check_export(when: str) -> None:
    x = np.array([0.5, -1.0, 2.0])
    try:
        with Client(URL, timeout=120) as client:
            if when == "registered":
                client.register(cube_sum, x, name="cube_sum", description="smoke-check export")
            g = client.gradient("cube_sum", "auto", x)
            (hv,) = client.hvp("cube_sum", "auto", x, (np.ones(3),))
    except Exception as exc:  # noqa: BLE001
        check(False, f"{when}: uploaded export cube_sum: {exc!r}")
        return
    check(close(g, 3 * x**2) and close(hv, 6 * x), f"{when}: uploaded export cube_sum computes")


def check_register_and_restart() -> None:
    try:
        import jax

        jax.config.update("jax_enable_x64", True)
        exports = True
    except ImportError:
        say("note  no jax on the host: skipping the uploaded-export check")
        exports = False
    if exports:
        check_export("registered")
    r = post_json("/functions", SQ)
    check(r.status_code in (200, 201), f"POST /functions registers sq ({r.status_code} {r.text[:200]})")
    check_sq("registered")
    # the store is SQLite on the volume (/data/store/store.db); ask it with the image's Python
    stored = in_container(
        "python", "-c",
        "import sqlite3; print(*(r[0] for r in sqlite3.connect('/data/store/store.db')"
        ".execute('SELECT name FROM functions')))",
    )
    check("sq" in stored.split(), f"sq is on the volume (/data/store/store.db: {stored.split()})")

    start = time.monotonic()
    podman("restart", CONTAINER)
    restarted = time.monotonic() - start
    healthy = wait_healthy()
    say(f"podman restart took {restarted:.1f} s; healthy {healthy:.1f} s later")
    check_sq("after podman restart")
    if exports:
        check_export("after podman restart")
    cache = in_container("sh", "-c", "ls /data/jax-cache | wc -l")
    check(cache.isdigit() and int(cache) > 0,
          f"JAX compilation cache is on the volume (/data/jax-cache: {cache} entries)")


# --- 5. SIGTERM with requests in flight ------------------------------------------------------------
def slow_jacobian(n: int, out: dict) -> None:
    x = np.linspace(0.1, 1.0, n)
    try:
        with Client(URL, timeout=120) as client:
            out["started"] = time.monotonic()
            jac = client.jacobian("sin_cumsum", "finite-differences", x)
        out["done"] = time.monotonic()
        out["ok"] = jac.shape == (n, n) and close(jac, sin_cumsum_jac(x), rtol=1e-4, atol=1e-6)
        out["shape"] = jac.shape
    except Exception as exc:  # noqa: BLE001
        out["done"] = time.monotonic()
        out["error"] = repr(exc)


def queued_json(out: dict) -> None:
    x = np.linspace(-1.0, 1.0, 33)
    try:
        out["started"] = time.monotonic()
        r = post_json("/gradient", {"function": "rosenbrock", "backend": "jax-reverse",
                                    "x": x.tolist()})
        out["done"] = time.monotonic()
        out["ok"] = r.status_code == 200 and close(r.json()["gradient"], rosenbrock_grad(x))
        out["status"] = r.status_code
    except Exception as exc:  # noqa: BLE001
        out["done"] = time.monotonic()
        out["error"] = repr(exc)


def queued() -> int:
    try:
        return int(httpx.get(f"{URL}/ready", timeout=5).json().get("queued", 0))
    except httpx.HTTPError:
        return -1


def sigterm_attempt(n: int) -> bool | None:
    """True/False: the verdict; None: the requests ended before SIGTERM (retry bigger)."""
    slow, fast = {}, {}
    a = threading.Thread(target=slow_jacobian, args=(n, slow))
    a.start()
    deadline = time.monotonic() + 30
    while queued() < 1 and "done" not in slow and time.monotonic() < deadline:
        time.sleep(0.01)
    b = threading.Thread(target=queued_json, args=(fast,))  # queued behind the slow one
    b.start()
    while queued() < 2 and "done" not in slow and time.monotonic() < deadline:
        time.sleep(0.01)
    signalled = time.monotonic()
    stop = subprocess.run([PODMAN, "stop", "-t", str(STOP_TIMEOUT), CONTAINER],
                          capture_output=True, text=True)
    stopped = time.monotonic() - signalled
    a.join(60)
    b.join(60)
    # One pipe for both streams keeps the log's order (uvicorn's access log is stdout).
    text = subprocess.run([PODMAN, "logs", CONTAINER], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True).stdout
    shutdown_at = text.rfind("Shutting down")
    tail = text[shutdown_at:] if shutdown_at >= 0 else ""
    in_flight = '"POST /jacobian' in tail
    if not in_flight:
        say(f"n={n}: the jacobian finished before SIGTERM arrived; trying a bigger one")
        podman("start", CONTAINER)
        wait_healthy()
        return None
    exit_code = podman("inspect", "-f", "{{.State.ExitCode}}", CONTAINER)
    say(f"SIGTERM with a {n}x{n} finite-difference jacobian in flight: podman stop took "
        f"{stopped:.2f} s; jacobian answered {slow.get('done', signalled) - signalled:+.2f} s "
        f"after the stop began, the queued JSON gradient "
        f"{fast.get('done', signalled) - signalled:+.2f} s; exit code {exit_code}")
    ok = check(stop.returncode == 0, "podman stop succeeded"
               + (f" ({stop.stderr.strip()})" if stop.returncode else ""))
    ok &= check(stopped < STOP_TIMEOUT, f"container stopped within {STOP_TIMEOUT} s of SIGTERM "
                f"({stopped:.2f} s)")
    ok &= check(exit_code == "0", f"server exited cleanly (exit code {exit_code}, not SIGKILL)")
    ok &= check(bool(slow.get("ok")), f"in-flight jacobian completed with 200 and the right values "
                f"({slow.get('shape') or slow.get('error')})")
    ok &= check(bool(fast.get("ok")), f"queued JSON gradient completed with 200 "
                f"({fast.get('status') or fast.get('error')})")
    ok &= check(re.search(r"Finished server process", tail) is not None,
                "uvicorn logged a graceful shutdown")
    return ok


def check_sigterm() -> None:
    for n in (1500, 2500, 3500):
        verdict = sigterm_attempt(n)
        if verdict is not None:
            break
    else:
        check(False, "could not get a request in flight when SIGTERM arrived")
        return
    start = time.monotonic()
    podman("start", CONTAINER)
    say(f"podman start; healthy after {time.monotonic() - start + wait_healthy():.1f} s")
    check_sq("after SIGTERM and podman start")


def main() -> int:
    say(f"container {CONTAINER} at {URL}")
    wait_healthy()
    steps = [check_image, check_ready, check_json_operators, check_client_operators,
             check_register_and_restart, check_sigterm]
    for step in steps:
        say(f"--- {step.__name__}")
        try:
            step()
        except Exception as exc:  # noqa: BLE001
            check(False, f"{step.__name__} raised {exc!r}")
    if FAILURES:
        say(f"{len(FAILURES)} check(s) failed:")
        for f in FAILURES:
            say(f"  - {f}")
        print(subprocess.run([PODMAN, "logs", "--tail", "40", CONTAINER], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True).stdout)
        return 1
    say("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
