"""Sparse results read back: ``scipy.sparse`` arrays when scipy is installed.

The wire form itself is the contract's (``dxcontract.sparse``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dxcontract.errors import MalformedRequestError
from dxcontract.sparse import (
    FORMATS,
    SparseMatrix,
    csr_indptr,
    index_dtype,
    is_sparse,
    wire_object,
)

__all__ = [
    "FORMATS", "SparseMatrix", "csr_indptr", "from_wire", "index_dtype", "is_sparse",
    "wire_object",
]


def _scipy() -> Any:
    try:
        import scipy.sparse as sp
    except ImportError:
        return None
    return sp


def from_wire(value: dict, field: str, *, use_scipy: bool | None = None) -> Any:
    """A decoded sparse wire object -> scipy array (if installed) or ``SparseMatrix``.

    ``value``'s arrays are already decoded (numpy views from the binary framing, or
    typed objects and lists from JSON). ``use_scipy`` None: when scipy is importable.
    """
    from dxcontract.encodings.json_lists import to_tree

    fmt = value["format"]
    if fmt not in FORMATS:
        raise MalformedRequestError(f"unknown sparse format {fmt!r}", field=f"{field}.format")
    try:
        m, n = (int(d) for d in np.asarray(value["shape"]).tolist())
        indices = to_tree(value["indices"], f"{field}.indices", default_dtype=np.int64)
        indptr = (
            to_tree(value["indptr"], f"{field}.indptr", default_dtype=np.int64)
            if fmt == "csr" else None
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise MalformedRequestError(f"sparse result: {exc}", field=field) from None
    nnz = indices.shape[0]
    if "data" in value:
        data = to_tree(value["data"], f"{field}.data")
    else:  # a pattern: every entry present
        data = np.ones(nnz, dtype=bool)
    sp = _scipy() if use_scipy is not False else None
    if sp is None:
        if use_scipy:
            from dxcontract.extras import install_hint

            raise ImportError(f"scipy is not installed: {install_hint('scipy')}")
        return SparseMatrix(fmt, (m, n), indices, data, indptr)
    if fmt == "csr":
        return sp.csr_array((data, indices, indptr), shape=(m, n))
    return sp.coo_array((data, (indices[:, 0], indices[:, 1])), shape=(m, n))
