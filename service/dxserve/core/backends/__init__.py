"""Backend descriptors (shared with the client) and the engines behind them.

The built-in backends are registered here with the same ``register_backend`` a
plug-in uses. Each framework's engines (``frameworks/jax/``, ``frameworks/torch/``) are
imported when one is first made: registering them imports neither JAX nor torch.
"""

from typing import Any

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
from dxserve.core.backends.engine import Engine
from dxserve.core.backends.finite_differences import FiniteDifferencesEngine, refuse_low_precision
from dxserve.core.backends.plugins import PLUGINS, SECOND_ORDER, backend_table, register_backend
from dxserve.core.backends.selection import engine_for, engines_for, resolve_backend


def _jax_engine(b: JaxForward | JaxReverse, *, traced: bool, nested: bool) -> Engine:
    from dxserve.frameworks.jax.modes import ForwardEngine, ReverseEngine  # JAX, when used

    kind = ForwardEngine if isinstance(b, JaxForward) else ReverseEngine
    return kind(b.batch_size, traced)


register_backend(
    JaxForward,
    _jax_engine,
    parameters={"batch_size": "tangents per vectorized call (null: all)"},
    notes="second order as forward-over-reverse",
    framework="jax",
    mode="forward",
)
register_backend(
    JaxReverse,
    _jax_engine,
    parameters={"batch_size": "rows per vectorized call (null: all)"},
    notes="second order as forward-over-reverse",
    framework="jax",
    mode="reverse",
)


def _torch_engine(b: TorchForward | TorchReverse, *, traced: bool, nested: bool) -> Engine:
    from dxserve.frameworks.torch.modes import (  # torch, when used
        TorchForwardEngine,
        TorchReverseEngine,
    )

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



def _resolve_sparse(backend: Sparse, family: str, **kwargs: Any) -> Backend:
    from dxserve.frameworks.jax.sparse import resolve_sparse  # JAX (asdex), when used

    return resolve_sparse(backend, family, **kwargs)


def _sparse_engines(backend: Sparse, *, traced: bool) -> tuple[Engine, Engine | None]:
    from dxserve.frameworks.jax.sparse import sparse_engines

    return sparse_engines(backend, traced=traced)


register_backend(
    Sparse,
    None,
    parameters={
        "dense": "the backend doing the passes (default auto)",
        "sparsity": "null (detected at preparation) or a pattern {format: coo|csr, shape, "
        "indices | indptr + indices}",
        "coloring": "null, 'column', 'row' or 'star' (symmetric)",
        "format": "results on the wire: 'csr' (default) or 'coo'",
    },
    operators=("jacobian", "value_and_jacobian", "hessian", "value_gradient_and_hessian",
               "sparsity"),
    notes="one pass per colour of the detected pattern (asdex); other operators run "
    "on the dense backend",
    resolve=_resolve_sparse,
    engines=_sparse_engines,
    framework="jax",  # patterns are detected from JAX programs (asdex)
)

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
