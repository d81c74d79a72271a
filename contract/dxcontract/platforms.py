"""JAX platform names as ``jax.export`` spells them.

``jax.default_backend()`` says ``"gpu"`` where ``jax.export`` lowers for ``"cuda"``
(or ``"rocm"``); everything else is spelled the same by both.
"""

from __future__ import annotations

_EXPORT_NAMES = {"gpu": "cuda"}


def export_platform(platform: str) -> str:
    """The ``jax.export`` lowering platform for a JAX backend name (``"gpu"`` -> ``"cuda"``)."""
    platform = platform.lower()
    return _EXPORT_NAMES.get(platform, platform)
