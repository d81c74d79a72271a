"""Floating-point dtypes as dxserve counts them: numpy's, and bfloat16 (``ml_dtypes``).

numpy does not know bfloat16 as a float: its dtype has kind ``'V'`` (``'<V2'``) and
``np.issubdtype(bfloat16, np.floating)`` is False. Code that branches on a dtype asks
these instead. Importing this module registers the name ``"bfloat16"`` with numpy
(``np.dtype("bfloat16")``), as importing ``ml_dtypes`` does.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
#: floating dtypes narrower than float32: finite differences cannot serve them
LOW_PRECISION = frozenset((np.dtype(np.float16), BFLOAT16))


def is_floating(dtype: Any) -> bool:
    """Is ``dtype`` real floating point (float16/32/64, bfloat16, either byte order)?"""
    dt = np.dtype(dtype)
    return dt.kind == "f" or dt == BFLOAT16 or dt.newbyteorder("=") == BFLOAT16


def is_inexact(dtype: Any) -> bool:
    """Floating point or complex (what can be differentiated)."""
    dt = np.dtype(dtype)
    return dt.kind == "c" or is_floating(dt)


def kind(dtype: Any) -> str:
    """numpy's ``dtype.kind``, except ``'f'`` for bfloat16 too."""
    dt = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
    k = dt.kind
    return "f" if k == "V" and is_floating(dt) else k


def finfo(dtype: Any) -> Any:
    """``np.finfo`` for every floating dtype, bfloat16 included (eps, max, ...)."""
    return ml_dtypes.finfo(np.dtype(dtype).newbyteorder("="))
