"""dxserve: DifferentiationInterface-style derivatives over JAX, in process or served.

Float64 inputs are differentiated in float64 and float32 inputs in float32: dxserve
turns on JAX's 64-bit mode only around its own tracing and execution, so importing
it changes nothing in the caller's JAX configuration.

    import dxserve
    from dxserve import JaxReverse
    dxserve.gradient(lambda x: (x**2).sum(), JaxReverse(), np.arange(3.0))
"""

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
from dxcontract.errors import (
    DxError,
    NotScalarInputError,
    NotScalarOutputError,
    PreparationMismatchError,
    ShapeMismatchError,
    UnsupportedOperatorError,
)

from .backends import Engine, register_backend
from .differentiate_with import DifferentiateWith
from .functions import function
from .operators import *  # noqa: F403
from .operators import __all__ as _operator_names
from .precision import float64_scope
from .preparation import CACHE, Prep, resolve

try:
    __version__ = _version("dxserve")
except PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "Auto", "Backend", "CACHE", "DifferentiateWith", "DxError", "Engine", "FiniteDifferences",
    "JaxForward",
    "JaxReverse", "NotScalarInputError", "NotScalarOutputError", "Prep",
    "PreparationMismatchError", "SecondOrder", "ShapeMismatchError", "Sparse", "SparsePattern",
    "TorchForward", "TorchReverse",
    "UnsupportedOperatorError", "backend_from_json", "float64_scope", "function",
    "register_backend", "resolve", "__version__", *_operator_names,
]
