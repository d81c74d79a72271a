"""How a failure of the user's function or of the device is told: out of memory or short.

A device or host out of memory becomes a 503 the caller may retry (``out_of_memory``);
any other failure of the function is named in one short line (``_short``).
"""

from __future__ import annotations

from dxcontract.errors import OverloadedError


def out_of_memory(exc: BaseException) -> OverloadedError | None:
    """``exc`` as a 503 if it says the device (XLA's ``RESOURCE_EXHAUSTED``) or the host
    (``MemoryError``) ran out of memory, else None: the same request may fit later.

    Wherever a device buffer is touched (running, compiling, copying a result to the
    host, a batch), its out-of-memory error goes through here.
    """
    if not isinstance(exc, MemoryError) and "RESOURCE_EXHAUSTED" not in str(exc):
        return None
    return OverloadedError(
        f"the device ran out of memory ({_short(exc)}); retry later or send less",
        field="x",
        retry_after=5,
    )


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    if len(text) > 1 and text[0].endswith("Traceback (most recent call last):"):
        # raised in a host callback (a piece computed outside JAX, DifferentiateWith):
        # the traceback's last line says what failed
        return f"{type(exc).__name__} in a callback: {text[-1].strip()}"[:500]
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]
