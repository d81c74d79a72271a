"""What a registered function takes, which operators it serves, and a request to try.

``GET /functions/{name}`` shows, besides the kind's own ``signature``:

* ``arguments``: each argument's name, role (``x`` or ``context``) and, where known,
  ``shape`` and ``dtype`` (``tree``, the leaves' shapes and dtypes, for a pytree);
* ``output``: the shape and dtype of ``f(x, *contexts)``, where known;
* ``shapes_from``: where the shapes come from: ``export`` (an upload's signature: the
  shapes it requires; a string dimension is symbolic), ``example`` (a module function's
  registered example), ``annotations`` (its parameter annotations) or ``probe`` (an
  expression evaluated on small arrays at registration); null when unknown;
* ``operators``: the operators these shapes allow (all of them when unknown; for an
  expression, those that some shapes it was traced on allow);
* ``example``: ``{"path", "body"}``, a request to POST as it is, or null.

Shapes are JSON tree specs (``dxcontract.bundle.tree_spec``): ``{"shape": [3], "dtype":
"float64"}`` for an array, ``{"dict": {...}}``, ``{"list": [...]}``, ``{"tuple": [...]}``
for pytrees. An export's come from its signature; another kind's build gives them as
``Built.facts`` (``{"x", "contexts", "output", "from", "example"}``; see ``facts``),
which the store keeps with the function's signature.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dxcontract import codec
from dxcontract.bundle import tree_spec
from dxcontract.keys import KeyArray, impl_of, is_key_dtype
from dxcontract.operators import OPERATORS
from dxserve.frameworks import DEFAULT, framework_of, get_framework

#: An example request is given for inputs of at most this many numbers in all.
MAX_EXAMPLE_ELEMENTS = 1024
#: The size a symbolic dimension takes in an example.
SYMBOLIC_SIZE = 3
#: Operators that need a scalar x, a scalar-valued function, arrays (not pytrees).
_SCALAR_X = frozenset(n for n, op in OPERATORS.items() if op.scalar_input)
_SCALAR_Y = frozenset(n for n, op in OPERATORS.items() if op.scalar_output)
_ARRAYS = frozenset(n for n, op in OPERATORS.items() if op.arrays_only)


def facts(
    fn: Callable, args: Sequence[Any], source: str, example: Sequence[Any] | None = None
) -> dict[str, Any] | None:
    """What ``describe`` shows of ``fn`` called on ``args`` (arrays or ``jax.ShapeDtypeStruct``s,
    ``(x, *contexts)``): their specs and the output's by ``jax.eval_shape`` (another
    framework's ``eval_shape``, on its own ``spec``s, for a function written in it:
    torch's runs on meta tensors), and the example's JSON (when ``example`` holds values). None if ``fn``
    cannot be traced on them. Call it in float64 scope: float64 examples stay float64."""
    from dxserve.frameworks.jax.specs import spec_tree

    try:
        specs = [spec_tree(a) for a in args]
        framework = framework_of(fn)
        if framework.name == DEFAULT:
            output = framework.eval_shape(fn, *specs)
        else:  # another framework gets specs of its own kind (``Framework.spec``)
            own = get_framework(DEFAULT).tree_map(
                lambda s: framework.spec(tuple(s.shape), s.dtype), specs
            )
            output = framework.eval_shape(fn, *own)
        found: dict[str, Any] = {
            "x": tree_spec(specs[0], "x"),
            "contexts": [tree_spec(c, f"contexts[{i}]") for i, c in enumerate(specs[1:])],
            "output": tree_spec(output, "output"),
            "from": source,
        }
    except Exception:  # a black box, or arguments it does not take: nothing is known
        return None
    if example is not None and _elements(found["x"], found["contexts"]) <= MAX_EXAMPLE_ELEMENTS:
        try:
            found["example"] = {
                "x": _json(example[0]),
                "contexts": [_json(c) for c in example[1:]],
            }
        except Exception:  # values the wire cannot carry: the shapes alone are shown
            pass
    return found


def annotated_args(fn: Callable) -> list[Any] | None:
    """``fn``'s parameters as ``jax.ShapeDtypeStruct``s from their annotations, when every
    one has such an annotation; else None. The documented form is jaxtyping's,
    ``Float[Array, "3"]`` (``Float64[Array, "n 2"]``: a named dimension is symbolic, and
    a float annotation that allows float64 is float64); a ``ShapeDtypeStruct``, an
    array, and ``float`` (a float64 scalar) are read too. Anything else (a bare type, a
    string such as ``"float64[3]"``) declares no shapes, and the server's log says so."""
    framework = get_framework(DEFAULT)  # annotations are read as JAX specs (its own ``spec``)

    try:
        params = list(inspect.signature(fn, eval_str=True).parameters.values())
    except Exception:  # unresolvable string annotations, builtins without a signature
        return None
    out = []
    scope = _SymbolicScope()
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) or p.default is not p.empty:
            continue
        note = p.annotation
        if note is float:
            out.append(framework.spec((), np.float64))
            continue
        if _is_jaxtyping(note):
            index = _jaxtyping_spec(note, scope)
            if index is None:
                return None
            out.append(index)  # replaced by its spec once every name is known
            continue
        if isinstance(note, type) or not (hasattr(note, "shape") and hasattr(note, "dtype")):
            return None  # a type (jax.Array, np.ndarray) says no shape
        try:
            out.append(framework.spec(tuple(note.shape), np.dtype(note.dtype)))
        except (TypeError, ValueError):
            return None
    if scope.pending:
        try:
            specs = scope.specs()
        except Exception:  # a name jax.export cannot parse
            return None
        out = [specs[a] if isinstance(a, int) else a for a in out]
    return out or None


def _is_jaxtyping(note: Any) -> bool:
    """A jaxtyping array annotation (``Float[Array, "3"]``), read by its documented
    attributes (``dim_str``, ``dtypes``) so the server needs no jaxtyping itself."""
    return isinstance(getattr(note, "dim_str", None), str) and isinstance(
        getattr(note, "dtypes", None), (tuple, list)
    )


class _SymbolicScope:
    """Named dimensions of one function's annotations: the same name, the same symbol
    (``jax.export`` symbols compare equal only within one scope)."""

    def __init__(self) -> None:
        self.pending: list[tuple[list[str], Any]] = []  # (dims, dtype) per argument

    def add(self, dims: list[str], dtype: Any) -> int:
        self.pending.append((dims, dtype))
        return len(self.pending) - 1

    def specs(self) -> list[Any]:
        from dxserve.frameworks.jax.specs import symbolic_specs

        return symbolic_specs(self.pending)


def _jaxtyping_spec(note: Any, scope: _SymbolicScope) -> int | None:
    """Where ``note``'s shape waits in ``scope`` (its index), or None if it declares none."""
    dims = note.dim_str.split()
    if any(not (d.isdigit() or d.isidentifier()) for d in dims):
        return None  # "*batch", "n+1", "...": not a declared shape
    dtypes = [str(d) for d in note.dtypes]
    dtype = next((d for d in ("float64", "float32", "int64", "int32", "bool") if d in dtypes), None)
    if dtype is None:
        return None
    return scope.add(dims, np.dtype(dtype))


def declared_shapes_problem(
    facts: dict[str, Any] | None,
    names: Sequence[str],
    x: Any,
    contexts: Sequence[Any],
    signature: dict[str, Any] | None = None,
) -> tuple[str, str] | None:
    """``(field, detail)`` when an argument's shape is not the one its function declares
    (``facts`` from its annotations, or an upload's signature); None when they agree or
    nothing is declared (pytrees are left to the upload's own leaf checks).
    Example shapes are only an example and are not checked here (``example_shapes_hint``)."""
    source = {"annotations": "its annotations", "export": "its upload's signature"}
    facts = _known(signature or {}, facts)  # an upload's shapes are in its signature
    if not isinstance(facts, dict) or facts.get("from") not in source:
        return None
    found = _first_difference(facts, x, contexts)
    if found is None:
        return None
    i, given, declared = found
    field, who = _argument(i, names)
    return field, (
        f"{who} has shape {_shape_words(given)}, but the function declares "
        f"{_shape_words(declared)} ({source[facts['from']]}); send an array of that shape"
    )


def example_shapes_hint(
    facts: dict[str, Any] | None,
    names: Sequence[str],
    x: Any,
    contexts: Sequence[Any],
    signature: dict[str, Any] | None = None,
) -> tuple[str, str] | None:
    """``(field, words)`` naming the argument whose shape differs from the function's
    example (or declaration), for an evaluation that failed; None if all agree."""
    facts = _known(signature or {}, facts)
    if not isinstance(facts, dict) or not isinstance(facts.get("x"), dict):
        return None
    found = _first_difference(facts, x, contexts)
    if found is None:
        return None
    i, given, expected = found
    field, who = _argument(i, names)
    source = {"example": "its example", "annotations": "its annotations"}.get(
        str(facts.get("from")), "the shapes it was described with"
    )
    return field, (
        f"{who} has shape {_shape_words(given)}, where {source} has "
        f"{_shape_words(expected)}, and the function fails on it"
    )


def _argument(i: int, names: Sequence[str]) -> tuple[str, str]:
    field = "x" if i == 0 else f"contexts[{i - 1}]"
    name = names[i] if i < len(names) else None
    return field, field if name in (None, field) else f"{field} ({name})"


def _shape_words(shape: Sequence[Any]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _first_difference(
    facts: dict[str, Any], x: Any, contexts: Sequence[Any]
) -> tuple[int, list, list] | None:
    """The first argument (0: x, i: contexts[i - 1]) whose array shape differs from its
    spec in ``facts``: ``(i, given, expected)``; named dimensions must agree across
    arguments. Pytrees and arguments without a spec are not compared."""
    specs = [facts.get("x"), *list(facts.get("contexts") or [])]
    sizes: dict[str, int] = {}
    for i, (value, spec) in enumerate(zip([x, *contexts], specs, strict=False)):
        if not isinstance(spec, dict) or "shape" not in spec or not isinstance(spec["shape"], list):
            continue
        given = getattr(value, "shape", None)
        if given is None:
            try:
                given = np.shape(value)
            except Exception:  # not an array: the function's own checks apply
                continue
        given = [int(d) for d in given]
        expected = spec["shape"]
        if len(given) != len(expected):
            return i, given, expected
        for g, e in zip(given, expected, strict=True):
            if isinstance(e, int) and g != e:
                return i, given, expected
            if isinstance(e, str) and e.isidentifier():
                if sizes.setdefault(e, g) != g:
                    return i, given, expected
    return None


def describe(
    name: str, signature: dict[str, Any], facts: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``arguments``, ``output``, ``shapes_from``, ``operators`` and ``example`` of the
    function ``name`` with this kind's ``signature`` and its build's ``facts``."""
    known = _known(signature, facts)
    names = _argument_names(signature, known)
    arguments = []
    for i, arg in enumerate(names):
        spec = None
        if known is not None:
            spec = (
                known["x"]
                if i == 0
                else (known["contexts"][i - 1] if i - 1 < len(known["contexts"]) else None)
            )
        arguments.append({"name": arg, "role": "x" if i == 0 else "context", **_shape_of(spec)})
    operators = _operators(known)
    return {
        "arguments": arguments,
        "output": _shape_of(known["output"]) if known and known.get("output") else None,
        "shapes_from": known["from"] if known else None,
        "operators": operators,
        "example": _example(name, known, operators),
    }


# --- reading what is known ----------------------------------------------------------------
def _known(signature: dict[str, Any], facts: dict[str, Any] | None) -> dict[str, Any] | None:
    if isinstance(facts, dict) and isinstance(facts.get("x"), dict):
        return facts
    manifest = signature.get("signature")  # an export's: its manifest's signature
    if isinstance(manifest, dict) and isinstance(manifest.get("x"), dict):
        return {
            "x": manifest["x"],
            "contexts": list(manifest.get("contexts") or []),
            "output": manifest.get("output"),
            "from": "export",
        }
    return None


def _argument_names(signature: dict[str, Any], known: dict[str, Any] | None) -> list[str]:
    args = signature.get("args")
    if isinstance(args, list) and args and all(isinstance(a, str) for a in args):
        return args
    count = 1 + (len(known["contexts"]) if known else 0)
    return ["x", *(f"contexts[{i}]" for i in range(count - 1))]


def _shape_of(spec: Any) -> dict[str, Any]:
    if isinstance(spec, dict) and "shape" in spec:
        return {"shape": spec["shape"], "dtype": spec.get("dtype")}
    if isinstance(spec, dict):
        return {"shape": None, "dtype": None, "tree": spec}
    return {"shape": None, "dtype": None}


def _operators(known: dict[str, Any] | None) -> list[str]:
    # a probe's shapes are one guess among many (W @ x on two vectors is a scalar): it
    # lists what every shape it found allows
    if known is not None and isinstance(known.get("operators"), list):
        return [op for op in OPERATORS if op in known["operators"]]
    if known is None or known.get("from") == "probe":
        return list(OPERATORS)
    return allowed_operators(known)


def allowed_operators(known: dict[str, Any] | None) -> list[str]:
    """The operators that the shapes of ``known`` (``facts``) allow: all when unknown."""
    if known is None:
        return list(OPERATORS)
    x, y = known["x"], known.get("output")
    x_array, y_array = "shape" in x, isinstance(y, dict) and "shape" in y
    allowed = []
    for name in OPERATORS:
        if name in _SCALAR_X and not (x_array and x["shape"] == []):
            continue
        if name in _SCALAR_Y and y is not None and not (y_array and y["shape"] == []):
            continue
        if name in _ARRAYS and not (x_array and (y is None or y_array)):
            continue
        allowed.append(name)
    return allowed


def _example(name: str, known: dict[str, Any] | None, operators: list[str]) -> dict | None:
    if known is None:
        return None
    # the operator the shown shapes allow (a probe's list may hold others' operators)
    fits = allowed_operators(known)
    operator = next(
        (op for op in ("gradient", "jacobian", "value") if op in operators and op in fits), None
    )
    if operator is None or _elements(known["x"], known["contexts"]) > MAX_EXAMPLE_ELEMENTS:
        return None
    given = known.get("example")
    if isinstance(given, dict):
        x, contexts = given["x"], given["contexts"]
    else:
        x = _json(_filled(known["x"]))
        contexts = [_json(_filled(c)) for c in known["contexts"]]
    body: dict[str, Any] = {"function": name, "backend": "auto", "x": x}
    if contexts:
        body["contexts"] = contexts
    return {"path": f"/{operator}", "body": body}


# --- specs and values ---------------------------------------------------------------------
def _leaves(spec: Any) -> list[dict]:
    if not isinstance(spec, dict):
        return []
    if "shape" in spec:
        return [spec]
    children = spec.get("dict", spec.get("list", spec.get("tuple", [])))
    values = children.values() if isinstance(children, dict) else children
    return [leaf for child in values for leaf in _leaves(child)]


def _size(dim: Any) -> int:
    return dim if isinstance(dim, int) else SYMBOLIC_SIZE


def _elements(x: Any, contexts: Sequence[Any]) -> int:
    return sum(
        math.prod(_size(d) for d in leaf["shape"])
        for spec in (x, *contexts)
        for leaf in _leaves(spec)
    )


def _filled(spec: Any) -> Any:
    """Arrays of ``spec``'s shapes and dtypes (a symbolic dimension ``SYMBOLIC_SIZE``), of
    0.5 (0 for integers), in ``spec``'s tree."""
    if "shape" in spec:
        if is_key_dtype(spec["dtype"]):  # keys of zeros: valid for every implementation
            impl = impl_of(spec["dtype"], None)
            shape = (*(_size(d) for d in spec["shape"]), *impl.words)
            return KeyArray(impl.name, np.zeros(shape, np.uint32))
        dtype = np.dtype(spec["dtype"])
        fill = 0.5 if np.issubdtype(dtype, np.inexact) else 0
        return np.full(tuple(_size(d) for d in spec["shape"]), fill, dtype=dtype)
    if "dict" in spec:
        return {k: _filled(v) for k, v in spec["dict"].items()}
    if "list" in spec:
        return [_filled(v) for v in spec["list"]]
    if "tuple" in spec:
        return tuple(_filled(v) for v in spec["tuple"])
    return None


def _json(value: Any) -> Any:
    """``value`` (arrays, pytrees) as plain JSON values in the "json" encoding: float64
    as nested lists, other dtypes (and PRNG keys) as typed objects with lists, tuples as
    ``__tuple__``."""
    from dxserve.frameworks.jax import keys

    return codec.loads(codec.dumps(codec.from_tree(keys.to_wire(value), "json")))
