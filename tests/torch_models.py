"""Torch functions the torch tests serve beside the scenarios: a model and costly ones.

* ``mlp_loss(params, inputs, targets)``: the mean squared error of ``MLP``, an
  ``nn.Module`` (3 -> 16 -> 16 -> 2, tanh, float64), called through
  ``torch.func.functional_call`` with ``params``, a dict of tensors keyed by parameter
  name (``MLP.named_parameters()``): the pytree x. Not marked with a framework: its code
  refers to torch, and ``@dxserve.function`` detects it.
* ``torch_sin_cumsum``: ``sin(x) * cumsum(x)``, R^n -> R^n, as ``dxserve.examples``'
  ``sin_cumsum`` (``tests/references.py`` has its Jacobian).
* ``torch_rosenbrock_n``: the extended Rosenbrock for any n (``rosenbrock_hessian``).

Importing this module imports torch: the tests that serve it skip without torch.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

import dxserve


class MLP(nn.Module):
    """3 -> 16 -> 16 -> 2 with tanh, in float64, from a fixed seed."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        sizes = [(3, 16), (16, 16), (16, 2)]
        self.layers = nn.ModuleList(nn.Linear(a, b, dtype=torch.float64) for a, b in sizes)
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator,
                                               dtype=torch.float64) / layer.in_features**0.5)
                layer.bias.copy_(0.1 * torch.randn(layer.bias.shape, generator=generator,
                                                   dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


MODEL = MLP()


def parameters() -> dict[str, np.ndarray]:
    """``MODEL``'s initial parameters as numpy arrays keyed by name (what a client sends)."""
    return {k: v.detach().numpy().copy() for k, v in MODEL.named_parameters()}


def data(points: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs (points, 3), targets (points, 2))``: a smooth target of the inputs."""
    rng = np.random.default_rng(1)
    inputs = rng.uniform(-1, 1, (points, 3))
    targets = np.stack([np.sin(inputs[:, 0] + inputs[:, 1]), inputs[:, 2] ** 2], axis=1)
    return inputs, targets


@dxserve.function(description="mean squared error of a 3-16-16-2 tanh MLP (torch nn.Module)",
                  example=(parameters(), *data()))
def mlp_loss(params, inputs, targets):
    predictions = functional_call(MODEL, params, (inputs,))
    return torch.mean((predictions - targets) ** 2)


@dxserve.function(framework="torch", description="sin(x) * cumsum(x), R^n -> R^n (torch)")
def torch_sin_cumsum(x):
    return torch.sin(x) * torch.cumsum(x, 0)


@dxserve.function(framework="torch", description="extended Rosenbrock, R^n -> R (torch)")
def torch_rosenbrock_n(x):
    return torch.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)
