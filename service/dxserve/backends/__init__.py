"""Backend descriptors (shared with the client) and the engines behind them.

The built-in backends are registered here with the same ``register_backend`` a
plug-in uses. The torch modes' engines (``torch_modes``) are imported when one is
first made: registering them imports no torch.
"""

from dxcontract.backends import (
    Auto,
    Backend,
    FiniteDifferences,
    JaxForward,
    JaxReverse,
    SecondOrder,
    Sparse,
    TorchForward,
    TorchReverse,
    backend_from_json,
)

from .engine import Engine
from .finite_differences import FiniteDifferencesEngine, refuse_low_precision
from .jax_modes import ForwardEngine, ReverseEngine
from .plugins import PLUGINS, SECOND_ORDER, backend_table, register_backend
from .selection import engine_for, engines_for, resolve_backend
from .sparse import register as _register_sparse

register_backend(
    JaxForward,
    lambda b, *, traced, nested: ForwardEngine(b.batch_size, traced),
    parameters={"batch_size": "tangents per vectorized call (null: all)"},
    notes="second order as forward-over-reverse",
    framework="jax",
    mode="forward",
)
register_backend(
    JaxReverse,
    lambda b, *, traced, nested: ReverseEngine(b.batch_size, traced),
    parameters={"batch_size": "rows per vectorized call (null: all)"},
    notes="second order as forward-over-reverse",
    framework="jax",
    mode="reverse",
)


def _torch_engine(b: TorchForward | TorchReverse, *, traced: bool, nested: bool) -> Engine:
    from .torch_modes import TorchForwardEngine, TorchReverseEngine  # torch, when used

    kind = TorchForwardEngine if isinstance(b, TorchForward) else TorchReverseEngine
    return kind(b.batch_size, traced)


register_backend(
    TorchForward,
    _torch_engine,
    parameters={"batch_size": "tangents per vectorized call (null: all)"},
    notes="torch.func.jvp, for functions written in torch; second order as "
    "forward-over-reverse",
    framework="torch",
    mode="forward",
)
register_backend(
    TorchReverse,
    _torch_engine,
    parameters={"batch_size": "rows per vectorized call (null: all)"},
    notes="torch.func.vjp, for functions written in torch; second order as "
    "forward-over-reverse",
    framework="torch",
    mode="reverse",
)
register_backend(
    FiniteDifferences,
    lambda b, *, traced, nested: FiniteDifferencesEngine(
        b.method, b.step, b.batch_size, traced=traced, nested=nested
    ),
    parameters={
        "method": "'central' (default) or 'forward'",
        "step": "relative step in (0, 1); null picks cbrt(eps) or sqrt(eps)",
        "batch_size": "tangents per vectorized call",
    },
    notes="works on black-box functions; second order as finite differences over finite differences",
)
register_backend(
    SecondOrder,
    None,
    parameters={"outer": "first-order backend", "inner": "first-order backend"},
    operators=SECOND_ORDER,
)
register_backend(
    Auto,
    None,
    parameters={},
    notes="reverse for gradients/pullbacks, forward for pushforwards/derivatives, "
    "Jacobians by size, forward-over-reverse for second order; where that mode does not "
    "trace, the other mode, then finite differences",
)

_register_sparse()

__all__ = [
    "PLUGINS",
    "Auto",
    "Backend",
    "Engine",
    "FiniteDifferences",
    "JaxForward",
    "JaxReverse",
    "SecondOrder",
    "Sparse",
    "TorchForward",
    "TorchReverse",
    "backend_from_json",
    "backend_table",
    "engine_for",
    "engines_for",
    "refuse_low_precision",
    "register_backend",
    "resolve_backend",
]
