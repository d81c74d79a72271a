"""Mutated export bundles against a live server: it never dies and never answers 5xx.

Each mutation (a byte flip, a truncated artifact, a 32-bit overwrite) is made inside
one artifact's serialized ``Exported``, and the bundle is then repacked with every
artifact's length, offset and sha256 recomputed, so the container checks pass and
the bytes reach JAX's native deserializer (in the export gate's child process).

``DXSERVE_FUZZ_COUNT`` sets how many mutations the default test posts (150);
the ``slow`` test posts ``DXSERVE_FUZZ_SLOW_COUNT`` (1000). Each prints its counts.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import json
import os
import random
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

from dxclient.export import ARTIFACTS, MAGIC, export_function, split_bundle

FAST_COUNT = int(os.environ.get("DXSERVE_FUZZ_COUNT", "150"))
SLOW_COUNT = int(os.environ.get("DXSERVE_FUZZ_SLOW_COUNT", "1000"))
CHECK_EVERY = 10  # /health and a gradient after every 10th mutation and at the end
X = [0.5, -1.2, 0.8]


def rosenbrock(x):
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def pytree_loss(p, X):
    return jnp.sum(jnp.tanh(X @ p["w"] + p["b"]) ** 2)


def base_bundles() -> list[bytes]:
    """Valid bundles to mutate: a vector function and a pytree one with a context."""
    return [
        export_function(rosenbrock, np.zeros(3)),
        export_function(pytree_loss, {"w": np.zeros((3, 2)), "b": np.zeros(2)}, np.ones((4, 3))),
    ]


def repack(manifest: dict, blobs: dict[str, bytes]) -> bytes:
    """A bundle of these blobs with offsets, lengths and sha256s recomputed."""
    artifacts, body, offset = {}, bytearray(), 0
    for name in ARTIFACTS:
        blob = blobs[name]
        artifacts[name] = {
            "offset": offset, "length": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
        }  # fmt: skip
        body += blob
        offset += len(blob)
    head = json.dumps(dict(manifest, artifacts=artifacts), sort_keys=True,
                      separators=(",", ":")).encode()  # fmt: skip
    return MAGIC + struct.pack(">I", len(head)) + head + bytes(body)


_WORDS = (0, 0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, 0x40000000, 1, 0xFFFF)


def mutate(bundle: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One mutation of one artifact, checksums recomputed: ``(kind, bundle)``."""
    manifest, blobs = split_bundle(bundle)
    blobs = dict(blobs)
    art = rng.choice(ARTIFACTS)
    blob = bytearray(blobs[art])
    kind = rng.choice(("flip", "flip", "truncate", "word32"))
    if kind == "flip":
        for _ in range(rng.choice((1, 1, 2, 4))):
            blob[rng.randrange(len(blob))] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        blob = blob[: rng.randrange(1, len(blob))]
    else:
        at = rng.randrange(len(blob) - 3)
        word = rng.choice(_WORDS) if rng.random() < 0.5 else rng.getrandbits(32)
        blob[at : at + 4] = struct.pack("<I", word)
    blobs[art] = bytes(blob)
    return kind, repack(manifest, blobs)


def outcome(r: httpx.Response) -> str:
    """A short label for an answer: ``accepted`` or the problem's type and the cause."""
    if r.status_code < 300:
        return "accepted"
    detail = r.json().get("detail", "")
    for word in ("crashed", "timed out", "CPU-time", "memory limit", "without an answer",
                 "failed when compiled", "cannot be read", "cannot inspect", "signature"):  # fmt: skip
        if word in detail:
            return f"{r.status_code} {word}"
    print(f"\n  other refusal: {detail[:300]}")
    return f"{r.status_code} other"


def check_alive(client: httpx.Client, server) -> None:
    assert server.proc.poll() is None, f"server died:\n{server.output()}"
    assert client.get("/health").status_code == 200
    r = client.post("/gradient", json={"function": "rosenbrock", "backend": "jax-reverse", "x": X})
    assert r.status_code == 200, r.text
    x1, x2, x3 = X  # rosenbrock's gradient, by hand
    want = [-400 * x1 * (x2 - x1**2) - 2 * (1 - x1),
            200 * (x2 - x1**2) - 400 * x2 * (x3 - x2**2) - 2 * (1 - x2),
            200 * (x3 - x2**2)]  # fmt: skip
    np.testing.assert_allclose(r.json()["gradient"], want, rtol=1e-12)


def fuzz(server, count: int, seed: int) -> collections.Counter:
    """Post ``count`` mutations; assert the server's promises; return the outcome counts."""
    rng = random.Random(seed)
    bases = base_bundles()
    counts: collections.Counter = collections.Counter()
    started = time.monotonic()
    with httpx.Client(base_url=server.url) as client:
        check_alive(client, server)
        for i in range(count):
            kind, bundle = mutate(rng.choice(bases), rng)
            body = {"name": "fuzzed", "export": base64.b64encode(bundle).decode(), "replace": True}
            try:
                r = client.post("/functions", json=body)
            except httpx.TransportError as e:
                pytest.fail(f"mutation {i} ({kind}): no answer ({e}):\n{server.output()}")
            assert r.status_code < 500, f"mutation {i} ({kind}): {r.status_code} {r.text}"
            if r.status_code >= 400:
                assert r.headers["content-type"].startswith("application/problem+json")
                problem = r.json()
                assert problem["status"] == r.status_code
                if r.status_code == 422:
                    assert problem["field"] == "export", problem
            counts[outcome(r)] += 1
            if i % CHECK_EVERY == CHECK_EVERY - 1:
                check_alive(client, server)
        check_alive(client, server)
    counts["seconds"] = round(time.monotonic() - started)
    print(f"\nexport fuzz: {count} mutations, seed {seed}: {dict(counts)}")
    return counts


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    from tests.conftest import start_server, stop_server

    # A short gate timeout: a few mutations make a check run long (a huge shape, say),
    # and a legitimate check of these small bundles takes well under a second.
    srv = start_server(
        tmp_path_factory.mktemp("export-fuzz"),
        modules=("dxserve.examples",),
        env={"DXSERVE_EXPORT_GATE_TIMEOUT": os.environ.get("DXSERVE_FUZZ_GATE_TIMEOUT", "5")},
    )
    yield srv
    stop_server(srv)


@pytest.mark.slow
def test_mutated_bundles_never_crash_the_server(fuzz_server):
    counts = fuzz(fuzz_server, FAST_COUNT, seed=12)
    assert sum(v for k, v in counts.items() if k != "seconds") == FAST_COUNT


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_many_mutated_bundles_never_crash_the_server(fuzz_server):
    counts = fuzz(fuzz_server, SLOW_COUNT, seed=1012)
    assert sum(v for k, v in counts.items() if k != "seconds") == SLOW_COUNT


# --- a bundle that crashes JAX's native reader -----------------------------------------------
SEGFAULT_BUNDLE = Path(__file__).parents[1] / "data" / "export-segfault.bundle"


def _crashes_outside_the_gate(bundle: Path) -> bool:
    """Whether plain ``load_exported`` (no gate) kills its process on this bundle."""
    code = (
        "import sys, jax; jax.config.update('jax_enable_x64', True)\n"
        "from dxserve.frameworks.jax.exported import load_exported\n"
        "try:\n    load_exported(open(sys.argv[1], 'rb').read())\n"
        "except Exception:\n    pass\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(bundle)], capture_output=True,
                          timeout=120)  # fmt: skip
    return proc.returncode < 0


def test_bundle_that_segfaults_jax_is_a_422_and_the_server_keeps_serving(fuzz_server):
    # One mutation from the fuzz run above: a single bit flip in the primal's StableHLO
    # bytecode that makes JAX 0.10's deserializer segfault, every time.
    if not _crashes_outside_the_gate(SEGFAULT_BUNDLE):
        pytest.skip("this JAX no longer crashes on the recorded bundle")
    body = {"name": "segfault", "export": base64.b64encode(SEGFAULT_BUNDLE.read_bytes()).decode()}
    with httpx.Client(base_url=fuzz_server.url) as client:
        r = client.post("/functions", json=body)
        assert r.status_code == 422, r.text
        assert r.headers["content-type"].startswith("application/problem+json")
        problem = r.json()
        assert problem["field"] == "export" and "crashed" in problem["detail"], problem
        check_alive(client, fuzz_server)
        assert "segfault" not in {f["name"] for f in client.get("/functions").json()["functions"]}
        # and a good bundle is still accepted and served
        good = base64.b64encode(base_bundles()[0]).decode()
        r = client.post("/functions", json={"name": "after_segfault", "export": good})
        assert r.status_code in (200, 201), r.text
        r = client.post("/gradient", json={"function": "after_segfault", "x": X})
        assert r.status_code == 200, r.text
