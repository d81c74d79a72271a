"""dxclient: derivatives from a dxserve server, numpy in and numpy out."""

from .backends import (
    Auto,
    Backend,
    FiniteDifferences,
    JaxForward,
    JaxReverse,
    SecondOrder,
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
    "backend_from_json",
]
