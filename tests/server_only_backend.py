"""A backend that only the server knows: ``--functions tests.server_only_backend``
registers it in the server process, and a client process that never imports this
module names it by its type (``tests/client/test_backend_names.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from dxserve import Engine, register_backend
from dxserve.core.backends.plugins import FIRST_ORDER


@dataclass(frozen=True)
class ComplexStep:
    """Complex-step differentiation: f'(x) t = Im f(x + i h t) / h, exact to rounding for
    functions analytic in x (no subtraction, so h can be tiny)."""

    type: ClassVar[str] = "imaginary-step"
    h: float = 1e-30

    def to_json(self) -> dict:
        return {"type": self.type, "h": self.h}


@dataclass(frozen=True)
class ComplexStepEngine(Engine):
    h: float
    traced: bool = True
    traces = False  # runs on concrete arrays

    def pushforward(self, g, x, tx):
        x = np.asarray(x, dtype=np.float64)
        y = np.real(np.asarray(g(x)))
        out = np.stack([np.imag(np.asarray(g(x + 1j * self.h * t))) / self.h
                        for t in np.asarray(tx)])
        return y, out


register_backend(
    ComplexStep,
    lambda b, *, traced, nested: ComplexStepEngine(b.h, traced),
    parameters={"h": "the imaginary step"},
    operators=FIRST_ORDER,
    notes="forward mode by complex steps (a test backend, server-side only)",
)
