"""dxserve: DifferentiationInterface-style derivatives over JAX, in process or served.

Float64 inputs are differentiated in float64 and float32 inputs in float32: dxserve
turns on JAX's 64-bit mode only around its own tracing and execution, so importing
it changes nothing in the caller's JAX configuration.

    import dxserve
    from dxserve import JaxReverse
    dxserve.gradient(lambda x: (x**2).sum(), JaxReverse(), np.arange(3.0))
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from typing import TYPE_CHECKING, Any

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

# Everything that needs JAX loads on first use (PEP 562), so ``dxserve --help`` and the
# command line's flag checks answer without importing it.
if TYPE_CHECKING:
    from dxserve.core.backends import Engine, register_backend
    from dxserve.core.differentiate_with import DifferentiateWith
    from dxserve.core.functions import function
    from dxserve.core.operators import *  # noqa: F403
    from dxserve.core.preparation import CACHE, Prep, resolve
    from dxserve.frameworks.jax.precision import float64_scope

#: The operators of ``dxserve.core.operators`` (checked against its ``__all__`` by a test).
_OPERATOR_NAMES = (
    "derivative", "gradient", "gradient_and_hvp", "hessian", "hvp", "jacobian",
    "prepare_derivative", "prepare_gradient", "prepare_gradient_and_hvp", "prepare_hessian",
    "prepare_hvp", "prepare_jacobian", "prepare_pullback", "prepare_pushforward",
    "prepare_second_derivative", "prepare_sparsity", "prepare_value",
    "prepare_value_and_derivative", "prepare_value_and_gradient", "prepare_value_and_jacobian",
    "prepare_value_and_pullback", "prepare_value_and_pushforward",
    "prepare_value_derivative_and_second_derivative", "prepare_value_gradient_and_hessian",
    "pullback", "pushforward", "second_derivative", "sparsity", "value",
    "value_and_derivative", "value_and_gradient", "value_and_jacobian", "value_and_pullback",
    "value_and_pushforward", "value_derivative_and_second_derivative",
    "value_gradient_and_hessian",
)  # fmt: skip
#: Where each lazily loaded name lives.
_LAZY = {
    "Engine": "dxserve.core.backends", "register_backend": "dxserve.core.backends",
    "DifferentiateWith": "dxserve.core.differentiate_with", "function": "dxserve.core.functions",
    "float64_scope": "dxserve.frameworks.jax.precision", "CACHE": "dxserve.core.preparation",
    "Prep": "dxserve.core.preparation", "resolve": "dxserve.core.preparation",
    **dict.fromkeys(_OPERATOR_NAMES, "dxserve.core.operators"),
}  # fmt: skip


def __getattr__(name: str) -> Any:
    """A name of ``__all__`` that needs JAX, imported on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dxserve' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


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
    "register_backend", "resolve", "__version__", *_OPERATOR_NAMES,
]  # fmt: skip
