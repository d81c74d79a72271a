"""Backend descriptors: small immutable values naming how to differentiate.

Like ADTypes.jl, a descriptor says *which* mode to use, never *how*; the server's
engines own the mechanics. Each has an exact JSON form::

    JaxForward(batch_size=4).to_json() == {"type": "jax-forward", "batch_size": 4}
    backend_from_json("jax-reverse") == JaxReverse()
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

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


@dataclass(frozen=True)
class TorchForward:
    """PyTorch forward mode (``torch.func.jvp``), for functions written in torch.
    Jacobians are built from ``batch_size`` columns per call."""

    batch_size: int | None = None
    type: ClassVar[str] = "torch-forward"

    def __post_init__(self) -> None:
        _check_batch_size(self.batch_size, "backend.batch_size")

    def to_json(self) -> dict[str, Any]:
        return _compact({"type": self.type, "batch_size": self.batch_size})


@dataclass(frozen=True)
class TorchReverse:
    """PyTorch reverse mode (``torch.func.vjp``), for functions written in torch.
    Jacobians are built from ``batch_size`` rows per call."""

    batch_size: int | None = None
    type: ClassVar[str] = "torch-reverse"

    def __post_init__(self) -> None:
        _check_batch_size(self.batch_size, "backend.batch_size")

    def to_json(self) -> dict[str, Any]:
        return _compact({"type": self.type, "batch_size": self.batch_size})


FirstOrder = JaxForward | JaxReverse | TorchForward | TorchReverse | FiniteDifferences


@dataclass(frozen=True)
class SecondOrder:
    """``outer`` differentiates what ``inner`` computes (HVP = outer ∘ inner gradient)."""

    outer: FirstOrder
    inner: FirstOrder
    type: ClassVar[str] = "second-order"

    def __post_init__(self) -> None:
        for part in ("outer", "inner"):
            value = getattr(self, part)
            if type(value) not in _CLASSES or isinstance(value, SecondOrder | Auto | Sparse):
                raise InvalidBackendError(
                    f"{part} must be a first-order backend (jax-forward, jax-reverse, "
                    "torch-forward, torch-reverse, finite-differences or a registered one)",
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


def _pattern_shape(value: Any, field: str) -> tuple[int, int]:
    """``(m, n)`` of a pattern: two whole numbers in [0, ``SparsePattern.MAX_DIMENSION``]."""
    dims = index_array(value, field, SparsePattern.MAX_DIMENSION + 1, "dimensions")
    if dims.shape != (2,):
        raise InvalidBackendError(
            f"a sparsity pattern's shape is [m, n], got {value!r}"[:200], field=field
        )
    return int(dims[0]), int(dims[1])


def index_array(value: Any, field: str, bound: int, what: str = "indices") -> np.ndarray:
    """``value`` (nested lists, a numpy array) as int64 indices in ``[0, bound)``.

    Floats are accepted only when whole; booleans, strings, NaN, infinities, numbers
    past int64 and negative or out-of-range indices raise ``InvalidBackendError``
    naming ``field``.
    """
    try:
        a = np.asarray(value)
    except (TypeError, ValueError, OverflowError) as exc:  # ragged or unreadable
        raise InvalidBackendError(f"{what} must be an array of integers: {exc}"[:300],
                                  field=field) from None
    kind = a.dtype.kind
    if a.size == 0:
        return np.zeros(a.shape, dtype=np.int64)
    if kind == "f":
        if not np.isfinite(a).all():
            raise InvalidBackendError(f"{what} must be finite integers (got NaN or an infinity)", field=field)
        if (a != np.floor(a)).any():
            raise InvalidBackendError(f"{what} must be whole numbers, got a fraction",
                                      field=field)
    elif kind == "O":  # Python ints past 64 bits, None, nested objects
        bad = next((v for v in a.flat if not isinstance(v, int | np.integer)
                    or isinstance(v, bool) or not -(2**63) <= v < 2**63), a.flat[0])
        raise InvalidBackendError(
            f"{what} must be integers within 64 bits, got {repr(bad)[:40]}", field=field
        )
    elif kind not in "iu":  # bool, str, complex
        raise InvalidBackendError(f"{what} must be integers, got {a.dtype}", field=field)
    low, high = a.min(), a.max()
    if low < 0 or high >= bound:  # compared before any cast: nothing overflows
        bad = low if low < 0 else high
        shown = f"{bad:g}" if kind == "f" else str(int(bad))
        raise InvalidBackendError(f"{what} must be in [0, {bound - 1}], got {shown}",
                                  field=field)
    return a.astype(np.int64)


def _below(values: np.ndarray, bound: int, field: str, what: str) -> None:
    if values.size and int(values.max()) >= bound:
        raise InvalidBackendError(
            f"a {what} index is {int(values.max())}, outside the shape ({what}s < {bound})",
            field=field,
        )


class SparsePattern:
    """A sparsity pattern given by the user: an ``(m, n)`` boolean structure, no values.

    Built from ``(rows, cols, shape)``, a dense array (its nonzeros), a
    ``scipy.sparse`` array, a ``jax.experimental.sparse.BCOO`` or the JSON object
    ``{"format": "coo", "shape": [m, n], "indices": [[i, j], ...]}`` /
    ``{"format": "csr", "shape", "indptr", "indices"}`` (a ``"data"`` member is ignored).
    Entries are kept sorted row-major and unique (``rows``, ``cols``: int64, (nnz,)).
    Equal patterns compare and hash equal by content (a digest computed once).

    Every index must be a non-negative integer inside the shape (a float only when it
    is whole), each dimension at most ``MAX_DIMENSION``: anything else is an
    ``InvalidBackendError`` naming the field (``backend.sparsity.indices``, ...).
    """

    __slots__ = ("rows", "cols", "shape", "_digest")

    #: Largest dimension of a pattern: the sparse engine indexes entries with int32.
    MAX_DIMENSION = 2**31 - 1

    def __init__(
        self, rows: Any, cols: Any, shape: Any, field: str = "backend.sparsity"
    ) -> None:
        m, n = _pattern_shape(shape, f"{field}.shape")
        r = index_array(rows, f"{field}.rows", m, "row indices")
        c = index_array(cols, f"{field}.cols", n, "column indices")
        if r.ndim != 1 or c.ndim != 1 or r.shape != c.shape:
            raise InvalidBackendError(
                f"sparsity: rows and cols must be 1-D and equally long, got {r.shape} "
                f"and {c.shape}",
                field=field,
            )
        # m, n < 2**31, so a row-major key fits in int64
        keys = np.unique(r * max(n, 1) + c)  # sorted row-major, duplicates dropped
        self.rows, self.cols = keys // max(n, 1), keys % max(n, 1)
        self.rows.flags.writeable = self.cols.flags.writeable = False
        self.shape = (m, n)
        h = hashlib.sha256(repr(self.shape).encode())
        h.update(keys.astype("<i8").tobytes())
        self._digest = h.hexdigest()

    @property
    def nnz(self) -> int:
        return int(self.rows.size)

    @classmethod
    def of(cls, value: Any, field: str = "backend.sparsity") -> SparsePattern:
        """Any of the accepted forms (see the class docstring) -> a ``SparsePattern``."""
        if isinstance(value, SparsePattern):
            return value
        if isinstance(value, dict):
            return cls._from_json(value, field)
        if hasattr(value, "tocoo") and hasattr(value, "shape"):  # scipy.sparse
            coo = value.tocoo()
            return cls(coo.row, coo.col, coo.shape, field)
        if hasattr(value, "indices") and hasattr(value, "nse"):  # BCOO
            idx = np.asarray(value.indices)
            if idx.ndim != 2 or idx.shape[1] != 2:
                raise InvalidBackendError(
                    f"sparsity: a 2-D BCOO's indices are (nnz, 2), got {idx.shape}",
                    field=f"{field}.indices",
                )
            return cls(idx[:, 0], idx[:, 1], value.shape, field)
        try:
            a = np.asarray(value)
        except (TypeError, ValueError, OverflowError) as exc:  # ragged lists, say
            raise InvalidBackendError(
                f"sparsity must be a 2-D 0/1 array or a pattern object: {exc}", field=field
            ) from None
        if a.ndim != 2 or a.dtype.kind not in "biuf":
            raise InvalidBackendError(
                f"sparsity must be a 2-D pattern (m, n) of numbers, got {a.ndim} "
                f"dimensions of {a.dtype}",
                field=field,
            )
        r, c = np.nonzero(a)
        return cls(r, c, a.shape, field)

    @classmethod
    def _from_json(cls, obj: dict, field: str) -> SparsePattern:
        fmt = obj.get("format")
        if fmt not in ("coo", "csr"):
            raise InvalidBackendError(
                f"sparsity format must be 'coo' or 'csr', got {fmt!r}", field=f"{field}.format"
            )
        for key in ("shape", "indices", *(("indptr",) if fmt == "csr" else ())):
            if key not in obj:
                raise InvalidBackendError(
                    f"a {fmt} sparsity pattern needs {key!r}", field=f"{field}.{key}"
                )
        m, n = _pattern_shape(obj["shape"], f"{field}.shape")
        if fmt == "coo":
            idx = index_array(obj["indices"], f"{field}.indices", max(m, n))
            if idx.size == 0:
                idx = idx.reshape(0, 2)
            if idx.ndim != 2 or idx.shape[1] != 2:
                raise InvalidBackendError(
                    f"coo indices are [[row, col], ...] (nnz, 2), got shape {list(idx.shape)}",
                    field=f"{field}.indices",
                )
            _below(idx[:, 0], m, f"{field}.indices", "row")
            _below(idx[:, 1], n, f"{field}.indices", "column")
            return cls(idx[:, 0], idx[:, 1], (m, n), field)
        cols = index_array(obj["indices"], f"{field}.indices", n).reshape(-1)
        indptr = index_array(obj["indptr"], f"{field}.indptr", cols.size + 1, "row pointers")
        if indptr.shape != (m + 1,) or indptr[0] != 0 or indptr[-1] != cols.size:
            raise InvalidBackendError(
                f"csr indptr must have m + 1 = {m + 1} entries from 0 to nnz = {cols.size}",
                field=f"{field}.indptr",
            )
        counts = np.diff(indptr)
        if (counts < 0).any():
            raise InvalidBackendError("csr indptr must not decrease", field=f"{field}.indptr")
        return cls(np.repeat(np.arange(m, dtype=np.int64), counts), cols, (m, n), field)

    def to_json(self) -> dict[str, Any]:
        """``{"format": "csr", "shape": [m, n], "indptr": [...], "indices": [...]}``."""
        indptr = np.zeros(self.shape[0] + 1, dtype=np.int64)
        np.cumsum(np.bincount(self.rows, minlength=self.shape[0]), out=indptr[1:])
        return {
            "format": "csr", "shape": list(self.shape), "indptr": indptr.tolist(),
            "indices": self.cols.tolist(),
        }

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SparsePattern) and other._digest == self._digest

    def __hash__(self) -> int:
        return hash(self._digest)

    def __repr__(self) -> str:
        return f"SparsePattern(shape={self.shape}, nnz={self.nnz})"


_COLORINGS = (None, "column", "row", "star")
_FORMATS = ("csr", "coo")


@dataclass(frozen=True)
class Sparse:
    """Sparse Jacobians and Hessians (DI's ``AutoSparse``): ``dense`` computes one
    pushforward, pullback or HVP per colour of the pattern instead of one per column.

    * ``dense``: the backend doing the passes (a descriptor, shorthand or JSON).
    * ``sparsity``: None (detected from the function at preparation) or a pattern
      (anything ``SparsePattern.of`` takes).
    * ``coloring``: None (column for forward, row for reverse, the fewer colours for
      ``auto``; star for Hessians), ``"column"`` (JVPs/HVPs), ``"row"`` (VJPs) or
      ``"star"`` (symmetric: Hessians, square symmetric Jacobians).
    * ``format``: how results travel over HTTP, ``"csr"`` or ``"coo"``.

    It serves ``jacobian``, ``hessian``, their ``value_and_`` variants and
    ``sparsity``; every other operator runs on ``dense``. JSON:
    ``{"type": "sparse", "dense": "jax-forward", "sparsity": null, "coloring": null}``.
    """

    dense: Any = Auto()
    sparsity: SparsePattern | None = None
    coloring: Literal["column", "row", "star"] | None = None
    format: Literal["csr", "coo"] = "csr"
    type: ClassVar[str] = "sparse"

    def __post_init__(self) -> None:
        dense = backend_from_json(self.dense, "backend.dense")
        if isinstance(dense, Sparse):
            raise InvalidBackendError("sparse cannot wrap another sparse backend", field="backend.dense")
        object.__setattr__(self, "dense", dense)
        if self.sparsity is not None:
            object.__setattr__(self, "sparsity", SparsePattern.of(self.sparsity))
        if self.coloring not in _COLORINGS:
            raise InvalidBackendError(
                f"coloring must be null, 'column', 'row' or 'star', got {self.coloring!r}",
                field="backend.coloring",
            )
        if self.format not in _FORMATS:
            raise InvalidBackendError(
                f"format must be 'csr' or 'coo', got {self.format!r}", field="backend.format"
            )

    def to_json(self) -> dict[str, Any]:
        return _compact(
            {
                "type": self.type,
                "dense": self.dense.to_json(),
                "sparsity": None if self.sparsity is None else self.sparsity.to_json(),
                "coloring": self.coloring,
                "format": None if self.format == "csr" else self.format,
            }
        )


Backend = (
    JaxForward | JaxReverse | TorchForward | TorchReverse | FiniteDifferences | SecondOrder
    | Auto | Sparse
)

#: type -> descriptor class; ``register_backend_type`` adds plug-in backends.
BACKEND_TYPES: dict[str, type] = {
    cls.type: cls for cls in (
        JaxForward, JaxReverse, TorchForward, TorchReverse, FiniteDifferences, SecondOrder,
        Auto, Sparse,
    )
}

_PARAMS: dict[str, tuple[str, ...]] = {
    "jax-forward": ("batch_size",),
    "jax-reverse": ("batch_size",),
    "torch-forward": ("batch_size",),
    "torch-reverse": ("batch_size",),
    "finite-differences": ("method", "step", "batch_size"),
    "second-order": ("outer", "inner"),
    "auto": (),
    "sparse": ("dense", "sparsity", "coloring", "format"),
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
    """The JSON form of a descriptor or shorthand. A type this process does not know (a
    plug-in registered on the server only) is passed on as it is, a bare name as
    ``{"type": name}``, also inside ``second-order``: the server knows its plug-ins, and
    refuses an unknown name with a 422 listing the types it serves. A known type with
    parameters it does not take is refused here."""
    if isinstance(value, str) and value not in _SHORTHANDS and value not in BACKEND_TYPES:
        return {"type": value}
    if isinstance(value, dict) and _names_unknown_type(value):
        return value
    return backend_from_json(value, field).to_json()


def _names_unknown_type(value: dict) -> bool:
    """Does ``value``, or a backend nested in it, name a type this process does not know?"""
    kind = value.get("type")
    if isinstance(kind, str) and kind not in BACKEND_TYPES:
        return True
    return any(
        (isinstance(v, str) and v not in _SHORTHANDS and v not in BACKEND_TYPES)
        or (isinstance(v, dict) and _names_unknown_type(v))
        for k, v in value.items() if k in ("outer", "inner", "dense")
    )


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
    "torch-forward": TorchForward(),
    "torch-reverse": TorchReverse(),
    "finite-differences": FiniteDifferences(),
    "auto": Auto(),
}
_SHORTHANDS["sparse"] = Sparse()
