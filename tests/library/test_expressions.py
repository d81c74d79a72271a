"""Expressions: values and derivatives, JAX transformations, and a hostile-input table."""

from __future__ import annotations

import ast
import builtins

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dxcontract.errors import InvalidArgumentError, InvalidExpressionError
from dxserve.frameworks.jax.expressions import (
    ALLOWED_CONSTANTS,
    ALLOWED_FUNCTIONS,
    MAX_EXPRESSION_CHARS,
    Expression,
    compile_expression,
)
from dxserve.http.problems import problem_document

jax.config.update("jax_enable_x64", True)

RTOL = 1e-12


# ---------------------------------------------------------------- tripwire
@pytest.fixture
def tripwire(monkeypatch):
    """Patch dangerous builtins so any use is recorded (and fails) while the block runs."""
    hits: list[str] = []
    real_compile, real_import = builtins.compile, builtins.__import__

    def trap(name):
        def tripped(*args, **kwargs):
            hits.append(name)
            raise AssertionError(f"{name} was called")

        return tripped

    def guarded_compile(source, filename, mode, flags=0, *args, **kwargs):
        if not flags & ast.PyCF_ONLY_AST:  # ast.parse is fine; compiling to code is not
            hits.append("compile")
            raise AssertionError("compile was called")
        return real_compile(source, filename, mode, flags, *args, **kwargs)

    def guarded_import(name, *args, **kwargs):
        if name.split(".")[0] in {"os", "subprocess", "shutil", "socket", "importlib", "sys"}:
            hits.append(f"import {name}")
            raise AssertionError(f"import {name}")
        return real_import(name, *args, **kwargs)

    for name in ("eval", "exec", "open", "breakpoint", "input"):
        monkeypatch.setattr(builtins, name, trap(name))
    monkeypatch.setattr(builtins, "compile", guarded_compile)
    monkeypatch.setattr(builtins, "__import__", guarded_import)
    yield hits
    monkeypatch.undo()
    assert hits == [], f"dangerous builtins were used: {hits}"


# ---------------------------------------------------------------- values and gradients
rng = np.random.default_rng(0)
A3 = rng.normal(size=(3, 3))
X3 = np.array([0.3, -1.2, 0.7])
XPOS = np.array([0.5, 1.5, 2.0, 0.25])
W = np.array([1.0, -2.0, 3.5])


def _rosen(x):
    return np.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)


def _rosen_grad(x):
    g = np.zeros_like(x)
    r = x[1:] - x[:-1] ** 2
    g[:-1] += -400 * x[:-1] * r - 2 * (1 - x[:-1])
    g[1:] += 200 * r
    return g


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


# (id, source, args, x, contexts, value(x, *ctx), gradient(x, *ctx))
CASES = [
    ("sum_of_squares", "jnp.sum(x**2)", ["x"], X3, (), lambda x: np.sum(x**2), lambda x: 2 * x),
    (
        "rosenbrock",
        "jnp.sum(100*(x[1:]-x[:-1]**2)**2 + (1-x[:-1])**2)",
        ["x"],
        np.array([1.0, 2.0, 3.0, -0.5]),
        (),
        _rosen,
        _rosen_grad,
    ),
    (
        "logsumexp",
        "jnp.log(jnp.sum(jnp.exp(x)))",
        ["x"],
        X3,
        (),
        lambda x: np.log(np.sum(np.exp(x))),
        _softmax,
    ),
    (
        "scipy_logsumexp",
        "jax.scipy.special.logsumexp(x) + jax.nn.logsumexp(2*x)",
        ["x"],
        X3,
        (),
        lambda x: np.log(np.sum(np.exp(x))) + np.log(np.sum(np.exp(2 * x))),
        lambda x: _softmax(x) + 2 * _softmax(2 * x),
    ),
    (
        "softmax_weighted",
        "jnp.dot(jax.nn.softmax(x), w)",
        ["x", "w"],
        X3,
        (W,),
        lambda x, w: _softmax(x) @ w,
        lambda x, w: _softmax(x) * (w - _softmax(x) @ w),
    ),
    (
        "norm",
        "jnp.linalg.norm(x) + jnp.linalg.norm(x, ord=1)",
        ["x"],
        X3,
        (),
        lambda x: np.linalg.norm(x) + np.abs(x).sum(),
        lambda x: x / np.linalg.norm(x) + np.sign(x),
    ),
    (
        "brief_example",
        "jnp.sum(jnp.sin(x)**2) + jnp.dot(A, x)[0]",
        ["x", "A"],
        X3,
        (A3,),
        lambda x, a: np.sum(np.sin(x) ** 2) + (a @ x)[0],
        lambda x, a: np.sin(2 * x) + a[0],
    ),
    (
        "quadratic_form",
        "x @ A @ x / 2",
        ["x", "A"],
        X3,
        (A3,),
        lambda x, a: x @ a @ x / 2,
        lambda x, a: (a + a.T) @ x / 2,
    ),
    (
        "where_piecewise",
        "jnp.sum(jnp.where(x > 0, x**2, -3*x))",
        ["x"],
        X3,
        (),
        lambda x: np.sum(np.where(x > 0, x**2, -3 * x)),
        lambda x: np.where(x > 0, 2 * x, -3.0),
    ),
    (
        "ternary",
        "jnp.sum(x**3 if x < 0.5 else jnp.cos(x))",
        ["x"],
        X3,
        (),
        lambda x: np.sum(np.where(x < 0.5, x**3, np.cos(x))),
        lambda x: np.where(x < 0.5, 3 * x**2, -np.sin(x)),
    ),
    (
        "maximum",
        "jnp.sum(jnp.maximum(x, 0.5) ** 2 + jnp.minimum(x, -1.0))",
        ["x"],
        X3,
        (),
        lambda x: np.sum(np.maximum(x, 0.5) ** 2 + np.minimum(x, -1.0)),
        lambda x: np.where(x > 0.5, 2 * x, 0.0) + np.where(x < -1.0, 1.0, 0.0),
    ),
    (
        "slicing",
        "jnp.sum(x[::2]) * x[-1] + x[1:3] @ x[:2] + x[None, ...][0, 1]",
        ["x"],
        XPOS,
        (),
        lambda x: x[::2].sum() * x[-1] + x[1:3] @ x[:2] + x[1],
        lambda x: np.array([x[-1] + x[1], x[0] + x[2] + 1, x[-1] + x[1], x[0] + x[2]]),
    ),
    (
        "array_literal",
        "jnp.dot(jnp.array([1.0, -2.0, 3.5]), jnp.exp(x))",
        ["x"],
        X3,
        (),
        lambda x: W @ np.exp(x),
        lambda x: W * np.exp(x),
    ),
    (
        "clip_kwargs",
        "jnp.sum(jnp.clip(x, min=-1.0, max=0.5) * x)",
        ["x"],
        X3,
        (),
        lambda x: np.sum(np.clip(x, -1.0, 0.5) * x),
        lambda x: np.clip(x, -1.0, 0.5) + np.where((x > -1.0) & (x < 0.5), x, 0.0),
    ),
    (
        "chained_compare",
        "jnp.sum(jnp.where(0.4 < x < 1.8, x**2, 0.0))",
        ["x"],
        XPOS,
        (),
        lambda x: np.sum(np.where((0.4 < x) & (x < 1.8), x**2, 0.0)),
        lambda x: np.where((0.4 < x) & (x < 1.8), 2 * x, 0.0),
    ),
    (
        "reshape_axis",
        "jnp.sum(jnp.mean(jnp.reshape(x, (2, 2)), axis=0, keepdims=True) ** 2)",
        ["x"],
        XPOS,
        (),
        lambda x: np.sum(x.reshape(2, 2).mean(axis=0) ** 2),
        lambda x: np.tile(x.reshape(2, 2).mean(axis=0), 2),
    ),
    (
        "negative_power",
        "jnp.sum(x ** -1 + jnp.sqrt(x) + jnp.log1p(x) / jnp.pi)",
        ["x"],
        XPOS,
        (),
        lambda x: np.sum(1 / x + np.sqrt(x) + np.log1p(x) / np.pi),
        lambda x: -1 / x**2 + 0.5 / np.sqrt(x) + 1 / (np.pi * (1 + x)),
    ),
    (
        "stack_and_constants",
        "jnp.sum(jnp.stack([x, 2 * x], axis=1) ** 2) + 9**2 + -(3 // 2) % 5",
        ["x"],
        X3,
        (),
        lambda x: 5 * np.sum(x**2) + 81 + 4,
        lambda x: 10 * x,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_value_and_gradient(case):
    _, source, args, x, ctx, value, grad = case
    f = compile_expression(source, args)
    assert isinstance(f, Expression)
    x = jnp.asarray(x)
    np.testing.assert_allclose(f(x, *ctx), value(np.asarray(x), *ctx), rtol=RTOL)
    np.testing.assert_allclose(
        jax.grad(f)(x, *ctx), grad(np.asarray(x), *ctx), rtol=RTOL, atol=1e-14
    )
    np.testing.assert_allclose(jax.jit(f)(x, *ctx), value(np.asarray(x), *ctx), rtol=RTOL)


def test_transformations():
    """jit, jvp, vjp, grad, hessian, vmap and nested forward/reverse all trace through."""
    f = compile_expression("x @ A @ x + jnp.sum(x**3)", ["x", "A"])
    A = jnp.asarray(A3)
    x, v = jnp.asarray(X3), jnp.asarray([1.0, -0.5, 2.0])
    grad = (A3 + A3.T) @ X3 + 3 * X3**2
    hess = A3 + A3.T + np.diag(6 * X3)

    _, tangent = jax.jvp(lambda x: f(x, A), (x,), (v,))
    np.testing.assert_allclose(tangent, grad @ np.asarray(v), rtol=RTOL)
    _, pullback = jax.vjp(lambda x: f(x, A), x)
    np.testing.assert_allclose(pullback(jnp.asarray(1.0))[0], grad, rtol=RTOL)
    np.testing.assert_allclose(jax.jit(jax.grad(f))(x, A), grad, rtol=RTOL)
    np.testing.assert_allclose(jax.hessian(f)(x, A), hess, rtol=RTOL)
    np.testing.assert_allclose(jax.jacfwd(jax.jacrev(f))(x, A), hess, rtol=RTOL)
    # forward-over-reverse and reverse-over-forward HVPs
    hvp_for = jax.jvp(lambda x: jax.grad(f)(x, A), (x,), (v,))[1]
    hvp_rev = jax.grad(lambda x: jax.jvp(lambda y: f(y, A), (x,), (v,))[1])(x)
    np.testing.assert_allclose(hvp_for, hess @ np.asarray(v), rtol=RTOL)
    np.testing.assert_allclose(hvp_rev, hess @ np.asarray(v), rtol=RTOL)
    # vmap over a batch of points, contexts broadcast
    xs = jnp.stack([x, 2 * x, -x])
    batched = jax.vmap(f, in_axes=(0, None))(xs, A)
    expected = [xi @ A3 @ xi + np.sum(xi**3) for xi in np.asarray(xs)]
    np.testing.assert_allclose(batched, expected, rtol=RTOL)
    np.testing.assert_allclose(jax.vmap(jax.grad(f), in_axes=(0, None))(xs, A)[0], grad, rtol=RTOL)


def test_vector_valued_jacobian():
    f = compile_expression("jnp.stack([x[0] * x[1], jnp.sin(x[2]), jnp.sum(x)])")
    x = jnp.asarray(X3)
    expected = np.array([[X3[1], X3[0], 0], [0, 0, np.cos(X3[2])], [1, 1, 1]])
    np.testing.assert_allclose(jax.jacfwd(f)(x), expected, rtol=RTOL)
    np.testing.assert_allclose(jax.jacrev(f)(x), expected, rtol=RTOL)


def test_dtype_follows_input():
    """Float literals (scalar or jnp.array) are weakly typed: float32 in, float32 out."""
    f = compile_expression("jnp.sum(jnp.array([1.5, 2.0]) * x * 0.5 + jnp.pi)")
    x32 = jnp.ones(2, dtype=jnp.float32)
    assert f(x32).dtype == jnp.float32
    assert jax.grad(f)(x32).dtype == jnp.float32
    assert f(jnp.ones(2)).dtype == jnp.float64


def test_literal_arithmetic_is_harmless():
    """Literals go through jnp at trace time; no Python big-int arithmetic happens."""
    f = compile_expression("x * 9**9 + 10**18 * 0 + x ** 99999999999")
    assert float(f(jnp.asarray(1.0))) == 9**9 + 1


def test_constant_expression_and_unused_context():
    f = compile_expression("2.5 + jnp.e", ["x", "unused"])
    assert float(f(jnp.zeros(3), jnp.ones(2))) == pytest.approx(2.5 + np.e, rel=RTOL)
    assert float(jnp.sum(jax.grad(lambda x: f(x, 1.0))(jnp.ones(3)))) == 0.0


def test_no_builtins_touched_while_compiling_and_running(tripwire):
    f = compile_expression("jnp.sum(jnp.sin(x)**2) + jnp.dot(A, x)[0]", ["x", "A"])
    x, A = jnp.asarray(X3), jnp.asarray(A3)
    jax.jit(jax.grad(f))(x, A)
    jax.hessian(f)(x, A)


def test_wrong_number_of_contexts():
    f = compile_expression("jnp.dot(A, x)", ["x", "A"])
    with pytest.raises(InvalidArgumentError) as info:
        f(jnp.ones(3))
    assert info.value.field == "contexts[0]"  # the first missing one, by name
    assert "contexts[0] (A) is missing" in info.value.detail
    with pytest.raises(InvalidArgumentError) as info:
        f(jnp.ones(3), jnp.eye(3), jnp.eye(3))
    assert info.value.field == "contexts[1]"


def test_expression_is_a_value():
    a = compile_expression("x + 1", ["x"])
    assert a == Expression("x + 1", ("x",)) and hash(a) == hash(Expression("x + 1"))
    assert a != compile_expression("x + 1", ["x", "c"])
    assert a.args == ("x",) and "x + 1" in repr(a)


def test_whitelist_contents():
    for name in ("jnp.sin", "jnp.sum", "jnp.linalg.norm", "jnp.where", "jnp.array"):
        assert name in ALLOWED_FUNCTIONS
    for name in (
        "jnp.zeros",
        "jnp.ones",
        "jnp.full",
        "jnp.arange",
        "jnp.eye",
        "jnp.load",
        "jnp.einsum",
        "jnp.linspace",
    ):
        assert name not in ALLOWED_FUNCTIONS
    assert ALLOWED_CONSTANTS == {"jnp.pi", "jnp.e", "jnp.inf", "jnp.nan", "jnp.newaxis"}
    assert all(not part.startswith("_") for n in ALLOWED_FUNCTIONS for part in n.split("."))


# ---------------------------------------------------------------- hostile table
HUGE = "x+" * 50_000 + "x"  # 100 kB

# (source, args, field, substring the detail must contain)
HOSTILE = [
    ("__import__('os')", ["x"], "expression", "__import__"),
    ("__import__('os').system('true')", ["x"], "expression", "__import__"),
    ("().__class__.__bases__", ["x"], "expression", "__class__"),
    ("x.__class__", ["x"], "expression", "__class__"),
    ("jnp.load('f')", ["x"], "expression", "load"),
    ("open('/etc/passwd')", ["x"], "expression", "open"),
    ("lambda: 1", ["x"], "expression", "lambda"),
    ("[i for i in x]", ["x"], "expression", "comprehension"),
    ("sum(i for i in x)", ["x"], "expression", "sum"),
    ("jnp.sum(i for i in x)", ["x"], "expression", "generator"),
    ("getattr(x, 'a')", ["x"], "expression", "getattr"),
    ("9**9**9**9**9", ["x"], "expression", "**"),
    ("x ** 2 ** 3", ["x"], "expression", "**"),
    ("'a'*10**8", ["x"], "expression", "'a'"),
    (HUGE, ["x"], "expression", str(MAX_EXPRESSION_CHARS)),
    ("jnp.ones(10**10)", ["x"], "expression", "ones"),
    ("jnp.zeros((10**6, 10**6))", ["x"], "expression", "zeros"),
    ("x.T.__class__", ["x"], "expression", "__class__"),
    ("x.T", ["x"], "expression", "'T'"),
    ("jnp.__dict__", ["x"], "expression", "__dict__"),
    ("jnp.linalg.inv.__globals__", ["x"], "expression", "__globals__"),
    ("jnp.linalg.eig(x)", ["x"], "expression", "jnp.linalg.eig"),
    ("eval('1')", ["x"], "expression", "eval"),
    ("exec", ["x"], "expression", "exec"),
    ("globals()", ["x"], "expression", "globals"),
    ("(x := 1)", ["x"], "expression", ":="),
    ("f'{x}'", ["x"], "expression", "f-string"),
    ("b'x'", ["x"], "expression", "b'x'"),
    ("{1: 2}", ["x"], "expression", "dict"),
    ("{1}", ["x"], "expression", "set"),
    ("*x", ["x"], "expression", "'*'"),
    ("jnp.sum(*x)", ["x"], "expression", "starred"),
    ("jnp.sum(**x)", ["x"], "expression", "'**'"),
    ("x if True else y", ["x"], "expression", "'y'"),
    ("import os", ["x"], "expression", "import"),
    ("jax.numpy.sin(x)", ["x"], "expression", "jax.numpy"),
    ("np.sin(x)", ["x"], "expression", "'np'"),
    ("jnp.sin(x, out=x)", ["x"], "expression", "out"),
    ("jnp.array(['a'])", ["x"], "expression", "'a'"),
    ("jnp.array([x, 1.0])", ["x"], "expression", "numeric literals"),
    ("jnp.sum(x, axis=x)", ["x"], "expression", "integer literal"),
    ("jnp.diff(x, n=10**12)", ["x"], "expression", "literal"),
    ("jnp.diff(x, n=1000000)", ["x"], "expression", "1000000"),
    ("x[x]", ["x"], "expression", "index"),
    ("x and x", ["x"], "expression", "and"),
    ("not x", ["x"], "expression", "not"),
    ("x is x", ["x"], "expression", "is"),
    ("x in x", ["x"], "expression", "in"),
    ("x << 2", ["x"], "expression", "<<"),
    ("1j * x", ["x"], "expression", "1j"),
    ("x * 1e400", ["x"], "expression", "1e400"),
    ("x * 99999999999999999999", ["x"], "expression", "99999999999999999999"),
    ("(x, x)", ["x"], "expression", "tuple"),
    ("[x]", ["x"], "expression", "list"),
    ("x(1)", ["x"], "expression", "not callable"),
    ("(x)(1)", ["x"], "expression", "not callable"),
    ("x[0](1)", ["x"], "expression", "x[0]"),
    ("jnp", ["x"], "expression", "jnp"),
    ("jnp.sin", ["x"], "expression", "must be called"),
    ("jnp.pi(1)", ["x"], "expression", "constant"),
    ("await x", ["x"], "expression", "await"),
    ("(yield x)", ["x"], "expression", "yield"),
    ("x +", ["x"], "expression", "syntax"),
    ("x\x00", ["x"], "expression", "null"),
    ("-" * 9000 + "x", ["x"], "expression", "parse"),
    ("jnp.sin(" * 80 + "x" + ")" * 80, ["x"], "expression", "64"),
    ("+".join(["x"] * 2500), ["x"], "expression", "2000"),
    ("x", ["__x"], "args", "__x"),
    ("x", ["x", "x"], "args", "'x'"),
    ("x", ["jnp"], "args", "jnp"),
    ("x", ["1x"], "args", "1x"),
    ("x", ["lambda"], "args", "lambda"),
    ("x", [], "args", "between"),
    ("x", [f"a{i}" for i in range(17)], "args", "16"),
    ("x", "x", "args", "list"),
    ("x", ["x", 3], "args", "3"),
]


@pytest.mark.parametrize(
    ("source", "args", "field", "needle"),
    HOSTILE,
    ids=[f"{i:02d}-{src[:30]!r}" for i, (src, *_rest) in enumerate(HOSTILE)],
)
def test_hostile_expression_is_rejected(tripwire, source, args, field, needle):
    # A hostile expression that got as far as evaluating (9**9**9, a huge repeat) would
    # hang here: pytest-timeout ends that; bench/expressions.py measures how fast it is.
    with pytest.raises(InvalidExpressionError) as info:
        compile_expression(source, args)
    err = info.value
    assert err.field == field
    assert needle in err.detail, err.detail
    problem = problem_document(err)  # as the HTTP layer renders it
    assert problem["status"] == 422 and problem["field"] == field
    if field == "expression" and "line" in err.extra:
        assert {"line", "col"} <= set(err.extra)
        assert err.detail.startswith(f"line {err.extra['line']}, col {err.extra['col']}:")


def test_error_positions_are_character_columns():
    with pytest.raises(InvalidExpressionError) as info:
        compile_expression("jnp.sin(x) + jnp.load(x)")
    assert info.value.extra == {"token": "load", "line": 1, "col": 18}
    assert info.value.detail.startswith("line 1, col 18:")
    with pytest.raises(InvalidExpressionError) as info:
        compile_expression("x + é")  # non-ASCII: columns count characters, not bytes
    assert info.value.extra["col"] == 5 and info.value.extra["token"] == "é"
    with pytest.raises(InvalidExpressionError) as info:
        compile_expression("(x +\n  y)")
    assert (info.value.extra["line"], info.value.extra["col"]) == (2, 3)
    with pytest.raises(InvalidExpressionError) as info:
        compile_expression("x + 9**9**9")
    assert info.value.extra == {"token": "**", "line": 1, "col": 6}


def test_expressions_up_to_the_length_cap_compile_and_longer_ones_are_refused():
    # How long parsing takes is a bench table (bench/expressions.py), not a pass/fail.
    name = "v" * 60
    source = " + ".join([f"jnp.sin({name}[0]) * 2.5"] * 200)
    source = source[: source.rfind(" + ", 0, MAX_EXPRESSION_CHARS)]
    assert 9_000 < len(source) <= MAX_EXPRESSION_CHARS
    f = compile_expression(source, [name])
    assert float(f(jnp.asarray([0.5]))) == pytest.approx(
        len(source.split(" + ")) * 2.5 * np.sin(0.5), rel=1e-12
    )
    with pytest.raises(InvalidExpressionError) as info:
        compile_expression("x" * 1_000_000)
    assert str(MAX_EXPRESSION_CHARS) in info.value.detail, info.value.detail


def test_long_left_deep_sums_are_not_limited_by_depth():
    f = compile_expression(" + ".join(["x[0]"] * 300))
    assert float(f(jnp.asarray([2.0]))) == 600.0


_ALPHABET = st.sampled_from(
    list("x()[]{}.,:;+-*/%@<>=!&|^~'\"_ 0123456789ejn")
    + ["jnp.", "sin", "sum", "__", "lambda", " if ", " else ", "**", "...", "None", "True", "A"]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_ALPHABET, max_size=25).map("".join))
def test_fuzz_only_typed_errors(source):
    """Arbitrary text either compiles or raises InvalidExpressionError, nothing else."""
    try:
        compile_expression(source, ["x", "A"])
    except InvalidExpressionError as err:
        assert err.field == "expression"


def _sample_call(name: str) -> str:
    """A call of ``name`` that passes every allowed keyword (checks our table vs jax)."""
    from dxserve.frameworks.jax.expressions import _SIGNATURES

    sig = _SIGNATURES[name]
    values = {
        "expr": "M",
        "sequence of expressions": "[M, M]",
        "numeric literal array": "[[0.5, 0.25], [0.125, 0.75]]",
        "shape": "(4,)",
        "axis": "0",
        "bool": "False",
        "ord": "2",
        "n": "1",
        "axes": "1",
    }
    parts = []
    for i, (param, kind, mode) in enumerate(sig.params):
        value = values[kind]
        if param == "axes" and kind == "axis":
            value = "(1, 0)"  # jnp.transpose
        elif name == "jnp.squeeze" and param == "axis":
            value = "None"  # no axis of size one to squeeze
        if mode == "positional-only" or i < sig.required:
            parts.append(value)
        else:
            parts.append(f"{param}={value}")
    return f"{name}({', '.join(parts)})"


@pytest.mark.parametrize("name", sorted(ALLOWED_FUNCTIONS))
def test_every_allowed_function_runs_with_its_keywords(name):
    f = compile_expression(_sample_call(name), ["M"])
    m = jnp.asarray([[0.5, 0.25], [0.125, 0.75]])
    assert jnp.asarray(f(m)).size >= 1
