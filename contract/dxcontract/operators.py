"""The operator table, shared by library, server and client: each operator's facts once.

Each operator has DifferentiationInterface.jl's name and argument order
``op(f, backend, x, [tangents], *contexts)``; ``results`` names what it returns,
in order, which is also how the HTTP responses name their fields. Everything else
that differs per operator (the client's methods, the OpenAPI examples, which results
are batches, the result-size limit) is derived from this table.

With ``has_aux`` (operators whose spec says ``aux``) the function returns a pair
``(output, aux)``: the operator differentiates ``output`` and returns ``aux``, computed at
x and never differentiated, as one more result named ``AUX``; ``returned`` gives the
caller JAX's shapes (``jax.value_and_grad(has_aux=True)``'s ``((value, aux), g)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

TangentsLike = Literal["x", "y"]
#: The mode ``Auto`` picks for a first-order family: reverse, forward, or by size
#: (forward when ``x.size <= f(x).size``); second-order families get forward-over-reverse.
AutoMode = Literal["forward", "reverse", "by_size"]
#: What a long computation of a family runs in chunks of: basis vectors of a dense
#: derivative (a Jacobian's columns or rows), or the batch of tangents.
ChunkAxis = Literal["basis", "tangents"]


@dataclass(frozen=True)
class _Family:
    """What the operators of one family share."""

    tangents_like: TangentsLike | None
    batch: str | None  # the result that holds one array per tangent
    elements: Callable[[int, int, int], int]  # (n, m, k) -> numbers in the result
    example: Mapping[str, Any]  # a request the example server answers
    order: int = 1  # of differentiation: 0 (value), 1 or 2
    auto: AutoMode = "forward"
    chunks: ChunkAxis | None = None
    sparse: bool = False  # served by sparse backends (one pass per colour)
    scalar_output: bool = False  # defined for a scalar f(x) only
    scalar_input: bool = False  # defined for a scalar x only
    arrays_only: bool = False  # x and f(x) arrays, not pytrees
    aux: bool = True  # returns auxiliary outputs with has_aux


_ROSENBROCK: Mapping[str, Any] = {"function": "rosenbrock", "backend": "jax-reverse", "x": [1.0, 2.0, 3.0]}
_SCALAR: Mapping[str, Any] = {"function": "normal_logpdf", "backend": "auto", "x": 0.5}

# The element counts include the value, which every operator computes anyway; the
# server refuses a request whose count is over its limit before compiling anything.
_FAMILIES: dict[str, _Family] = {
    "value": _Family(None, None, lambda n, m, k: m, _ROSENBROCK, order=0, auto="reverse"),
    "derivative": _Family(None, None, lambda n, m, k: 2 * m, _SCALAR, scalar_input=True),
    "second_derivative": _Family(None, None, lambda n, m, k: 3 * m, _SCALAR, order=2,
                                 scalar_input=True),
    "gradient": _Family(None, None, lambda n, m, k: n + m, _ROSENBROCK, auto="reverse",
                        scalar_output=True),
    "jacobian": _Family(None, None, lambda n, m, k: m * n + m, _ROSENBROCK, auto="by_size",
                        chunks="basis", sparse=True),
    "hessian": _Family(None, None, lambda n, m, k: n * n + n + 1, _ROSENBROCK, order=2,
                       chunks="basis", sparse=True, scalar_output=True),
    "pushforward": _Family(
        "x", "pushforwards", lambda n, m, k: (k + 1) * m,
        {**_ROSENBROCK, "function": "sin_cumsum", "tangents": [[1.0, 0.0, 0.0]]},
        chunks="tangents",
    ),
    "pullback": _Family(
        "y", "pullbacks", lambda n, m, k: k * n + m, {**_ROSENBROCK, "tangents": [1.0]},
        auto="reverse", chunks="tangents",
    ),
    # the pattern alone; m * n bounds it, a sparse engine counts the nonzeros instead
    "sparsity": _Family(None, None, lambda n, m, k: m * n, _ROSENBROCK, sparse=True,
                        arrays_only=True, aux=False),
    "hvp": _Family(
        "x", "hvps", lambda n, m, k: (k + 1) * n, {**_ROSENBROCK, "tangents": [[1.0, 0.0, 0.0]]},
        order=2, chunks="tangents", scalar_output=True,
    ),
}  # fmt: skip


@dataclass(frozen=True)
class OperatorSpec:
    """One operator: its name, the family that computes it, and what it returns.

    ``family`` is the operator whose computation this one selects from
    (``value_and_gradient`` is a ``gradient``). ``summary`` is the one-line
    description the client's method and the docs use. ``tangents_like`` says what
    each tangent is shaped like: ``"x"`` (pushforward, hvp), ``"y"`` (pullback,
    cotangents shaped like ``f(x)``), or None for operators without tangents.
    ``batch_results`` are the results that hold one array per tangent.

    What the server reads of its family, so that a new family is its spec and its
    maths: ``order`` of differentiation, the ``auto`` mode ``Auto`` picks at first order
    (second order is forward-over-reverse), what long runs are ``chunks`` of, whether
    ``sparse`` backends serve it, and whether it needs a ``scalar_output``, a
    ``scalar_input`` or ``arrays_only``. ``aux``: it takes ``has_aux`` (a function
    returning ``(output, aux)``) and then returns ``aux`` too.
    """

    name: str
    family: str
    results: tuple[str, ...]
    takes_tangents: bool = False
    order: int = 1
    summary: str = ""
    tangents_like: TangentsLike | None = None
    batch_results: frozenset[str] = frozenset()
    example: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    auto: AutoMode = "forward"
    chunks: ChunkAxis | None = None
    sparse: bool = False
    scalar_output: bool = False
    scalar_input: bool = False
    arrays_only: bool = False
    aux: bool = False

    def result_elements(self, n: int, m: int, k: int) -> int:
        """Numbers this operator's family computes for an ``x`` of ``n`` elements,
        a ``y = f(x)`` of ``m`` and ``k`` tangents (the value included)."""
        return _FAMILIES[self.family].elements(n, m, k)


def _spec(name: str, family: str, results: tuple[str, ...], summary: str) -> OperatorSpec:
    facts = _FAMILIES[family]
    return OperatorSpec(
        name,
        family,
        results,
        takes_tangents=facts.tangents_like is not None,
        order=facts.order,
        summary=summary,
        tangents_like=facts.tangents_like,
        batch_results=frozenset(r for r in results if r == facts.batch),
        example=MappingProxyType(dict(facts.example)),
        auto=facts.auto,
        chunks=facts.chunks,
        sparse=facts.sparse,
        scalar_output=facts.scalar_output,
        scalar_input=facts.scalar_input,
        arrays_only=facts.arrays_only,
        aux=facts.aux,
    )


OPERATORS: dict[str, OperatorSpec] = {
    s.name: s
    for s in [
        _spec("value", "value", ("value",), "f(x, *contexts)."),
        _spec("derivative", "derivative", ("derivative",), "f'(x) for scalar x."),
        _spec("value_and_derivative", "derivative", ("value", "derivative"), "(f(x), f'(x))."),
        _spec("second_derivative", "second_derivative", ("second_derivative",),
              "f''(x) for scalar x."),
        _spec("value_derivative_and_second_derivative", "second_derivative",
              ("value", "derivative", "second_derivative"), "(f(x), f'(x), f''(x))."),
        _spec("gradient", "gradient", ("gradient",), "∇f(x), shaped like x."),
        _spec("value_and_gradient", "gradient", ("value", "gradient"), "(f(x), ∇f(x))."),
        _spec("jacobian", "jacobian", ("jacobian",), "∂f/∂x, shape y.shape + x.shape."),
        _spec("value_and_jacobian", "jacobian", ("value", "jacobian"), "(f(x), ∂f/∂x)."),
        _spec("hessian", "hessian", ("hessian",), "∇²f(x), shape x.shape + x.shape."),
        _spec("value_gradient_and_hessian", "hessian", ("value", "gradient", "hessian"),
              "(f(x), ∇f(x), ∇²f(x))."),
        _spec("pushforward", "pushforward", ("pushforwards",), "(J t for t in tangents)."),
        _spec("value_and_pushforward", "pushforward", ("value", "pushforwards"),
              "(f(x), (J t for t in tangents))."),
        _spec("pullback", "pullback", ("pullbacks",), "(Jᵀ c for c in tangents)."),
        _spec("value_and_pullback", "pullback", ("value", "pullbacks"),
              "(f(x), (Jᵀ c for c in tangents))."),
        _spec("sparsity", "sparsity", ("sparsity",),
              "The pattern of ∂f/∂x, or of ∇²f for scalar f (sparse, no values)."),
        _spec("hvp", "hvp", ("hvps",), "(∇²f(x) t for t in tangents)."),
        _spec("gradient_and_hvp", "hvp", ("gradient", "hvps"),
              "(∇f(x), (∇²f(x) t for t in tangents))."),
    ]
}  # fmt: skip

#: Every result name that holds one array per tangent.
BATCH_RESULTS: frozenset[str] = frozenset().union(*(op.batch_results for op in OPERATORS.values()))

#: The families whose result is a Jacobian matrix (of f, or of its gradient or derivative):
#: of complex x they answer only for a function declared holomorphic (``holomorphic=True``,
#: as JAX's ``jacfwd`` and ``hessian`` take it), the one case a complex matrix is the
#: pushforward.
HOLOMORPHIC_FAMILIES: frozenset[str] = frozenset(
    ("jacobian", "derivative", "hessian", "second_derivative")
)

#: The result that holds a ``has_aux`` function's auxiliary output (after ``results``).
AUX = "aux"


def result_names(op: OperatorSpec, has_aux: bool = False) -> tuple[str, ...]:
    """The results ``op`` computes: ``op.results``, then ``AUX`` with ``has_aux``."""
    return (*op.results, AUX) if has_aux else op.results


def returned(op: OperatorSpec, values: Sequence[Any], has_aux: bool = False) -> Any:
    """What ``op`` returns to its caller, from ``values`` in ``result_names`` order: its
    one result, or a tuple of them (DI's order). With ``has_aux``, JAX's shapes: the
    value paired with aux, ``((value, aux), *others)`` (``jax.value_and_grad``), or
    ``(results, aux)`` for an operator without a value (``jax.grad``, ``jax.jacrev``)."""
    if not has_aux:
        return values[0] if len(values) == 1 else tuple(values)
    *main, aux = values
    if op.results[0] == "value":
        return (main[0], aux) if len(main) == 1 else ((main[0], aux), *main[1:])
    return (main[0] if len(main) == 1 else tuple(main)), aux


def unreturned(op: OperatorSpec, result: Any, has_aux: bool = False) -> tuple:
    """The inverse of ``returned``: ``result`` as values in ``result_names`` order."""
    if not has_aux:
        return tuple(result) if len(op.results) > 1 else (result,)
    if op.results[0] == "value":
        if len(op.results) == 1:
            return tuple(result)
        (value, aux), *others = result
        return (value, *others, aux)
    main, aux = result
    return (*(main if len(op.results) > 1 else (main,)), aux)
