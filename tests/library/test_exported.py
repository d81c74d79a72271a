"""Uploaded JAX exports: every AD mode on the loaded callable equals the original.

Each function is exported in-process with ``dxclient.export.export_function``,
loaded with ``dxserve.frameworks.jax.exported.load_exported``, and every transformation of the
loaded ``g`` is compared with the same transformation of the original ``f`` at
rtol 1e-12 in float64, all under ``jax.jit``.
"""

from __future__ import annotations

import json
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

jax.config.update("jax_enable_x64", True)

from dxclient.export import MAGIC, bundle_signature, export_function  # noqa: E402
from dxcontract.errors import (  # noqa: E402
    DtypeMismatchError,
    InvalidExportError,
    ShapeMismatchError,
    UnsupportedOperatorError,
)
from dxserve.frameworks.jax.exported import (  # noqa: E402
    ALLOWED_CUSTOM_CALL_TARGETS,
    custom_call_targets,
    load_exported,
)

RTOL = 1e-12


# ----------------------------------------------------------------------------
# functions under test
# ----------------------------------------------------------------------------
def rosenbrock(x):
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def mlp_loss(params, X, y):
    pred = jnp.tanh(X @ params["w"] + params["b"])
    return jnp.mean((pred - y) ** 2) + 0.1 * jnp.sum(params["w"] ** 4)


_A = np.linspace(-1.0, 1.0, 12).reshape(3, 4)


def vec_fn(x):
    return jnp.tanh(jnp.asarray(_A) @ x) * x[:3] + jnp.sin(x[1:]) * x[0]


def _rng(seed):
    return np.random.default_rng(seed)


def _rand_like(tree, seed):
    r = _rng(seed)
    return jax.tree.map(lambda a: jnp.asarray(r.standard_normal(np.shape(a))), tree)


def _batch_like(tree, n, seed):
    r = _rng(seed)
    return jax.tree.map(lambda a: jnp.asarray(r.standard_normal((n, *np.shape(a)))), tree)


def _vdot(a, b):
    return sum(jnp.vdot(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _close(got, ref, what):
    gl, rl = jax.tree.leaves(got), jax.tree.leaves(ref)
    assert jax.tree.structure(got) == jax.tree.structure(ref), what
    for g, r in zip(gl, rl, strict=True):
        g, r = np.asarray(g), np.asarray(r)
        assert g.shape == r.shape and g.dtype == r.dtype, (what, g.shape, r.shape, g.dtype)
        scale = max(1.0, float(np.max(np.abs(r))) if r.size else 1.0)
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=RTOL * scale, err_msg=what)


# ----------------------------------------------------------------------------
# the transformation suite
# ----------------------------------------------------------------------------
def _suite(x, ct_example, scalar: bool):
    """name -> (h -> result), h being ``lambda x: f(x, *contexts)``."""
    v = _rand_like(x, 1)
    w = _rand_like(ct_example, 2)
    T = _batch_like(x, 3, 3)
    CT = _batch_like(ct_example, 3, 4)

    def pull(h, z, c):
        return jax.vjp(h, z)[1](c)[0]

    s = {
        "value": lambda h: h(x),
        "jvp": lambda h: jax.jvp(h, (x,), (v,)),
        "jvp_batched": lambda h: jax.vmap(lambda t: jax.jvp(h, (x,), (t,))[1])(T),
        "vjp": lambda h: pull(h, x, w),
        "vjp_batched": lambda h: jax.vmap(jax.vjp(h, x)[1])(CT),
        "linear_transpose_vjp": lambda h: jax.linear_transpose(jax.vjp(h, x)[1], w)((x,)),
        "linear_transpose_linearize": lambda h: jax.linear_transpose(jax.linearize(h, x)[1], x)(w),
        "jacfwd": lambda h: jax.jacfwd(h)(x),
        "jacrev": lambda h: jax.jacrev(h)(x),
        # second order
        "fwd_over_rev": lambda h: jax.jvp(lambda z: pull(h, z, w), (x,), (v,))[1],
        "rev_over_fwd": lambda h: jax.grad(lambda z: _vdot(jax.jvp(h, (z,), (v,))[1], w))(x),
        "rev_over_rev": lambda h: jax.grad(lambda z: _vdot(pull(h, z, w), v))(x),
        "fwd_over_fwd": lambda h: jax.jvp(lambda z: jax.jvp(h, (z,), (v,))[1], (x,), (v,))[1],
        "jacfwd_jacrev": lambda h: jax.jacfwd(jax.jacrev(h))(x),
        "jacrev_jacrev": lambda h: jax.jacrev(jax.jacrev(h))(x),
        "jacfwd_jacfwd": lambda h: jax.jacfwd(jax.jacfwd(h))(x),
        "fwd_over_rev_batched": lambda h: jax.vmap(
            lambda t: jax.jvp(lambda z: pull(h, z, w), (x,), (t,))[1]
        )(T),
        # x itself batched (sequential fallback)
        "vmap_x_value": lambda h: jax.vmap(h)(T),
        "vmap_x_vjp": lambda h: jax.vmap(lambda z: pull(h, z, w))(T),
    }
    if scalar:
        s.update(
            {
                "grad": lambda h: jax.grad(h)(x),
                "value_and_grad": lambda h: jax.value_and_grad(h)(x),
                "hessian": lambda h: jax.hessian(h)(x),
                "hvp_fwd_over_rev": lambda h: jax.jvp(jax.grad(h), (x,), (v,))[1],
                "hvp_rev_over_fwd": lambda h: jax.grad(lambda z: jax.jvp(h, (z,), (v,))[1])(x),
                "hvp_rev_over_rev": lambda h: jax.grad(lambda z: _vdot(jax.grad(h)(z), v))(x),
                "vmap_x_grad": lambda h: jax.vmap(jax.grad(h))(T),
            }
        )
    return s


def _case_rosenbrock():
    x = jnp.asarray(_rng(0).standard_normal(5))
    return rosenbrock, (x,), (), True


def _case_pytree():
    r = _rng(7)
    params = {"w": jnp.asarray(r.standard_normal((3, 2))), "b": jnp.asarray(r.standard_normal(2))}
    X = jnp.asarray(r.standard_normal((5, 3)))
    y = jnp.asarray(r.standard_normal((5, 2)))
    return mlp_loss, (params,), (X, y), True


def _case_vector():
    x = jnp.asarray(_rng(11).standard_normal(4))
    return vec_fn, (x,), (), False


CASES = {"rosenbrock": _case_rosenbrock, "pytree": _case_pytree, "vector": _case_vector}
_LOADED: dict[str, object] = {}


def _loaded(case):
    if case not in _LOADED:
        fn, (x,), ctx, _ = CASES[case]()
        _LOADED[case] = load_exported(export_function(fn, x, *ctx))
    return _LOADED[case]


def _params():
    out = []
    for case, make in CASES.items():
        fn, (x,), ctx, scalar = make()
        ct = jax.eval_shape(lambda z, fn=fn, ctx=ctx: fn(z, *ctx), x)
        ct = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), ct)
        for name in _suite(x, ct, scalar):
            out.append(pytest.param(case, name, id=f"{case}-{name}"))
    return out


@pytest.mark.parametrize("case,name", _params())
def test_transformation_matches_original(case, name):
    fn, (x,), ctx, scalar = CASES[case]()
    ct = jax.eval_shape(lambda z: fn(z, *ctx), x)
    ct = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), ct)
    t = _suite(x, ct, scalar)[name]
    g = _loaded(case).fn

    def h_ref(z):
        return fn(z, *ctx)

    def h_exp(z):
        return g(z, *ctx)

    ref = jax.jit(lambda: t(h_ref))()
    got = jax.jit(lambda: t(h_exp))()
    _close(got, ref, f"{case}/{name} (jit)")


def test_eager_calls_work():
    fn, (x,), ctx, _ = _case_pytree()
    g = _loaded("pytree").fn
    _close(g(x, *ctx), jax.jit(fn)(x, *ctx), "value")
    _close(jax.grad(g)(x, *ctx), jax.jit(jax.grad(fn))(x, *ctx), "grad")
    _close(jax.hessian(g)(x, *ctx), jax.jit(jax.hessian(fn))(x, *ctx), "hessian")


def test_contexts_passed_through_jit_as_arguments():
    fn, (x,), ctx, _ = _case_pytree()
    g = _loaded("pytree").fn
    got = jax.jit(jax.grad(g))(x, *ctx)
    _close(got, jax.jit(jax.grad(fn))(x, *ctx), "grad with contexts as jit args")
    # other data of the same shapes: no re-export needed
    X2 = ctx[0] * 2.0
    _close(jax.jit(jax.grad(g))(x, X2, ctx[1]), jax.jit(jax.grad(fn))(x, X2, ctx[1]), "new data")


def test_vmap_over_contexts():
    fn, (x,), (X, y), _ = _case_pytree()
    g = _loaded("pytree").fn
    Xs = jnp.stack([X, 2 * X, -X])
    got = jax.jit(jax.vmap(jax.grad(g), in_axes=(None, 0, None)))(x, Xs, y)
    ref = jax.jit(jax.vmap(jax.grad(fn), in_axes=(None, 0, None)))(x, Xs, y)
    _close(got, ref, "vmap over a context")


# ----------------------------------------------------------------------------
# shape polymorphism
# ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def poly_rosen():
    bundle = export_function(
        rosenbrock, np.zeros(4), polymorphic_shapes=("(n,)",), constraints=("n >= 2",)
    )
    return bundle, load_exported(bundle)


@pytest.mark.parametrize("n", [3, 50])
def test_polymorphic_rosenbrock(poly_rosen, n):
    bundle, loaded = poly_rosen
    sig = bundle_signature(bundle)
    assert sig["polymorphic"] and sig["symbolic_dims"] == ["n"]
    assert sig["signature"]["x"] == {"shape": ["n"], "dtype": "float64"}
    x = jnp.asarray(_rng(n).standard_normal(n))
    ct = jnp.zeros(())
    suite = _suite(x, ct, True)
    for name in ("value", "grad", "jvp_batched", "vjp_batched", "hessian", "hvp_fwd_over_rev",
                 "hvp_rev_over_fwd", "hvp_rev_over_rev", "jacfwd", "jacrev", "vmap_x_grad"):  # fmt: skip
        t = suite[name]
        got = jax.jit(lambda t=t: t(loaded.fn))()
        ref = jax.jit(lambda t=t: t(rosenbrock))()
        _close(got, ref, f"poly n={n} {name}")


def test_polymorphic_rejects_inconsistent_shapes():
    bundle = export_function(
        lambda x, y: jnp.sum(x * y), np.zeros(3), np.zeros(3), polymorphic_shapes=("(n,)", "(n,)")
    )
    g = load_exported(bundle).fn
    assert float(g(jnp.ones(4), jnp.ones(4))) == 4.0
    with pytest.raises(ShapeMismatchError):
        g(jnp.ones(4), jnp.ones(5))


def test_polymorphic_constraints_checked_before_lowering(poly_rosen):
    _, loaded = poly_rosen
    with pytest.raises(ShapeMismatchError, match="n >= 2"):
        jax.jit(loaded.fn)(jnp.ones(1))
    g2 = load_exported(
        export_function(
            lambda x, y: jnp.sum(x) * jnp.sum(y),
            np.zeros(3),
            np.zeros(6),
            polymorphic_shapes=("(n,)", "(2*n,)"),
        )  # fmt: skip
    ).fn
    assert float(g2(jnp.ones(2), jnp.ones(4))) == 8.0
    with pytest.raises(ShapeMismatchError, match="2\\*n"):
        g2(jnp.ones(2), jnp.ones(5))


# ----------------------------------------------------------------------------
# call-time errors
# ----------------------------------------------------------------------------
def test_call_errors():
    g = _loaded("rosenbrock").fn
    with pytest.raises(ShapeMismatchError):
        g(jnp.ones(6))
    with pytest.raises(ShapeMismatchError):
        g({"x": jnp.ones(5)})
    with pytest.raises(DtypeMismatchError):
        g(jnp.ones(5, jnp.float32))
    with pytest.raises(UnsupportedOperatorError, match="order 2"):
        jax.jacfwd(jax.hessian(g))(jnp.ones(5))


def test_contexts_are_not_differentiable():
    fn, (x,), (X, y), _ = _case_pytree()
    g = _loaded("pytree").fn
    with pytest.raises(UnsupportedOperatorError, match="contexts"):
        jax.grad(g, argnums=1)(x, X, y)


def test_rejects_integer_x():
    with pytest.raises(ValueError, match="floating"):
        export_function(lambda n: jnp.sum(n), np.arange(3))


# ----------------------------------------------------------------------------
# bundle format and refusals
# ----------------------------------------------------------------------------
def _repack(bundle: bytes, edit) -> bytes:
    (n,) = struct.unpack(">I", bundle[8:12])
    manifest = json.loads(bundle[12 : 12 + n])
    edit(manifest)
    head = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    return MAGIC + struct.pack(">I", len(head)) + head + bundle[12 + n :]


def test_bundle_signature_describes_function():
    fn, (x,), ctx, _ = _case_pytree()
    bundle = export_function(fn, x, *ctx)
    sig = bundle_signature(bundle)
    assert sig["format"] == "dxserve-export" and sig["format_version"] == 1
    assert sig["platforms"] == ["cpu"] and sig["jax_version"] == jax.__version__
    assert sig["signature"]["x"] == {
        "dict": {
            "b": {"shape": [2], "dtype": "float64"},
            "w": {"shape": [3, 2], "dtype": "float64"},
        }
    }
    assert sig["signature"]["contexts"][0] == {"shape": [5, 3], "dtype": "float64"}
    assert sig["signature"]["output"] == {"shape": [], "dtype": "float64"}
    assert set(sig["artifacts"]) == {"primal", "jvp", "vjp", "jvp_jvp", "jvp_vjp"}
    assert b"pickle" not in bundle[:64]
    assert len(bundle) < 200_000


def test_multi_platform_bundle_loads_here():
    bundle = export_function(rosenbrock, np.zeros(3), platforms=("cpu", "cuda"))
    loaded = load_exported(bundle)
    assert loaded.platforms == ("cpu", "cuda")
    x = jnp.asarray([0.5, 1.5, -0.3])
    ref = jax.jit(jax.hessian(rosenbrock))(x)
    _close(jax.jit(jax.hessian(loaded.fn))(x), ref, "multi-platform")


@pytest.mark.parametrize(
    "blob",
    [b"", b"garbage", b"\x00" * 100, MAGIC + b"\xff\xff\xff\xff", MAGIC + b"\x00\x00\x00\x02{}"],
    ids=["empty", "garbage", "zeros", "huge-manifest-length", "empty-manifest"],
)
def test_refuses_garbage(blob):
    with pytest.raises(InvalidExportError) as ei:
        load_exported(blob)
    assert ei.value.field == "export"


def test_refuses_missing_platform():
    bundle = export_function(rosenbrock, np.zeros(3), platforms=("cuda",))
    with pytest.raises(InvalidExportError, match="cuda") as ei:
        load_exported(bundle, platform="cpu")
    assert "cpu" in ei.value.detail


def test_refuses_unknown_format_version():
    bundle = export_function(rosenbrock, np.zeros(3))
    bad = _repack(bundle, lambda m: m.update(format_version=99))
    with pytest.raises(InvalidExportError, match="format_version"):
        load_exported(bad)


def test_refuses_tampered_manifest_shape():
    bundle = export_function(rosenbrock, np.zeros(3))
    bad = _repack(bundle, lambda m: m["signature"]["x"].update(shape=[4]))
    with pytest.raises(InvalidExportError, match="manifest"):
        load_exported(bad)


def test_refuses_tampered_manifest_platforms():
    bundle = export_function(rosenbrock, np.zeros(3), platforms=("cuda",))
    bad = _repack(bundle, lambda m: m.update(platforms=["cpu"]))
    with pytest.raises(InvalidExportError, match="lowered for"):
        load_exported(bad)


def test_refuses_swapped_artifacts():
    bundle = export_function(vec_fn, np.zeros(4))

    def swap(m):
        a = m["artifacts"]
        a["jvp"], a["vjp"] = a["vjp"], a["jvp"]

    with pytest.raises(InvalidExportError, match="signature"):
        load_exported(_repack(bundle, swap))


def test_refuses_corrupt_blob_and_truncation():
    bundle = bytearray(export_function(rosenbrock, np.zeros(3)))
    bundle[-10] ^= 0xFF
    with pytest.raises(InvalidExportError, match="sha256"):
        load_exported(bytes(bundle))
    with pytest.raises(InvalidExportError):
        load_exported(bytes(bundle[:-100]))
    with pytest.raises(InvalidExportError, match="trailing"):
        load_exported(export_function(rosenbrock, np.zeros(3)) + b"x")


def test_refuses_oversized_bundle():
    bundle = export_function(rosenbrock, np.zeros(3))
    with pytest.raises(InvalidExportError, match="limit"):
        load_exported(bundle, max_bytes=1000)


def test_refuses_custom_call_not_allowed():
    def solve(x):
        return jnp.sum(jnp.linalg.solve(jnp.eye(3) + jnp.outer(x, x), x))

    bundle = export_function(solve, np.ones(3))
    # allowed by default (LAPACK getrf/trsm)
    loaded = load_exported(bundle)
    assert "lapack_dgetrf_ffi" in loaded.custom_call_targets
    x = jnp.asarray([0.1, 0.2, 0.3])
    _close(jax.jit(jax.hessian(loaded.fn))(x), jax.jit(jax.hessian(solve))(x), "solve hessian")
    # refused when the server's list does not contain it
    with pytest.raises(InvalidExportError, match="lapack_dgetrf_ffi"):
        load_exported(bundle, allowed_custom_calls=frozenset({"shape_assertion"}))


def test_custom_call_scan_sees_host_callbacks():
    def cb(x):
        return jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    text = jax.jit(cb).lower(jnp.ones(3)).as_text()
    targets = custom_call_targets(text)
    assert targets and not (targets & ALLOWED_CUSTOM_CALL_TARGETS)
    assert custom_call_targets('stablehlo.custom_call @"weird.name"(%0)') == {"weird.name"}
    assert custom_call_targets('"stablehlo.custom_call"(%0) {call_target_name = "x"}') == {"x"}


def test_exporting_a_host_callback_fails_on_the_client():
    def cb(x):
        return jnp.sum(jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x))

    with pytest.raises(Exception, match="custom call|callback"):
        export_function(cb, np.ones(3))


# ----------------------------------------------------------------------------
# other signatures: scalar x, pytree output, empty batches
# ----------------------------------------------------------------------------
def test_scalar_input_second_derivative():
    def f(x, a):
        return jnp.sin(x) * x**3 + a * x

    g = load_exported(export_function(f, 0.5, 2.0)).fn
    x, a = jnp.asarray(0.7), jnp.asarray(2.0)
    for name, t in {
        "derivative": lambda h: jax.grad(h)(x, a),
        "second_derivative": lambda h: jax.grad(jax.grad(h))(x, a),
        "fwd_fwd": lambda h: jax.jacfwd(jax.jacfwd(h))(x, a),
        "fwd_rev": lambda h: jax.jacfwd(jax.grad(h))(x, a),
    }.items():
        _close(jax.jit(lambda t=t: t(g))(), jax.jit(lambda t=t: t(f))(), name)


def test_pytree_output():
    def f(x):
        return {"a": jnp.sin(x) * x[0], "b": jnp.sum(x**3)}

    g = load_exported(export_function(f, np.zeros(3))).fn
    x = jnp.asarray([0.3, -1.2, 2.0])
    ct = {"a": jnp.asarray([1.0, 2.0, 3.0]), "b": jnp.asarray(-0.5)}
    CT = jax.tree.map(lambda c: jnp.stack([c, 2 * c]), ct)
    for name, t in {
        "value": lambda h: h(x),
        "jacfwd": lambda h: jax.jacfwd(h)(x),
        "jacrev": lambda h: jax.jacrev(h)(x),
        "vjp_batched": lambda h: jax.vmap(jax.vjp(h, x)[1])(CT),
        "jvp_batched": lambda h: jax.vmap(lambda u: jax.jvp(h, (x,), (u,))[1])(jnp.eye(3)),
        "hessians": lambda h: jax.hessian(h)(x),
    }.items():
        _close(jax.jit(lambda t=t: t(g))(), jax.jit(lambda t=t: t(f))(), name)


def test_empty_tangent_batch():
    g = _loaded("vector").fn
    x = jnp.ones(4)
    out = jax.jit(jax.vmap(lambda t: jax.jvp(g, (x,), (t,))[1]))(jnp.zeros((0, 4)))
    assert out.shape == (0, 3)
    out = jax.jit(jax.vmap(jax.vjp(g, x)[1]))(jnp.zeros((0, 3)))
    assert out[0].shape == (0, 4)


# ----------------------------------------------------------------------------
# the export gate (dxserve.server.sandboxes.export_gate): checked in a child before read in process
# ----------------------------------------------------------------------------
import hashlib  # noqa: E402

from dxserve.server.sandboxes import export_gate  # noqa: E402


@pytest.fixture(scope="module")
def rosen_bundle():
    return export_function(rosenbrock, np.zeros(3))


@pytest.fixture(scope="module")
def gate():
    """A gate of its own, as a ``Service`` owns one."""
    gate = export_gate.ExportGate()
    try:
        yield gate
    finally:
        gate.shutdown()


def test_gate_passes_a_good_bundle_and_binds_the_pass_to_its_hash(gate, rosen_bundle):
    stamp = gate.check(rosen_bundle)
    assert stamp["sha256"] == hashlib.sha256(rosen_bundle).hexdigest()
    assert stamp["version"] == export_gate.GATE_VERSION and stamp["jax"] == jax.__version__
    assert gate.passed(rosen_bundle)
    assert gate.stamp(rosen_bundle) == {"export_gate": stamp}
    other = bytearray(rosen_bundle)
    other[-1] ^= 1
    assert not gate.passed(bytes(other)) and gate.stamp(bytes(other)) == {}
    assert not export_gate.ExportGate().passed(rosen_bundle)  # passes are each gate's own


@pytest.mark.parametrize(
    ("fault", "words"),
    [("abort", "crashed"), ("oom", "memory limit"), ("exit", "without an answer"),
     ("hang", "timed out")],
)  # fmt: skip
def test_gate_child_failures_are_invalid_export_and_the_caller_survives(
    gate, rosen_bundle, fault, words
):
    # _fault is a test hook of check(); nothing over HTTP reaches it
    cfg = export_gate.GateConfig(timeout=3.0)
    with pytest.raises(InvalidExportError) as info:
        export_gate.check(rosen_bundle, cfg=cfg, server=gate._server, _fault=fault)
    assert info.value.field == "export" and words in info.value.detail
    assert gate.check(rosen_bundle)["sha256"]  # the fork server still works


def test_gate_keeps_load_exported_refusals(gate, rosen_bundle):
    bad = _repack(rosen_bundle, lambda m: m["signature"]["x"].update(shape=[4]))
    with pytest.raises(InvalidExportError, match="manifest"):
        gate.check(bad)
    with pytest.raises(InvalidExportError, match="sha256"):  # refused before any child
        gate.check(rosen_bundle[:-1] + bytes([rosen_bundle[-1] ^ 1]))


def test_gate_runs_a_polymorphic_export_at_an_allowed_size(gate):
    def poly(x):  # symbolic n: the gate picks an n that satisfies the constraint
        return jnp.sum(x[1:] * x[:-1])

    bundle = export_function(poly, np.zeros(3), polymorphic_shapes=("(n,)",),
                             constraints=("n >= 2",))  # fmt: skip
    assert gate.check(bundle)["sha256"]  # n = 3: compiled and run


def test_admit_trusts_only_a_matching_stamp(rosen_bundle, monkeypatch):
    calls = []
    gate = export_gate.ExportGate()
    monkeypatch.setattr(gate, "check", lambda content, **kw: calls.append(content))
    fresh = rosen_bundle + b""
    good = export_gate._make_stamp(hashlib.sha256(fresh).hexdigest(), "cpu")
    for stale in ({}, {"export_gate": {**good, "sha256": "0" * 64}},
                  {"export_gate": {**good, "version": 0}}, {"export_gate": {**good, "jax": "0.1"}}):
        gate.admit(fresh, stale)  # no or stale stamp (older dxserve): gated now
    assert len(calls) == 4
    gate.admit(fresh, {"export_gate": good})
    assert len(calls) == 4 and gate.passed(fresh)
    gate.require(fresh)  # passed: nothing to do
    assert len(calls) == 4


def test_export_kind_refuses_to_read_ungated_content(rosen_bundle, monkeypatch):
    from dxserve.server.kinds.export import EXPORT

    gate = export_gate.ExportGate()

    def refuse(content, **kw):
        raise InvalidExportError("gate says no", field="export")

    monkeypatch.setattr(gate, "check", refuse)
    with pytest.raises(InvalidExportError, match="gate says no"):
        EXPORT.bind(export_gate=gate).build(rosen_bundle)
