"""dxcontract: what a dxserve server and its clients agree on, and nothing else.

The operator table (``operators``), backend descriptors and their JSON (``backends``),
errors and their problem types (``errors``), the wire encodings and their negotiation
(``encodings``, ``codec``), sparse results and typed PRNG keys on the wire (``sparse``,
``keys``), and the export bundle (``bundle``). numpy only: no JAX, no HTTP. The server (``dxserve``) and the
Python client (``dxclient``) both depend on it, and neither on the other.
"""

from .backends import (
    Auto,
    Backend,
    FiniteDifferences,
    JaxForward,
    JaxReverse,
    SecondOrder,
    Sparse,
    SparsePattern,
    TorchForward,
    TorchReverse,
    backend_from_json,
)
from .errors import DxError, PreparationMismatchError
from .operators import OPERATORS

__all__ = [
    "Auto",
    "Backend",
    "DxError",
    "FiniteDifferences",
    "JaxForward",
    "JaxReverse",
    "OPERATORS",
    "PreparationMismatchError",
    "SecondOrder",
    "Sparse",
    "SparsePattern",
    "TorchForward",
    "TorchReverse",
    "backend_from_json",
]
