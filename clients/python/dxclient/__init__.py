"""dxclient: derivatives from a dxserve server, numpy in and numpy out."""

from ._client import AsyncClient, Client
from ._models import RemoteFunction, RemotePrep
from .backends import (
    Auto,
    Backend,
    FiniteDifferences,
    JaxForward,
    JaxReverse,
    SecondOrder,
    Sparse,
    SparsePattern,
    backend_from_json,
)
from .errors import DxError, PreparationMismatchError
from .operators import OPERATORS

__all__ = [
    "AsyncClient",
    "Client",
    "RemoteFunction",
    "RemotePrep",
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
    "backend_from_json",
]
