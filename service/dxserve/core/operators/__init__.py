"""Every DifferentiationInterface operator, one family per module; each has ``prepare_<op>``.

Every operator but ``sparsity`` takes ``has_aux=True`` for a function returning
``(output, aux)``, as JAX's transformations do: ``output`` is differentiated, ``aux`` is
evaluated at x and returned beside (``dxcontract.operators.returned`` gives the shapes).
"""

from dxserve.core.operators.derivative import (
    derivative,
    prepare_derivative,
    prepare_value_and_derivative,
    value_and_derivative,
)
from dxserve.core.operators.gradient import (
    gradient,
    prepare_gradient,
    prepare_value_and_gradient,
    value_and_gradient,
)
from dxserve.core.operators.hessian import (
    hessian,
    prepare_hessian,
    prepare_value_gradient_and_hessian,
    value_gradient_and_hessian,
)
from dxserve.core.operators.hvp import gradient_and_hvp, hvp, prepare_gradient_and_hvp, prepare_hvp
from dxserve.core.operators.jacobian import (
    jacobian,
    prepare_jacobian,
    prepare_value_and_jacobian,
    value_and_jacobian,
)
from dxserve.core.operators.pullback import (
    prepare_pullback,
    prepare_value_and_pullback,
    pullback,
    value_and_pullback,
)
from dxserve.core.operators.pushforward import (
    prepare_pushforward,
    prepare_value_and_pushforward,
    pushforward,
    value_and_pushforward,
)
from dxserve.core.operators.second_derivative import (
    prepare_second_derivative,
    prepare_value_derivative_and_second_derivative,
    second_derivative,
    value_derivative_and_second_derivative,
)
from dxserve.core.operators.sparsity import prepare_sparsity, sparsity
from dxserve.core.operators.value import prepare_value, value

__all__ = [
    "derivative", "gradient", "gradient_and_hvp", "hessian", "hvp", "jacobian",
    "prepare_derivative", "prepare_gradient", "prepare_gradient_and_hvp", "prepare_hessian",
    "prepare_hvp", "prepare_jacobian", "prepare_pullback", "prepare_pushforward",
    "prepare_second_derivative", "prepare_sparsity", "prepare_value",
    "prepare_value_and_derivative", "prepare_value_and_gradient", "prepare_value_and_jacobian",
    "prepare_value_and_pullback", "prepare_value_and_pushforward",
    "prepare_value_derivative_and_second_derivative", "prepare_value_gradient_and_hessian",
    "pullback", "pushforward", "second_derivative", "sparsity", "value", "value_and_derivative",
    "value_and_gradient", "value_and_jacobian", "value_and_pullback", "value_and_pushforward",
    "value_derivative_and_second_derivative", "value_gradient_and_hessian",
]
