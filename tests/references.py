"""Analytic derivatives of the example functions, the independent references tests
check every backend against (float64, by hand, no AD)."""

from __future__ import annotations

import numpy as np


def rosenbrock_gradient(x: np.ndarray) -> np.ndarray:
    """∇ of the extended Rosenbrock function Σ 100(xᵢ₊₁ − xᵢ²)² + (1 − xᵢ)²."""
    g = np.zeros_like(x)
    g[:-1] = -400 * x[:-1] * (x[1:] - x[:-1] ** 2) - 2 * (1 - x[:-1])
    g[1:] += 200 * (x[1:] - x[:-1] ** 2)
    return g


def rosenbrock_hessian(x: np.ndarray) -> np.ndarray:
    """The analytic Hessian of the extended Rosenbrock function, (n, n)."""
    n = x.size
    h = np.zeros((n, n))
    i = np.arange(n - 1)
    h[i, i] += 1200 * x[:-1] ** 2 - 400 * x[1:] + 2
    h[i + 1, i + 1] += 200
    h[i, i + 1] = h[i + 1, i] = -400 * x[:-1]
    return h


def sin_cumsum_jacobian(x: np.ndarray) -> np.ndarray:
    """d/dx of sin(x) * cumsum(x): diag(cos(x) * cumsum(x)) + sin(x)[:, None] * tril(1)."""
    n = x.size
    return np.diag(np.cos(x) * np.cumsum(x)) + np.sin(x)[:, None] * np.tril(np.ones((n, n)))


def cbrt_derivative(x: np.ndarray) -> np.ndarray:
    """d/dx ∛x = x^(-2/3) / 3, elementwise (x > 0)."""
    return x ** (-2.0 / 3.0) / 3.0


def cbrt_second_derivative(x: np.ndarray) -> np.ndarray:
    """d²/dx² ∛x = -2 x^(-5/3) / 9, elementwise (x > 0)."""
    return -2.0 * x ** (-5.0 / 3.0) / 9.0


def sqrt_derivative(x: np.ndarray) -> np.ndarray:
    """d/dx √x = 1 / (2 √x), elementwise (x > 0)."""
    return 0.5 / np.sqrt(x)


def sqrt_second_derivative(x: np.ndarray) -> np.ndarray:
    """d²/dx² √x = -x^(-3/2) / 4, elementwise (x > 0)."""
    return -0.25 * x**-1.5


def noisy_value(x: np.ndarray, z: np.ndarray) -> np.ndarray:
    """The ``noisy`` example, f(x) = Σ xᵢ² (1 + 0.1 zᵢ), for its draws z (data, not AD)."""
    return np.sum(x**2 * (1 + 0.1 * z))


def noisy_gradient(x: np.ndarray, z: np.ndarray) -> np.ndarray:
    """∇ of Σ xᵢ² (1 + 0.1 zᵢ): 2 xᵢ (1 + 0.1 zᵢ); the draws do not depend on x."""
    return 2 * x * (1 + 0.1 * z)


def noisy_hessian(x: np.ndarray, z: np.ndarray) -> np.ndarray:
    """The Hessian of Σ xᵢ² (1 + 0.1 zᵢ): diag(2 (1 + 0.1 zᵢ)), (n, n)."""
    return np.diag(2 * (1 + 0.1 * z))
