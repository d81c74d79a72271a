"""dxclient: derivatives from a dxserve server, numpy in and numpy out."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from dxcontract.backends import (
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
from dxcontract.errors import DxError, PreparationMismatchError
from dxcontract.keys import KeyArray
from dxcontract.operators import OPERATORS

from ._client import AsyncClient, Client
from ._models import RemoteFunction, RemotePrep
from .jobs import AsyncJob, Job

try:
    __version__ = _version("dxserve-client")
except PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "__version__",
    "AsyncClient",
    "AsyncJob",
    "Client",
    "Job",
    "RemoteFunction",
    "RemotePrep",
    "Auto",
    "Backend",
    "DxError",
    "FiniteDifferences",
    "JaxForward",
    "JaxReverse",
    "KeyArray",
    "OPERATORS",
    "PreparationMismatchError",
    "SecondOrder",
    "Sparse",
    "SparsePattern",
    "TorchForward",
    "TorchReverse",
    "backend_from_json",
]
