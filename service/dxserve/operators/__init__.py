"""Every DifferentiationInterface operator, one family per module."""

from .derivative import derivative, prepare_derivative, value_and_derivative
from .gradient import gradient, prepare_gradient, value_and_gradient
from .hessian import hessian, prepare_hessian, value_gradient_and_hessian
from .hvp import gradient_and_hvp, hvp, prepare_hvp
from .jacobian import jacobian, prepare_jacobian, value_and_jacobian
from .pullback import prepare_pullback, pullback, value_and_pullback, vjp
from .pushforward import jvp, prepare_pushforward, pushforward, value_and_pushforward
from .second_derivative import (
    prepare_second_derivative,
    second_derivative,
    value_derivative_and_second_derivative,
)
from .sparsity import prepare_sparsity, sparsity
from .value import prepare_value, value

__all__ = [
    "derivative", "gradient", "gradient_and_hvp", "hessian", "hvp", "jacobian", "jvp",
    "prepare_derivative", "prepare_gradient", "prepare_hessian", "prepare_hvp",
    "prepare_jacobian", "prepare_pullback", "prepare_pushforward",
    "prepare_second_derivative", "prepare_sparsity", "prepare_value", "pullback", "pushforward",
    "second_derivative", "sparsity", "value", "value_and_derivative", "value_and_gradient",
    "value_and_jacobian", "value_and_pullback", "value_and_pushforward",
    "value_derivative_and_second_derivative", "value_gradient_and_hessian", "vjp",
]
