"""Footprints: the host (or device) bytes a cached object keeps alive, estimated.

The caches of compiled operators bound their bytes, so each thing they hold needs a
size: ``executable_bytes`` for a compiled executable, ``array_bytes`` for the arrays
an object holds (a sparsity pattern, its colouring, index arrays). Estimates, not
exact counts: what matters is that a large entry counts as large.

An executable's size is XLA's own figure for its generated code where the backend
gives one (``memory_analysis()``; 0 on CPU), at least ``EXECUTABLE_BYTES`` plus
``CODE_BYTES_PER_HLO_CHAR`` per character of its optimized HLO (measured on CPU: a
small compiled Hessian or Jacobian, ~9-12 kB of HLO text, adds ~0.5-0.6 MB to the process), plus
the constants of the program (read from the HLO's ``constant`` instructions: XLA
embeds them in the executable, and a sparse operator's colouring seeds and gather
indices can be tens of megabytes).
"""

from __future__ import annotations

import math
import re
import sys
import weakref
from typing import Any

import numpy as np

#: bytes an executable holds whatever its size (code, runtime objects, JAX's wrappers)
EXECUTABLE_BYTES = 384 * 1024
#: generated code per character of optimized HLO text, where XLA reports no code size
CODE_BYTES_PER_HLO_CHAR = 16
#: a callable that is not a compiled executable (a black-box function run as it is, a
#: ``jax.jit`` wrapper compiling on first call): counted as one small executable
OPAQUE_BYTES = EXECUTABLE_BYTES

_ITEMSIZE = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 1, "u4": 1,
}
# "%constant.2 = f64[1000,1000]{1,0} constant({...})": the type and dimensions
_CONSTANT = re.compile(r"=\s*([a-z]+[0-9]*)(?:[a-z0-9]*)\[([0-9,]*)\][^=]*?\sconstant\(")
_sizes: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def executable_bytes(executable: Any) -> int:
    """The bytes ``executable`` keeps alive (see the module); remembered per object.

    Follows ``__wrapped__`` (a wrapper around a compiled executable: the sparse engine's,
    the executable cache's ``_Loaded``)."""
    try:
        known = _sizes.get(executable)
    except TypeError:  # not weak-referenceable: measured every time
        known = None
    if known is not None:
        return known
    size = _measure(executable)
    try:
        _sizes[executable] = size
    except TypeError:
        pass
    return size


def _measure(executable: Any) -> int:
    inner = getattr(executable, "__wrapped__", None)
    if inner is not None and inner is not executable:
        return executable_bytes(inner)
    analysis = getattr(executable, "memory_analysis", None)
    text_of = getattr(executable, "as_text", None)
    if analysis is None or text_of is None:
        return OPAQUE_BYTES
    try:
        stats = analysis()
        code = sum(
            int(getattr(stats, name, 0) or 0)
            for name in ("generated_code_size_in_bytes", "host_generated_code_size_in_bytes")
        ) if stats is not None else 0
        text = text_of() or ""
    except Exception:  # noqa: BLE001 - no analysis on this backend: a small executable
        return OPAQUE_BYTES
    code = max(code, EXECUTABLE_BYTES + CODE_BYTES_PER_HLO_CHAR * len(text))
    return code + constant_bytes(text)


def constant_bytes(hlo_text: str) -> int:
    """Bytes of the array constants an HLO module's text declares."""
    total = 0
    for dtype, dims in _CONSTANT.findall(hlo_text):
        itemsize = _ITEMSIZE.get(dtype)
        if itemsize is None:
            continue
        total += itemsize * math.prod(int(d) for d in dims.split(",") if d)
    return total


def array_bytes(*objects: Any, depth: int = 4) -> int:
    """Bytes of the numpy and JAX arrays held in ``objects``: the arrays themselves and
    those reachable through attributes, slots, dicts, lists and tuples, ``depth`` levels
    down; each array counted once."""
    seen: set[int] = set()
    return sum(_arrays(obj, depth, seen) for obj in objects)


def _array_types() -> tuple[type, ...]:
    """numpy's array type, and JAX's once JAX is loaded (no JAX array exists before)."""
    jax = sys.modules.get("jax")
    return (np.ndarray, jax.Array) if jax is not None else (np.ndarray,)


def _arrays(obj: Any, depth: int, seen: set[int]) -> int:
    if obj is None or isinstance(obj, (str, bytes, int, float, bool, type)) or id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, _array_types()):
        try:
            return int(obj.nbytes)
        except Exception:  # noqa: BLE001 - a deleted or abstract array holds nothing here
            return 0
    if depth <= 0 or callable(obj):  # functions and classes hold code, not data here
        return 0
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    else:
        children = list(getattr(obj, "__dict__", {}).values())
        for cls in type(obj).__mro__:
            slots = getattr(cls, "__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if isinstance(name, str) and name not in ("__dict__", "__weakref__"):
                    children.append(getattr(obj, name, None))
    return sum(_arrays(child, depth - 1, seen) for child in children)
