"""Backend descriptors (shared with the client) and the engines behind them."""

from dxclient.backends import (
    Auto,
    Backend,
    FiniteDifferences,
    JaxForward,
    JaxReverse,
    SecondOrder,
    backend_from_json,
)

from .resolve import engine_for, engines_for, resolve_backend

__all__ = [
    "Auto",
    "Backend",
    "FiniteDifferences",
    "JaxForward",
    "JaxReverse",
    "SecondOrder",
    "backend_from_json",
    "engine_for",
    "engines_for",
    "resolve_backend",
]
