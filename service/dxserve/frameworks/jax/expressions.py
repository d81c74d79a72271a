"""User expressions: a whitelisted subset of ``jnp`` compiled from the AST, never ``eval``.

``compile_expression("jnp.sum(jnp.sin(x)**2) + jnp.dot(A, x)[0]", ["x", "A"])`` parses the
text with ``ast.parse(..., mode="eval")``, checks every node against a whitelist and builds a
tree of closures. Calling the result maps each node to a whitelisted ``jnp`` function or
operator, so it is an ordinary JAX-traceable function ``f(x, *contexts)``.

Security rules (all checked eagerly, before anything runs):

* No ``eval``/``exec``/``compile`` of text; Python arithmetic is never applied to user
  numbers (``9**9`` becomes ``jnp.power(9, 9)`` at trace time), except negating a literal.
* Names: only those in ``args``; ``jnp``/``jax`` only as the head of an allowed
  ``jnp.<fn>``, ``jnp.linalg.<fn>``, ``jax.nn.<fn>``, ``jax.scipy.special.<fn>`` path or an
  allowed constant. No other attribute access; dunder names are rejected everywhere.
* Strings only as a whole subscript, a key of a pytree input (``x["w"]``: ASCII, not
  starting with ``_``). No other strings, no bytes, f-strings, complex numbers, lambdas, comprehensions, walrus, ``*``/``**``
  unpacking, dict/set literals, ``and``/``or``/``not`` (use ``&``, ``|``, ``~`` or
  ``jnp.logical_*``), ``is``/``in``, shifts, ``await``/``yield``.
* No functions that create arrays from a shape (``zeros``, ``ones``, ``full``, ``arange``,
  ``eye``, ``linspace``, ...): a few characters could allocate terabytes.
* Literal power towers (``x ** 2 ** 3``, ``9**9**9``) are rejected; literal exponents are fine.
* Limits: ``MAX_EXPRESSION_CHARS`` characters, ``MAX_NODES`` AST nodes, ``MAX_DEPTH`` nesting,
  integer literals ``|n| < 2**63``, finite float literals, at most ``MAX_ARGS`` args.
  Left-deep operator chains (``a + b + c + ...``) are evaluated in a loop and do not count
  towards ``MAX_DEPTH``; their length is bounded by ``MAX_NODES``.
* Static arguments (axis, keepdims, ord, shape, tensordot axes, diff's n, subscripts) must be
  literals; axis numbers and ``n`` are bounded by ``MAX_STATIC_INT``.

Output size is still bounded only by input size: ``jnp.outer(x, x)`` or broadcasting
(``x[:, None] * x``) is quadratic in ``x``, so the server must cap request sizes. Shape and
dtype errors surface when the function is traced (TypeError, ValueError, IndexError,
OverflowError for int literals beyond int32 without x64); the server maps them to 422.
"""

from __future__ import annotations

import ast
import keyword
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import jax
import jax.nn
import jax.numpy as jnp
import jax.scipy.special
import numpy as np

from dxcontract.errors import InvalidExpressionError
from dxserve.core.arity import wrong_count

__all__ = [
    "ALLOWED_CONSTANTS",
    "ALLOWED_FUNCTIONS",
    "ALLOWED_KEYWORDS",
    "MAX_ARGS",
    "MAX_DEPTH",
    "MAX_EXPRESSION_CHARS",
    "MAX_NODES",
    "Expression",
    "compile_expression",
]

MAX_EXPRESSION_CHARS = 10_000
MAX_NODES = 2_000
MAX_DEPTH = 64
MAX_ARGS = 16
MAX_ARG_NAME_CHARS = 64
MAX_STATIC_INT = 64  # bound on axis numbers and on jnp.diff's n
INT_LITERAL_BOUND = 2**63

_Closure = Callable[[tuple], Any]

# ---------------------------------------------------------------- whitelist
# Parameter kinds: an expression, or a static (compile-time literal) value.
_E, _SEQ, _LIT = "expr", "sequence of expressions", "numeric literal array"
_AXIS, _BOOL, _ORD, _N, _SHAPE, _AXES = "axis", "bool", "ord", "n", "shape", "axes"
# Parameter modes.
_POS, _ANY, _KW = "positional-only", "positional-or-keyword", "keyword-only"


@dataclass(frozen=True)
class _Sig:
    params: tuple[tuple[str, str, str], ...]  # (name, kind, mode)
    required: int


def _sig(required: int, *params: tuple[str, str, str]) -> _Sig:
    return _Sig(tuple(params), required)


_UNARY = _sig(1, ("x", _E, _POS))
_BINARY = _sig(2, ("x1", _E, _POS), ("x2", _E, _POS))
_AB = _sig(2, ("a", _E, _POS), ("b", _E, _POS))
_REDUCE = _sig(1, ("a", _E, _POS), ("axis", _AXIS, _ANY), ("keepdims", _BOOL, _KW))
_ALONG = _sig(1, ("a", _E, _POS), ("axis", _AXIS, _ANY))
_NN_AXIS = _sig(1, ("x", _E, _POS), ("axis", _AXIS, _ANY))

_UNARY_NAMES = (
    "sin cos tan arcsin arccos arctan sinh cosh tanh arcsinh arccosh arctanh "
    "exp exp2 expm1 log log1p log2 log10 sqrt cbrt square abs absolute sign reciprocal "
    "negative positive floor ceil trunc sinc deg2rad rad2deg logical_not isfinite isnan isinf"
).split()
_BINARY_NAMES = (
    "add subtract multiply divide power arctan2 hypot maximum minimum fmax fmin logaddexp "
    "heaviside logical_and logical_or logical_xor"
).split()

_SIGNATURES: dict[str, _Sig] = {
    **{f"jnp.{n}": _UNARY for n in _UNARY_NAMES},
    **{f"jnp.{n}": _BINARY for n in _BINARY_NAMES},
    "jnp.where": _sig(3, ("condition", _E, _POS), ("x", _E, _POS), ("y", _E, _POS)),
    "jnp.clip": _sig(1, ("arr", _E, _POS), ("min", _E, _ANY), ("max", _E, _ANY)),
    **{f"jnp.{n}": _REDUCE for n in "sum prod mean max min std var".split()},
    **{f"jnp.{n}": _ALONG for n in "cumsum cumprod sort".split()},
    "jnp.diff": _sig(1, ("a", _E, _POS), ("n", _N, _ANY), ("axis", _AXIS, _ANY)),
    **{f"jnp.{n}": _AB for n in "dot matmul outer inner vdot".split()},
    "jnp.tensordot": _sig(2, ("a", _E, _POS), ("b", _E, _POS), ("axes", _AXES, _ANY)),
    "jnp.trace": _sig(1, ("a", _E, _POS)),
    "jnp.transpose": _sig(1, ("a", _E, _POS), ("axes", _AXIS, _ANY)),
    "jnp.reshape": _sig(2, ("a", _E, _POS), ("shape", _SHAPE, _ANY)),
    "jnp.ravel": _sig(1, ("a", _E, _POS)),
    "jnp.squeeze": _ALONG,
    "jnp.expand_dims": _sig(2, ("a", _E, _POS), ("axis", _AXIS, _ANY)),
    "jnp.flip": _sig(1, ("m", _E, _POS), ("axis", _AXIS, _ANY)),
    "jnp.stack": _sig(1, ("arrays", _SEQ, _POS), ("axis", _AXIS, _ANY)),
    "jnp.concatenate": _sig(1, ("arrays", _SEQ, _POS), ("axis", _AXIS, _ANY)),
    "jnp.hstack": _sig(1, ("tup", _SEQ, _POS)),
    "jnp.vstack": _sig(1, ("tup", _SEQ, _POS)),
    "jnp.array": _sig(1, ("object", _LIT, _POS)),
    "jnp.asarray": _sig(1, ("a", _LIT, _POS)),
    "jnp.linalg.norm": _sig(
        1, ("x", _E, _POS), ("ord", _ORD, _ANY), ("axis", _AXIS, _ANY), ("keepdims", _BOOL, _ANY)
    ),
    "jnp.linalg.det": _sig(1, ("a", _E, _POS)),
    "jnp.linalg.inv": _sig(1, ("a", _E, _POS)),
    "jnp.linalg.solve": _AB,
    "jax.nn.softmax": _NN_AXIS,
    "jax.nn.log_softmax": _NN_AXIS,
    "jax.nn.logsumexp": _REDUCE,
    **{f"jax.nn.{n}": _UNARY for n in "sigmoid softplus relu silu".split()},
    "jax.scipy.special.logsumexp": _REDUCE,
    **{f"jax.scipy.special.{n}": _UNARY for n in "erf erfc expit logit gammaln".split()},
    "jax.scipy.special.xlogy": _sig(2, ("x", _E, _POS), ("y", _E, _POS)),
    "jax.scipy.special.xlog1py": _sig(2, ("x", _E, _POS), ("y", _E, _POS)),
}

_NAMESPACES = {
    "jnp": jnp,
    "jnp.linalg": jnp.linalg,
    "jax": jax,
    "jax.nn": jax.nn,
    "jax.scipy": jax.scipy,
    "jax.scipy.special": jax.scipy.special,
}


def _resolve(qualname: str) -> Callable[..., Any]:
    head, _, name = qualname.rpartition(".")
    return getattr(_NAMESPACES[head], name)  # only ever on names from our own table


_IMPLS: dict[str, Callable[..., Any]] = {
    name: (lambda value: value) if name in ("jnp.array", "jnp.asarray") else _resolve(name)
    for name in _SIGNATURES
}

_CONSTANTS: dict[str, float | None] = {
    "jnp.pi": math.pi,
    "jnp.e": math.e,
    "jnp.inf": math.inf,
    "jnp.nan": math.nan,
    "jnp.newaxis": None,  # subscripts only
}

#: Fully qualified names of every callable an expression may use.
ALLOWED_FUNCTIONS: frozenset[str] = frozenset(_SIGNATURES)
#: Fully qualified names of the constants an expression may use.
ALLOWED_CONSTANTS: frozenset[str] = frozenset(_CONSTANTS)
#: Keyword arguments accepted somewhere (values must be literals, except clip's min/max).
ALLOWED_KEYWORDS: frozenset[str] = frozenset(
    name for sig in _SIGNATURES.values() for name, _, mode in sig.params if mode != _POS
)

_CREATION = frozenset(
    "zeros ones full empty zeros_like ones_like full_like empty_like arange eye identity "
    "linspace logspace geomspace tri meshgrid indices tile repeat broadcast_to mgrid ogrid "
    "fromfunction".split()
)
_PREFIXES = frozenset(_NAMESPACES)
_RESERVED_ARGS = frozenset({"jnp", "jax"})
_ARG_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
_KEY_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.\-]{{0,{MAX_ARG_NAME_CHARS - 1}}}\Z")

_BINOPS: dict[type, tuple[str, Callable[..., Any]]] = {
    ast.Add: ("+", jnp.add),
    ast.Sub: ("-", jnp.subtract),
    ast.Mult: ("*", jnp.multiply),
    ast.Div: ("/", jnp.true_divide),
    ast.FloorDiv: ("//", jnp.floor_divide),
    ast.Mod: ("%", jnp.remainder),
    ast.Pow: ("**", jnp.power),
    ast.MatMult: ("@", jnp.matmul),
    ast.BitAnd: ("&", jnp.bitwise_and),
    ast.BitOr: ("|", jnp.bitwise_or),
    ast.BitXor: ("^", jnp.bitwise_xor),
}
_CMPOPS: dict[type, tuple[str, Callable[..., Any]]] = {
    ast.Lt: ("<", jnp.less),
    ast.LtE: ("<=", jnp.less_equal),
    ast.Gt: (">", jnp.greater),
    ast.GtE: (">=", jnp.greater_equal),
    ast.Eq: ("==", jnp.equal),
    ast.NotEq: ("!=", jnp.not_equal),
}
_REJECTED_OPS = {
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.In: "in",
    ast.NotIn: "not in",
}
_CONSTRUCTS: dict[type, str] = {
    ast.Lambda: "lambda",
    ast.ListComp: "comprehension",
    ast.SetComp: "comprehension",
    ast.DictComp: "comprehension",
    ast.GeneratorExp: "generator expression",
    ast.NamedExpr: "assignment expression",
    ast.JoinedStr: "f-string",
    ast.FormattedValue: "f-string",
    ast.Await: "await",
    ast.Yield: "yield",
    ast.YieldFrom: "yield",
    ast.Dict: "dict literal",
    ast.Set: "set literal",
    ast.Starred: "starred expression",
    ast.Slice: "slice outside a subscript",
}
_NOT_COUNTED = (ast.expr_context, ast.operator, ast.unaryop, ast.cmpop, ast.boolop)


# ---------------------------------------------------------------- compiler
class _Compiler:
    """Checks an AST against the whitelist and turns it into closures over ``env``."""

    def __init__(self, source: str, args: tuple[str, ...]) -> None:
        self.source = source
        self.lines = re.split(r"\r\n|\r|\n", source)
        self.index = {name: i for i, name in enumerate(args)}

    # -- errors and positions --------------------------------------------
    def _char_col(self, lineno: int, byte_col: int) -> int:
        """1-based character column from ast's 1-based line and 0-based UTF-8 offset."""
        line = self.lines[lineno - 1] if 0 < lineno <= len(self.lines) else ""
        return len(line.encode()[:byte_col].decode(errors="ignore")) + 1

    def fail(self, pos: tuple[int, int], token: str, message: str) -> NoReturn:
        line, col = pos[0], self._char_col(*pos)
        raise InvalidExpressionError(
            f"line {line}, col {col}: {message}",
            field="expression",
            token=token,
            line=line,
            col=col,
        )

    @staticmethod
    def pos(node: ast.AST) -> tuple[int, int]:
        return node.lineno, node.col_offset  # type: ignore[attr-defined]

    @staticmethod
    def attr_pos(node: ast.Attribute) -> tuple[int, int]:
        return node.end_lineno or node.lineno, (node.end_col_offset or 0) - len(node.attr.encode())

    def between(self, left: ast.AST, right: ast.AST, symbol: str) -> tuple[int, int]:
        """Position of an operator token lying between two operand nodes."""
        line, col = left.end_lineno, left.end_col_offset  # type: ignore[attr-defined]
        while line is not None and line <= right.lineno:  # type: ignore[attr-defined]
            raw = self.lines[line - 1].encode()
            stop = right.col_offset if line == right.lineno else len(raw)  # type: ignore[attr-defined]
            found = raw.find(symbol.encode(), col, stop)
            if found >= 0:
                return line, found
            line, col = line + 1, 0
        return self.pos(left)

    def segment(self, node: ast.AST) -> str:
        text = ast.get_source_segment(self.source, node) or type(node).__name__
        return text if len(text) <= 40 else text[:37] + "..."

    # -- expressions -------------------------------------------------------
    def expr(self, node: ast.expr) -> _Closure:
        method = getattr(self, "expr_" + type(node).__name__, None)
        if method is None:
            self.reject_construct(node)
        return method(node)

    def reject_construct(self, node: ast.AST) -> NoReturn:
        if isinstance(node, ast.BoolOp):
            word = "and" if isinstance(node.op, ast.And) else "or"
            pos = self.between(node.values[0], node.values[1], word)
            self.fail(pos, word, f"'{word}' is not allowed; use '&'/'|' or jnp.logical_{word}")
        if isinstance(node, (ast.List, ast.Tuple)):
            kind = "list" if isinstance(node, ast.List) else "tuple"
            token = "[" if kind == "list" else "("
            self.fail(
                self.pos(node),
                token,
                f"{kind} literal {self.segment(node)!r} is only allowed as the argument of "
                "jnp.array/jnp.asarray/jnp.stack/jnp.concatenate or as a literal shape/axis",
            )
        what = _CONSTRUCTS.get(type(node), type(node).__name__)
        token = {
            ast.Lambda: "lambda",
            ast.NamedExpr: ":=",
            ast.Await: "await",
            ast.Yield: "yield",
            ast.YieldFrom: "yield",
            ast.Starred: "*",
        }.get(type(node), self.segment(node))
        self.fail(self.pos(node), token, f"{what} is not allowed: {self.segment(node)!r}")

    def number(self, node: ast.Constant, allow_bool: bool = True) -> int | float | bool:
        value = node.value
        if isinstance(value, bool):
            if allow_bool:
                return value
        elif isinstance(value, int):
            if -INT_LITERAL_BOUND < value < INT_LITERAL_BOUND:
                return value
            self.fail(
                self.pos(node),
                self.segment(node),
                f"integer literal {self.segment(node)} exceeds 2**63 in magnitude",
            )
        elif isinstance(value, float):
            if math.isfinite(value):
                return value
            self.fail(
                self.pos(node),
                self.segment(node),
                f"float literal {self.segment(node)} is not finite; use jnp.inf",
            )
        token = self.segment(node)
        if isinstance(value, (str, bytes)):
            kind = "string" if isinstance(value, str) else "bytes"
            self.fail(self.pos(node), token, f"{kind} literal {token} is not allowed")
        if isinstance(value, complex):
            self.fail(self.pos(node), token, f"complex literal {token} is not allowed")
        if value is None or value is Ellipsis:
            self.fail(
                self.pos(node),
                token,
                f"'{token}' is only allowed inside a subscript or as a keyword value",
            )
        self.fail(self.pos(node), token, f"literal {token} is not allowed here")

    def folded_number(self, node: ast.expr) -> int | float | None:
        """A numeric literal, possibly negated (``-1``); None if ``node`` is not one."""
        sign = 1
        while isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            sign = -sign if isinstance(node.op, ast.USub) else sign
            node = node.operand
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            value = self.number(node, allow_bool=False)
            return -value if sign < 0 else value
        return None

    def expr_Constant(self, node: ast.Constant) -> _Closure:
        value = self.number(node)
        return lambda env: value

    def expr_Name(self, node: ast.Name) -> _Closure:
        name = node.id
        if name in self.index:
            i = self.index[name]
            return lambda env: env[i]
        self.bad_name(node)

    def bad_name(self, node: ast.Name) -> NoReturn:
        name = node.id
        if name.startswith("__"):
            self.fail(
                self.pos(node), name, f"name '{name}' is not allowed (dunder names never are)"
            )
        if name in _RESERVED_ARGS:
            self.fail(self.pos(node), name, f"namespace '{name}' cannot be used as a value")
        self.fail(
            self.pos(node),
            name,
            f"unknown name '{name}'; only the declared args and jnp.<function> calls are allowed",
        )

    def resolve(self, node: ast.Attribute) -> str:
        """Validate an attribute chain and return its dotted path (``jnp.linalg.norm``)."""
        attrs: list[ast.Attribute] = []
        base: ast.expr = node
        while isinstance(base, ast.Attribute):
            attrs.append(base)
            base = base.value
        attrs.reverse()
        for attr in attrs:
            if attr.attr.startswith("__"):
                self.fail(
                    self.attr_pos(attr),
                    attr.attr,
                    f"attribute '{attr.attr}' is not allowed (dunder names never are)",
                )
        first = attrs[0]
        if not isinstance(base, ast.Name):
            self.fail(
                self.attr_pos(first),
                first.attr,
                f"attribute '{first.attr}' is not allowed; only jnp.<name> paths are",
            )
        if base.id in self.index:
            self.fail(
                self.attr_pos(first),
                first.attr,
                f"attribute '{first.attr}' of argument '{base.id}' is not allowed; "
                "only jnp.<name> paths are",
            )
        if base.id not in _RESERVED_ARGS:
            self.bad_name(base)
        path = base.id
        for attr in attrs:
            path = f"{path}.{attr.attr}"
            if attr is not attrs[-1] and path not in _PREFIXES:
                hint = "; write jnp.<name>" if path == "jax.numpy" else ""
                self.fail(
                    self.attr_pos(attr), attr.attr, f"namespace '{path}' is not allowed{hint}"
                )
        if path not in _SIGNATURES and path not in _CONSTANTS:
            last = attrs[-1]
            if last.attr in _CREATION:
                why = "array-creation functions that take a shape are excluded"
            else:
                why = "see ALLOWED_FUNCTIONS / ALLOWED_CONSTANTS"
            self.fail(self.attr_pos(last), last.attr, f"'{path}' is not allowed ({why})")
        return path

    def expr_Attribute(self, node: ast.Attribute) -> _Closure:
        path = self.resolve(node)
        if path in _SIGNATURES:
            self.fail(self.attr_pos(node), node.attr, f"function '{path}' must be called")
        if path == "jnp.newaxis":
            self.fail(self.attr_pos(node), node.attr, "'jnp.newaxis' is only allowed in subscripts")
        value = _CONSTANTS[path]
        return lambda env: value

    def expr_UnaryOp(self, node: ast.UnaryOp) -> _Closure:
        if isinstance(node.op, ast.Not):
            self.fail(self.pos(node), "not", "'not' is not allowed; use '~' or jnp.logical_not")
        folded = self.folded_number(node)
        if folded is not None:
            return lambda env: folded
        fn = {ast.USub: jnp.negative, ast.UAdd: jnp.positive, ast.Invert: jnp.invert}[type(node.op)]
        operand = self.expr(node.operand)
        return lambda env: fn(operand(env))

    def expr_BinOp(self, node: ast.BinOp) -> _Closure:
        # A left-deep chain (a + b + c + ...) is compiled and evaluated as a loop, so long
        # sums do not count against MAX_DEPTH or the Python stack.
        spine: list[ast.BinOp] = []
        base: ast.expr = node
        while isinstance(base, ast.BinOp):
            spine.append(base)
            base = base.left
        first = self.expr(base)
        steps: list[tuple[Callable[..., Any], _Closure]] = []
        for link in reversed(spine):
            if type(link.op) not in _BINOPS:
                symbol = _REJECTED_OPS.get(type(link.op), type(link.op).__name__)
                pos = self.between(link.left, link.right, symbol)
                self.fail(pos, symbol, f"operator '{symbol}' is not allowed")
            if isinstance(link.op, ast.Pow) and _literal_power(link.right):
                self.fail(
                    self.between(link.left, link.right, "**"),
                    "**",
                    "'**' with a literal power tower as exponent is not allowed; write the number",
                )
            steps.append((_BINOPS[type(link.op)][1], self.expr(link.right)))

        def chain(env: tuple) -> Any:
            value = first(env)
            for fn, right in steps:
                value = fn(value, right(env))
            return value

        return chain

    def expr_Compare(self, node: ast.Compare) -> _Closure:
        operands = [node.left, *node.comparators]
        fns = []
        for op, lhs, rhs in zip(node.ops, operands, operands[1:], strict=False):
            if type(op) not in _CMPOPS:
                symbol = _REJECTED_OPS[type(op)]
                word = symbol.split()[0]
                self.fail(
                    self.between(lhs, rhs, word), symbol, f"operator '{symbol}' is not allowed"
                )
            fns.append(_CMPOPS[type(op)][1])
        closures = [self.expr(operand) for operand in operands]

        def compare(env: tuple) -> Any:
            values = [c(env) for c in closures]
            result = fns[0](values[0], values[1])
            for fn, lhs, rhs in zip(fns[1:], values[1:], values[2:], strict=False):
                result = jnp.logical_and(result, fn(lhs, rhs))
            return result

        return compare

    def expr_IfExp(self, node: ast.IfExp) -> _Closure:
        body = self.expr(node.body)  # source order: body, test, orelse
        test = self.expr(node.test)
        orelse = self.expr(node.orelse)
        return lambda env: jnp.where(test(env), body(env), orelse(env))

    def expr_Subscript(self, node: ast.Subscript) -> _Closure:
        value = self.expr(node.value)
        key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            # a pytree key (x["w"]): the only place a string may appear, and only whole
            name = self.pytree_key(key)
            return lambda env: value(env)[name]
        index = self.static_index(node.slice)
        return lambda env: value(env)[index]

    def pytree_key(self, node: ast.Constant) -> str:
        """A string subscript: a dict key of a pytree input, ASCII, not reserved."""
        name = node.value
        if name.startswith("_") or not _KEY_RE.match(name):
            self.fail(
                self.pos(node),
                self.segment(node),
                f"key {self.segment(node)} is not allowed; pytree keys in subscripts are "
                f"up to {MAX_ARG_NAME_CHARS} ASCII letters, digits, '_', '-' or '.', "
                "not starting with '_'",
            )
        return name

    def expr_Call(self, node: ast.Call) -> _Closure:
        func = node.func
        if isinstance(func, ast.Name):
            if func.id in self.index:
                self.fail(self.pos(func), func.id, f"argument '{func.id}' is not callable")
            self.bad_name(func)
        if not isinstance(func, ast.Attribute):
            self.fail(
                self.pos(func),
                self.segment(func),
                f"call of {self.segment(func)!r} is not allowed; only jnp.<function> calls are",
            )
        path = self.resolve(func)
        if path not in _SIGNATURES:
            self.fail(self.attr_pos(func), func.attr, f"'{path}' is a constant, not a function")
        sig, impl = _SIGNATURES[path], _IMPLS[path]
        params = {name: (kind, mode) for name, kind, mode in sig.params}
        positional_slots = [p for p in sig.params if p[2] != _KW]
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                self.fail(self.pos(arg), "*", "starred arguments are not allowed")
        if len(node.args) > len(positional_slots):
            extra = node.args[len(positional_slots)]
            self.fail(
                self.pos(extra),
                self.segment(extra),
                f"'{path}' takes at most {len(positional_slots)} positional arguments",
            )
        bound = {p[0] for p in positional_slots[: len(node.args)]}
        pos_fns = [
            self.argument(path, kind, arg)
            for (_, kind, _), arg in zip(positional_slots, node.args, strict=False)
        ]
        kw_fns: dict[str, _Closure] = {}
        for kw in node.keywords:
            if kw.arg is None:
                self.fail(self.pos(kw), "**", "'**' keyword unpacking is not allowed")
            if kw.arg not in params or params[kw.arg][1] == _POS:
                self.fail(
                    self.pos(kw), kw.arg, f"keyword argument '{kw.arg}' is not allowed for '{path}'"
                )
            if kw.arg in bound:
                self.fail(self.pos(kw), kw.arg, f"argument '{kw.arg}' given twice")
            bound.add(kw.arg)
            kw_fns[kw.arg] = self.argument(path, params[kw.arg][0], kw.value)
        missing = [name for name, _, _ in sig.params[: sig.required] if name not in bound]
        if missing:
            self.fail(
                self.attr_pos(func), func.attr, f"'{path}' is missing argument '{missing[0]}'"
            )
        if not kw_fns:
            if len(pos_fns) == 1:
                (a,) = pos_fns
                return lambda env: impl(a(env))
            if len(pos_fns) == 2:
                a, b = pos_fns
                return lambda env: impl(a(env), b(env))
        return lambda env: impl(
            *[f(env) for f in pos_fns], **{k: f(env) for k, f in kw_fns.items()}
        )

    # -- arguments and static values -----------------------------------
    def argument(self, path: str, kind: str, node: ast.expr) -> _Closure:
        if kind == _E:
            return self.expr(node)
        if kind == _SEQ:
            if not isinstance(node, (ast.List, ast.Tuple)) or not node.elts:
                self.fail(
                    self.pos(node),
                    self.segment(node),
                    f"'{path}' needs a non-empty list literal of expressions",
                )
            items = [self.expr(elt) for elt in node.elts]
            return lambda env: [item(env) for item in items]
        if kind == _LIT:
            return self.literal_array(path, node)
        value = self.static(kind, node)
        return lambda env: value

    def literal_array(self, path: str, node: ast.expr) -> _Closure:
        def tree(n: ast.expr) -> Any:
            if isinstance(n, (ast.List, ast.Tuple)):
                return [tree(elt) for elt in n.elts]
            if isinstance(n, ast.Constant) and isinstance(n.value, bool):
                return n.value
            if isinstance(n, ast.Attribute) and self.resolve(n) in _CONSTANTS:
                value = _CONSTANTS[self.resolve(n)]
                if value is not None:
                    return value
            folded = self.folded_number(n)
            if folded is not None:
                return folded
            if isinstance(n, ast.Constant):
                self.number(n)  # raises with the precise reason (string, None, ...)
            self.fail(
                self.pos(n),
                self.segment(n),
                f"'{path}' only accepts (nested lists of) numeric literals; "
                "use jnp.stack for expressions",
            )

        try:
            array = np.asarray(tree(node))
        except (ValueError, OverflowError) as exc:
            self.fail(self.pos(node), self.segment(node), f"bad array literal: {exc}")
        if array.dtype.kind not in "biuf":
            self.fail(self.pos(node), self.segment(node), "array literal must be numeric")
        if array.dtype.kind == "f":

            def floats(env: tuple) -> Any:
                first = jax.tree_util.tree_leaves(env[0])  # x may be a pytree
                dt = first[0].dtype if first else None
                dtype = dt if dt is not None and jnp.issubdtype(dt, jnp.floating) else None
                return jnp.asarray(array, dtype=dtype)

            return floats
        return lambda env: jnp.asarray(array)

    def static_int(self, node: ast.expr, low: int | None = None, high: int | None = None) -> int:
        value = self.folded_number(node)
        if not isinstance(value, int):
            self.fail(
                self.pos(node),
                self.segment(node),
                f"expected an integer literal, got {self.segment(node)!r}",
            )
        if (low is not None and value < low) or (high is not None and value > high):
            self.fail(
                self.pos(node),
                self.segment(node),
                f"integer {value} is out of range [{low}, {high}]",
            )
        return value

    def static_ints(
        self, node: ast.expr, low: int | None, high: int | None
    ) -> int | tuple[int, ...]:
        if isinstance(node, (ast.Tuple, ast.List)):
            return tuple(self.static_int(elt, low, high) for elt in node.elts)
        return self.static_int(node, low, high)

    def static(self, kind: str, node: ast.expr) -> Any:
        if kind == _BOOL:
            if isinstance(node, ast.Constant) and isinstance(node.value, bool):
                return node.value
            self.fail(self.pos(node), self.segment(node), "expected True or False")
        if kind in (_AXIS, _ORD) and isinstance(node, ast.Constant) and node.value is None:
            return None
        if kind == _AXIS:
            return self.static_ints(node, -MAX_STATIC_INT, MAX_STATIC_INT)
        if kind == _N:
            return self.static_int(node, 0, MAX_STATIC_INT)
        if kind == _SHAPE:
            return self.static_ints(node, -1, None)
        if kind == _AXES:
            if isinstance(node, (ast.Tuple, ast.List)) and len(node.elts) == 2:
                first, second = node.elts
                return (
                    self.static_ints(first, -MAX_STATIC_INT, MAX_STATIC_INT),
                    self.static_ints(second, -MAX_STATIC_INT, MAX_STATIC_INT),
                )
            return self.static_int(node, 0, MAX_STATIC_INT)
        # _ORD: a number or +-jnp.inf
        sign, inner = 1, node
        if isinstance(inner, ast.UnaryOp) and isinstance(inner.op, ast.USub):
            sign, inner = -1, inner.operand
        if isinstance(inner, ast.Attribute) and self.resolve(inner) == "jnp.inf":
            return sign * math.inf
        value = self.folded_number(node)
        if value is None:
            self.fail(self.pos(node), self.segment(node), "ord must be a number, jnp.inf or None")
        return value

    def static_index(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Tuple):
            return tuple(self.static_index_item(elt) for elt in node.elts)
        return self.static_index_item(node)

    def static_index_item(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Slice):
            parts = []
            for part in (node.lower, node.upper, node.step):
                parts.append(None if part is None else self.static_int(part))
            return slice(*parts)
        if isinstance(node, ast.Constant) and (node.value is None or node.value is Ellipsis):
            return node.value
        if isinstance(node, ast.Attribute) and self.resolve(node) == "jnp.newaxis":
            return None
        value = self.folded_number(node)
        if isinstance(value, int):
            return value
        if isinstance(node, ast.Constant):
            self.number(node)
        self.fail(
            self.pos(node),
            self.segment(node),
            f"index {self.segment(node)!r} is not allowed; subscripts take integer literals, "
            "slices of them, None/jnp.newaxis and ...",
        )


def _literal_power(node: ast.expr) -> bool:
    """True if ``node`` is built only from literals and contains a ``**``."""
    has_pow = False
    for sub in ast.walk(node):
        if isinstance(sub, ast.BinOp):
            has_pow = has_pow or isinstance(sub.op, ast.Pow)
        elif not isinstance(sub, (ast.Constant, ast.UnaryOp, *_NOT_COUNTED)):
            return False
    return has_pow


# ---------------------------------------------------------------- public API
def _check_args(args: Any) -> tuple[str, ...]:
    def bad(token: Any, message: str) -> NoReturn:
        raise InvalidExpressionError(message, field="args", token=str(token)[:64])

    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        bad(args, "args must be a list of argument names")
    args = tuple(args)
    if not 1 <= len(args) <= MAX_ARGS:
        bad(len(args), f"args must name between 1 and {MAX_ARGS} arguments, got {len(args)}")
    seen: set[str] = set()
    for name in args:
        if not isinstance(name, str):
            bad(name, f"argument name {name!r} is not a string")
        if len(name) > MAX_ARG_NAME_CHARS:
            bad(name, f"argument name '{name[:64]}' is longer than {MAX_ARG_NAME_CHARS} characters")
        if name.startswith("_"):
            bad(name, f"argument name '{name}' may not start with an underscore")
        if not _ARG_RE.match(name) or keyword.iskeyword(name):
            bad(name, f"argument name '{name}' is not a valid ASCII identifier")
        if name in _RESERVED_ARGS:
            bad(name, f"argument name '{name}' is reserved")
        if name in seen:
            bad(name, f"argument name '{name}' is repeated")
        seen.add(name)
    return args


def _syntax_error(source: str, exc: SyntaxError) -> InvalidExpressionError:
    line = exc.lineno or 1
    col = max(exc.offset or 1, 1)
    text = exc.text or ""
    match = re.compile(r"\w+|\S").search(text, col - 1) if text else None
    token = match.group(0) if match else ""
    return InvalidExpressionError(
        f"line {line}, col {col}: syntax error: {exc.msg}" + (f" at {token!r}" if token else ""),
        field="expression",
        token=token,
        line=line,
        col=col,
    )


#: CPython 3.11's ``ast.parse`` is not thread-safe: the C-to-Python AST conversion keeps
#: its recursion depth in interpreter-wide state, so two threads parsing at once can fail
#: with ``SystemError: AST constructor recursion depth mismatch``. Registrations run on a
#: thread pool, so every parse here takes this lock (a parse of the longest allowed
#: expression takes well under a millisecond).
_PARSE_LOCK = threading.Lock()


def _compile(source: Any, args: tuple[str, ...]) -> _Closure:
    if not isinstance(source, str):
        raise InvalidExpressionError("expression must be a string", field="expression")
    if len(source) > MAX_EXPRESSION_CHARS:
        raise InvalidExpressionError(
            f"expression has {len(source)} characters; the limit is {MAX_EXPRESSION_CHARS}",
            field="expression",
            token=source[:20],
            limit=MAX_EXPRESSION_CHARS,
        )
    try:
        with _PARSE_LOCK:
            tree = ast.parse(source, mode="eval")
    except SyntaxError as exc:
        raise _syntax_error(source, exc) from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise InvalidExpressionError(
            f"expression cannot be parsed ({type(exc).__name__}: {exc or 'nested too deeply'})",
            field="expression",
        ) from None
    compiler = _Compiler(source, args)
    count, stack = 0, [(tree.body, 1)]
    dunders: list[tuple[int, int, str, ast.AST]] = []
    while stack:  # iterative: the tree may be thousands deep
        node, depth = stack.pop()
        count += 1
        if isinstance(node, ast.Name) and node.id.startswith("__"):
            dunders.append((*compiler.pos(node), node.id, node))
        elif isinstance(node, ast.Attribute) and node.attr.startswith("__"):
            dunders.append((*compiler.attr_pos(node), node.attr, node))
        if count > MAX_NODES:
            compiler.fail(
                compiler.pos(tree.body), "", f"expression has more than {MAX_NODES} nodes"
            )
        if depth > MAX_DEPTH:
            compiler.fail(
                compiler.pos(node),
                compiler.segment(node),
                f"expression is nested deeper than {MAX_DEPTH} levels",
            )
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, _NOT_COUNTED):
                left_spine = isinstance(node, ast.BinOp) and child is node.left
                stack.append((child, depth if left_spine else depth + 1))
    if dunders:  # reported first, wherever they are: the leftmost one
        line, col, name, _ = min(dunders, key=lambda d: (d[0], d[1]))
        compiler.fail((line, col), name, f"'{name}' is not allowed (dunder names never are)")
    return compiler.expr(tree.body)


@dataclass(frozen=True)
class Expression:
    """A validated expression; call it as ``f(x, *contexts)`` (JAX-traceable)."""

    source: str
    args: tuple[str, ...] = ("x",)
    _fn: _Closure = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        args = _check_args(self.args)
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "_fn", _compile(self.source, args))

    def __call__(self, x: Any, *contexts: Any) -> jax.Array:
        if len(contexts) != len(self.args) - 1:
            raise wrong_count("the expression", self.args[1:], len(self.args) - 1, len(contexts))
        env = tuple(
            jax.tree_util.tree_map(jnp.asarray, value)
            if isinstance(value, dict | list | tuple) else jnp.asarray(value)
            for value in (x, *contexts)
        )  # pytree inputs stay pytrees: subscripts (x["w"], x[0]) reach their leaves
        return jnp.asarray(self._fn(env))


def compile_expression(source: str, args: Sequence[str] = ("x",)) -> Expression:
    """Validate ``source`` against the whitelist and return a callable ``Expression``."""
    return Expression(source, _check_args(args))
