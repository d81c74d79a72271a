"""The functions ``torch_latency.py`` serves written in torch (its servers import this
module beside ``dxserve.examples``, whose ``rosenbrock`` is the JAX twin)."""

from __future__ import annotations

import torch

import dxserve


@dxserve.function(framework="torch", description="extended Rosenbrock, R^n -> R (torch)")
def torch_rosenbrock(x):
    return torch.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)
