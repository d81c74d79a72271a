"""dxserve: DifferentiationInterface-style derivatives over JAX, in process or served.

Importing dxserve enables JAX's 64-bit mode (``jax_enable_x64``) so float64 inputs
are differentiated in float64; float32 inputs still compute in float32.

    import dxserve
    from dxserve import JaxReverse
    dxserve.gradient(lambda x: (x**2).sum(), JaxReverse(), np.arange(3.0))
"""

import jax

jax.config.update("jax_enable_x64", True)

from dxclient.backends import (  # noqa: E402
    Auto,
    Backend,
    FiniteDifferences,
    JaxForward,
    JaxReverse,
    SecondOrder,
    backend_from_json,
)
from dxclient.errors import (  # noqa: E402
    DxError,
    NotScalarInputError,
    NotScalarOutputError,
    PreparationMismatchError,
    ShapeMismatchError,
    UnsupportedOperatorError,
)

from .functions import function  # noqa: E402
from .operators import *  # noqa: E402,F403
from .operators import __all__ as _operator_names  # noqa: E402
from .preparation import CACHE, Prep  # noqa: E402
from .resolve import resolve  # noqa: E402

__all__ = [
    "Auto", "Backend", "CACHE", "DxError", "FiniteDifferences", "JaxForward", "JaxReverse",
    "NotScalarInputError", "NotScalarOutputError", "Prep", "PreparationMismatchError",
    "SecondOrder", "ShapeMismatchError", "UnsupportedOperatorError", "backend_from_json",
    "function", "resolve", *_operator_names,
]
