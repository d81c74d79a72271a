"""Backend descriptors: small immutable values naming how to differentiate.

Like ADTypes.jl, a descriptor says *which* mode to use, never *how*; the server's
engines own the mechanics. Each has an exact JSON form::

    JaxForward(batch_size=4).to_json() == {"type": "jax-forward", "batch_size": 4}
    backend_from_json("jax-reverse") == JaxReverse()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from .errors import InvalidBackendError


def _check_batch_size(value: Any, field: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidBackendError(
            f"batch_size must be a positive integer or null, got {value!r}", field=field
        )
    return value


@dataclass(frozen=True)
class JaxForward:
    """Forward mode (JVPs). Jacobians are built from ``batch_size`` columns per call."""

    batch_size: int | None = None
    type: ClassVar[str] = "jax-forward"

    def __post_init__(self) -> None:
        _check_batch_size(self.batch_size, "backend.batch_size")

    def to_json(self) -> dict[str, Any]:
        return _compact({"type": self.type, "batch_size": self.batch_size})


@dataclass(frozen=True)
class JaxReverse:
    """Reverse mode (VJPs). Jacobians are built from ``batch_size`` rows per call."""

    batch_size: int | None = None
    type: ClassVar[str] = "jax-reverse"

    def __post_init__(self) -> None:
        _check_batch_size(self.batch_size, "backend.batch_size")

    def to_json(self) -> dict[str, Any]:
        return _compact({"type": self.type, "batch_size": self.batch_size})


@dataclass(frozen=True)
class FiniteDifferences:
    """Finite differences; works on black-box (non-JAX) functions.

    ``method`` is ``"central"`` (error O(step^2)) or ``"forward"`` (O(step)).
    ``step=None`` picks cbrt(eps) for central and sqrt(eps) for forward differences,
    scaled by max(1, max|x|).
    """

    method: Literal["central", "forward"] = "central"
    step: float | None = None
    batch_size: int | None = None
    type: ClassVar[str] = "finite-differences"

    def __post_init__(self) -> None:
        if self.method not in ("central", "forward"):
            raise InvalidBackendError(
                f"method must be 'central' or 'forward', got {self.method!r}",
                field="backend.method",
            )
        if self.step is not None:
            ok = isinstance(self.step, (int, float)) and not isinstance(self.step, bool)
            if not ok or not (0 < self.step < 1):
                raise InvalidBackendError(
                    f"step must be a number in (0, 1) or null, got {self.step!r}",
                    field="backend.step",
                )
        _check_batch_size(self.batch_size, "backend.batch_size")

    def to_json(self) -> dict[str, Any]:
        return _compact(
            {
                "type": self.type,
                "method": None if self.method == "central" else self.method,
                "step": self.step,
                "batch_size": self.batch_size,
            }
        )


FirstOrder = JaxForward | JaxReverse | FiniteDifferences


@dataclass(frozen=True)
class SecondOrder:
    """``outer`` differentiates what ``inner`` computes (HVP = outer ∘ inner gradient)."""

    outer: FirstOrder
    inner: FirstOrder
    type: ClassVar[str] = "second-order"

    def __post_init__(self) -> None:
        for part in ("outer", "inner"):
            value = getattr(self, part)
            if type(value) not in _CLASSES or isinstance(value, SecondOrder | Auto):
                raise InvalidBackendError(
                    f"{part} must be a first-order backend "
                    "(jax-forward, jax-reverse, finite-differences or a registered one)",
                    field=f"backend.{part}",
                )

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, "outer": self.outer.to_json(), "inner": self.inner.to_json()}


@dataclass(frozen=True)
class Auto:
    """Pick per operator and shape; ``dxserve.resolve`` tells what it picked."""

    type: ClassVar[str] = "auto"

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type}


Backend = JaxForward | JaxReverse | FiniteDifferences | SecondOrder | Auto

#: type -> descriptor class; ``register_backend_type`` adds plug-in backends.
BACKEND_TYPES: dict[str, type] = {
    cls.type: cls for cls in (JaxForward, JaxReverse, FiniteDifferences, SecondOrder, Auto)
}

_PARAMS: dict[str, tuple[str, ...]] = {
    "jax-forward": ("batch_size",),
    "jax-reverse": ("batch_size",),
    "finite-differences": ("method", "step", "batch_size"),
    "second-order": ("outer", "inner"),
    "auto": (),
}


def register_backend_type(descriptor: type, parameters: tuple[str, ...] = ()) -> None:
    """Make ``backend_from_json`` know ``descriptor`` (a frozen dataclass with a
    ``type`` class attribute and ``to_json()``) and the JSON parameters it takes."""
    kind = descriptor.type
    if not isinstance(kind, str) or not kind:
        raise ValueError("a backend descriptor needs a non-empty string class attribute 'type'")
    BACKEND_TYPES[kind] = descriptor
    _PARAMS[kind] = tuple(parameters)
    _SHORTHANDS.pop(kind, None)
    try:
        _SHORTHANDS[kind] = descriptor()
    except TypeError:  # it has required parameters: no shorthand
        pass


def backend_to_json(value: Any, field: str = "backend") -> Any:
    """The JSON form of a descriptor or shorthand; a dict of a type this process does
    not know (a server-side plug-in) is passed on as it is, for the server to check."""
    if isinstance(value, dict):
        kind = value.get("type")
        if isinstance(kind, str) and kind not in BACKEND_TYPES:
            return value
    return backend_from_json(value, field).to_json()


class _DescriptorClasses:
    """``type(value) in _CLASSES``: is ``value`` a registered descriptor (a live view)."""

    def __contains__(self, cls: object) -> bool:
        return getattr(cls, "type", None) in BACKEND_TYPES and BACKEND_TYPES[cls.type] is cls


def _compact(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def backend_from_json(value: Any, field: str = "backend") -> Backend:
    """Parse a shorthand string or JSON object into a descriptor.

    Raises ``InvalidBackendError`` naming the offending field.
    """
    if type(value) in _CLASSES:
        return value
    if isinstance(value, str):
        shorthand = _SHORTHANDS.get(value)
        if shorthand is not None:  # the common case, on every request: no parsing
            return shorthand
        value = {"type": value}
    elif isinstance(value, dict) and len(value) == 1 and isinstance(value.get("type"), str):
        shorthand = _SHORTHANDS.get(value["type"])
        if shorthand is not None:
            return shorthand
    if not isinstance(value, dict):
        raise InvalidBackendError(
            f"backend must be a string like 'jax-reverse' or an object with 'type', "
            f"got {type(value).__name__}",
            field=field,
        )
    kind = value.get("type")
    if not isinstance(kind, str) or kind not in BACKEND_TYPES:
        raise InvalidBackendError(
            f"unknown backend type {kind!r}; known: {', '.join(BACKEND_TYPES)}",
            field=f"{field}.type",
        )
    allowed = _PARAMS[kind]
    for key in value:
        if key != "type" and key not in allowed:
            raise InvalidBackendError(
                f"{kind} takes no parameter {key!r}; it takes: {', '.join(allowed) or 'none'}",
                field=f"{field}.{key}",
            )
    params = {k: v for k, v in value.items() if k != "type"}
    if kind == "second-order":
        for part in ("outer", "inner"):
            if part not in params:
                raise InvalidBackendError(
                    "second-order needs both 'outer' and 'inner'", field=f"{field}.{part}"
                )
            params[part] = backend_from_json(params[part], f"{field}.{part}")
    if kind == "finite-differences" and "method" in params and params["method"] is None:
        params.pop("method")
    try:
        return BACKEND_TYPES[kind](**params)
    except InvalidBackendError as exc:
        raise InvalidBackendError(exc.detail, field=(exc.field or field).replace("backend", field, 1)) from None


_CLASSES = _DescriptorClasses()
_SHORTHANDS: dict[str, Backend] = {
    "jax-forward": JaxForward(),
    "jax-reverse": JaxReverse(),
    "finite-differences": FiniteDifferences(),
    "auto": Auto(),
}
