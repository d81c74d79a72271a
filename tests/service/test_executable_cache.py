"""The persistent executable cache (``dxserve.frameworks.jax.executable_cache``).

(a) a restarted process loads its operators without running the function's Python
body and returns the same bits; an executable that JAX itself loaded from its
compilation cache is not stored (it cannot be re-serialized on CPU) and still
answers; (b) corrupt, foreign or truncated entries fall back to compiling; (c)
signatures, backends, operators and functions do not collide; closures are never
persisted; (d) the directory stays within its bound.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import dxserve
from dxserve import JaxForward, JaxReverse
from dxserve.core.preparation import prepare
from dxserve.frameworks.jax import executable_cache
from dxserve.server.registry import expression_content

REPO = Path(__file__).resolve().parents[2]

CALLS: list[int] = []


def counted_sin_sq(x):
    CALLS.append(1)
    return jnp.sum(jnp.sin(x) * x**2)


def other(x):
    return jnp.sum(jnp.cos(x))


@pytest.fixture
def cache_dir(tmp_path):
    executable_cache.configure(tmp_path / "executables")
    yield tmp_path / "executables"
    executable_cache.configure(None)


def run_op(operator, f, backend, x, tangents=None):
    x = np.asarray(x)
    tangents = None if tangents is None else tuple(np.asarray(t) for t in tangents)
    prep = prepare(operator, f, backend, x, tangents, ())
    return prep.run(operator, x, tangents, ())


def entries(directory: Path, suffix: str = executable_cache.SUFFIX) -> list[Path]:
    return sorted(directory.glob("*" + suffix))


# --- (a) a restart loads instead of tracing ------------------------------------------
SCRIPT = """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    import dxserve
    from dxserve.frameworks.jax import executable_cache as ec
    from dxserve.core.preparation import prepare

    jax.config.update("jax_compilation_cache_dir", sys.argv[1] + "/jax")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    ec.configure(sys.argv[1] + "/executables")
    CALLS = []

    def f(x):
        CALLS.append(1)
        return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)

    x = np.linspace(-1.0, 1.5, 50)
    out = {}
    for op, backend, tangents in [("gradient", "jax-reverse", None),
                                  ("hvp", "auto", (np.cos(x),))]:
        prep = prepare(op, f, backend, x, tangents, ())
        res = prep.run(op, x, tangents, ())
        out[op] = [np.asarray(r).tobytes().hex() for r in res]
    print(json.dumps({"calls": len(CALLS), "results": out, "stats": ec.stats}))
"""


def restart(tmp_path: Path) -> dict:
    script = tmp_path / "restarted.py"
    script.write_text(textwrap.dedent(SCRIPT))
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
        timeout=120, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_restarted_process_loads_without_tracing_and_same_bits(tmp_path):
    cold = restart(tmp_path)
    assert cold["calls"] >= 3  # probe + the two traced operators
    assert cold["stats"]["stored"] == 2 and cold["stats"]["loaded"] == 0

    warm = restart(tmp_path)
    assert warm["calls"] == 0  # neither probed nor traced: output spec and executable loaded
    assert warm["stats"]["loaded"] == 2 and warm["stats"]["compiled"] == 0
    assert warm["results"] == cold["results"]  # bit for bit

    # Without our entries, JAX's own cache has the programs: used, not re-stored
    # (a re-serialized copy of such an executable lacks its kernels on CPU).
    for path in entries(tmp_path / "executables"):
        path.unlink()
    again = restart(tmp_path)
    assert again["stats"]["compiled"] == 2 and again["stats"]["skipped"] == 2
    assert again["stats"]["stored"] == 0
    assert again["results"] == cold["results"]
    assert entries(tmp_path / "executables") == []


def test_in_process_reload_skips_tracing(cache_dir):
    x = np.array([0.5, -1.0, 2.0])
    first = run_op("hessian", counted_sin_sq, "auto", x)
    assert len(entries(cache_dir)) == 1 and len(entries(cache_dir, ".dxout")) == 1
    CALLS.clear()
    again = run_op("hessian", counted_sin_sq, "auto", x)  # a new prep: as after a restart
    assert CALLS == []
    for a, b in zip(first, again, strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_bfloat16_reloads_with_its_dtype(cache_dir):
    """The stored output spec names bfloat16 (its ``dtype.str`` is only "<V2")."""
    import ml_dtypes

    x = np.array([0.5, -1.0, 2.0], ml_dtypes.bfloat16)
    first = run_op("hessian", counted_sin_sq, "auto", x)
    CALLS.clear()
    again = run_op("hessian", counted_sin_sq, "auto", x)
    assert CALLS == []
    for a, b in zip(first, again, strict=True):
        assert np.asarray(b).dtype == x.dtype
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    with dxserve.float64_scope():  # as preparation keys it
        assert executable_cache.output_spec(counted_sin_sq, x, ()).dtype == x.dtype


# --- (b) bad entries ---------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty"])
def test_corrupt_entry_falls_back_to_compiling(cache_dir, damage):
    x = np.linspace(0.1, 1.0, 7)
    (want,) = run_op("gradient", counted_sin_sq, "jax-reverse", x)
    for path in entries(cache_dir) + entries(cache_dir, ".dxout"):
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[-10] ^= 0xFF
        elif damage == "truncate":
            data = data[: len(data) // 2]
        elif damage == "garbage":
            data = bytearray(b"not a cache entry at all")
        else:
            data = bytearray()
        path.write_bytes(bytes(data))
    discarded = executable_cache.stats["discarded"]
    CALLS.clear()
    (got,) = run_op("gradient", counted_sin_sq, "jax-reverse", x)
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    assert CALLS  # traced again
    assert executable_cache.stats["discarded"] == discarded + 2
    # and written back whole
    CALLS.clear()
    run_op("gradient", counted_sin_sq, "jax-reverse", x)
    assert CALLS == []


def test_entry_that_fails_to_run_is_replaced_by_a_fresh_compile(cache_dir, monkeypatch):
    """An entry that deserializes but cannot run (an XLA serialization bug) costs one
    recompile, not a failing signature."""
    x = np.linspace(0.1, 1.0, 5)
    (want,) = run_op("gradient", counted_sin_sq, "jax-reverse", x)

    def broken(*args):
        raise RuntimeError("NOT_FOUND: Function pad_add_fusion not found")

    monkeypatch.setattr(executable_cache, "load", lambda key: broken)
    discarded = executable_cache.stats["discarded"]
    (got,) = run_op("gradient", counted_sin_sq, "jax-reverse", x)
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    assert executable_cache.stats["discarded"] == discarded + 1
    assert entries(cache_dir) == []  # the bad entry is gone


def test_entry_for_another_key_is_not_used(cache_dir):
    x = np.linspace(0.1, 1.0, 5)
    run_op("gradient", counted_sin_sq, "jax-reverse", x)
    (path,) = entries(cache_dir)
    k2 = executable_cache.key(other, JaxReverse(), ("gradient",), x, None, ())
    path.rename(cache_dir / f"{k2.digest}{executable_cache.SUFFIX}")  # a misplaced entry
    assert executable_cache.load(k2) is None
    assert entries(cache_dir) == []


# --- (c) no collisions -----------------------------------------------------------------
def test_keys_separate_signatures_backends_operators_functions(cache_dir):
    x64 = np.linspace(0.0, 1.0, 4)
    key = executable_cache.key
    variants = {
        "base": key(counted_sin_sq, JaxReverse(), ("gradient",), x64, None, ()),
        "float32": key(counted_sin_sq, JaxReverse(), ("gradient",), x64.astype(np.float32), None, ()),
        "shape": key(counted_sin_sq, JaxReverse(), ("gradient",), np.zeros(5), None, ()),
        "tree": key(counted_sin_sq, JaxReverse(), ("gradient",), {"a": x64}, None, ()),
        "backend": key(counted_sin_sq, JaxForward(), ("gradient",), x64, None, ()),
        "batch": key(counted_sin_sq, JaxForward(batch_size=2), ("gradient",), x64, None, ()),
        "results": key(counted_sin_sq, JaxReverse(), ("value", "gradient"), x64, None, ()),
        "tangents": key(counted_sin_sq, JaxReverse(), ("gradient",), x64, (x64,), ()),
        "contexts": key(counted_sin_sq, JaxReverse(), ("gradient",), x64, None, (x64,)),
        "function": key(other, JaxReverse(), ("gradient",), x64, None, ()),
    }
    digests = {name: k.digest for name, k in variants.items()}
    assert len(set(digests.values())) == len(digests), digests
    again = key(counted_sin_sq, JaxReverse(), ("gradient",), x64.copy(), None, ())
    assert again.digest == digests["base"]


def test_backends_do_not_collide_on_disk(cache_dir):
    x = np.linspace(0.1, 1.0, 6)
    want = {b: run_op("value_and_gradient", counted_sin_sq, b, x) for b in ("jax-reverse", "jax-forward")}
    want["gradient"] = run_op("gradient", counted_sin_sq, "jax-reverse", x)
    assert len(entries(cache_dir)) == 3
    CALLS.clear()
    for b in ("jax-reverse", "jax-forward"):
        got = run_op("value_and_gradient", counted_sin_sq, b, x)
        for g, w in zip(got, want[b], strict=True):
            assert np.asarray(g).tobytes() == np.asarray(w).tobytes()
    (g,) = run_op("gradient", counted_sin_sq, "jax-reverse", x)
    assert np.asarray(g).tobytes() == np.asarray(want["gradient"][0]).tobytes()
    assert CALLS == []


def test_closures_and_lambdas_are_not_persisted(cache_dir):
    scale = 2.0
    x = np.linspace(0.1, 1.0, 3)
    assert executable_cache.key(lambda v: jnp.sum(v), JaxReverse(), ("gradient",), x, None, ()) is None

    def closure(v):
        return scale * jnp.sum(v)

    assert executable_cache.key(closure, JaxReverse(), ("gradient",), x, None, ()) is None
    run_op("gradient", closure, "jax-reverse", x)
    assert entries(cache_dir) == []


def test_registered_functions_are_keyed_by_content(cache_dir):
    from dxserve.frameworks.jax.expressions import compile_expression

    content = expression_content("jnp.sum(x**2)", ["x"])
    a, b = compile_expression("jnp.sum(x**2)", ["x"]), compile_expression("jnp.sum(x**2)", ["x"])
    executable_cache.identify(a, "expression", content)
    x = np.ones(3)
    ka = executable_cache.key(a, JaxReverse(), ("gradient",), x, None, ())
    assert ka is not None and ka == executable_cache.key(b, JaxReverse(), ("gradient",), x, None, ())
    c = compile_expression("jnp.sum(x**3)", ["x"])
    executable_cache.identify(c, "expression", expression_content("jnp.sum(x**3)", ["x"]))
    assert executable_cache.key(c, JaxReverse(), ("gradient",), x, None, ()).digest != ka.digest


def test_disabled_by_default_in_the_library():
    assert not executable_cache.enabled()
    assert executable_cache.key(counted_sin_sq, JaxReverse(), ("gradient",), np.ones(2), None, ()) is None
    assert dxserve.gradient(counted_sin_sq, "jax-reverse", np.ones(2)) is not None


# --- (d) bounded ---------------------------------------------------------------------------
def test_directory_is_bounded(tmp_path):
    directory = tmp_path / "small"
    limit = 30_000  # a few small gradient executables (~9 kB each)
    executable_cache.configure(directory, max_bytes=limit)
    try:
        for n in range(2, 9):
            run_op("gradient", counted_sin_sq, "jax-reverse", np.ones(n))
        files = [p for p in directory.iterdir() if not p.name.startswith(".")]
        assert 0 < sum(p.stat().st_size for p in files) <= limit
        assert len(entries(directory)) < 7
    finally:
        executable_cache.configure(None)
