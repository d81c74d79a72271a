"""The operator table, shared by library, server and client.

Each operator has DifferentiationInterface.jl's name and argument order
``op(f, backend, x, [tangents], *contexts)``; ``results`` names what it returns,
in order, which is also how the HTTP responses name their fields.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorSpec:
    name: str
    family: str  # the operator whose computation this one selects from
    results: tuple[str, ...]
    takes_tangents: bool = False
    order: int = 1


def _spec(name: str, family: str, results: tuple[str, ...], **kw: object) -> OperatorSpec:
    return OperatorSpec(name, family, results, **kw)  # type: ignore[arg-type]


OPERATORS: dict[str, OperatorSpec] = {
    s.name: s
    for s in [
        _spec("value", "value", ("value",), order=0),
        _spec("derivative", "derivative", ("derivative",)),
        _spec("value_and_derivative", "derivative", ("value", "derivative")),
        _spec("second_derivative", "second_derivative", ("second_derivative",), order=2),
        _spec(
            "value_derivative_and_second_derivative",
            "second_derivative",
            ("value", "derivative", "second_derivative"),
            order=2,
        ),
        _spec("gradient", "gradient", ("gradient",)),
        _spec("value_and_gradient", "gradient", ("value", "gradient")),
        _spec("jacobian", "jacobian", ("jacobian",)),
        _spec("value_and_jacobian", "jacobian", ("value", "jacobian")),
        _spec("hessian", "hessian", ("hessian",), order=2),
        _spec("value_gradient_and_hessian", "hessian", ("value", "gradient", "hessian"), order=2),
        _spec("pushforward", "pushforward", ("pushforwards",), takes_tangents=True),
        _spec("value_and_pushforward", "pushforward", ("value", "pushforwards"), takes_tangents=True),
        _spec("pullback", "pullback", ("pullbacks",), takes_tangents=True),
        _spec("value_and_pullback", "pullback", ("value", "pullbacks"), takes_tangents=True),
        _spec("hvp", "hvp", ("hvps",), takes_tangents=True, order=2),
        _spec("gradient_and_hvp", "hvp", ("gradient", "hvps"), takes_tangents=True, order=2),
    ]
}

# JAX's names, accepted as aliases on the wire and in the client.
ALIASES: dict[str, str] = {"jvp": "pushforward", "vjp": "pullback"}
