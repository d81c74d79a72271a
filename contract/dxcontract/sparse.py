"""Sparse matrices on the wire, shared by the server (encoding) and the client (decoding).

A sparse result is a JSON object whose ``"format"`` member is a string; a dense
result never is one (its leaves are arrays), so that member is the marker:

    {"format": "csr", "shape": [m, n], "indptr": int[m + 1], "indices": int[nnz], "data": [nnz]}
    {"format": "coo", "shape": [m, n], "indices": int[nnz, 2], "data": [nnz]}

``indptr`` and ``indices`` are int32 when every index fits, else int64: typed arrays in
every encoding (typed objects in JSON, raw buffers in the binary framing, which the
encoders write without copying). ``data`` has the result's dtype. A pattern alone
(the ``sparsity`` operator) has no ``data``. Entries are sorted row-major, so the CSR
and COO forms carry the same ``data`` in the same order.

The client reads them back (``dxclient.sparse.from_wire``) as ``scipy.sparse``
arrays when scipy is installed, else as a ``SparseMatrix`` with ``toarray()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

FORMATS = ("csr", "coo")


def is_sparse(value: Any) -> bool:
    """Is this decoded result the sparse wire object (a dict with a string ``format``)?"""
    return type(value) is dict and type(value.get("format")) is str


def index_dtype(*extents: int) -> np.dtype:
    """int32 when every index (and nnz) fits in it, else int64."""
    return np.dtype(np.int32 if max(extents, default=0) < 2**31 else np.int64)


def csr_indptr(rows: np.ndarray, m: int, dtype: Any) -> np.ndarray:
    """CSR row pointers (m + 1,) of row-major sorted COO ``rows``."""
    indptr = np.zeros(m + 1, dtype=dtype)
    np.cumsum(np.bincount(rows, minlength=m), out=indptr[1:])
    return indptr


def wire_object(
    fmt: str, shape: tuple[int, int], rows: np.ndarray, cols: np.ndarray, data: Any = None
) -> dict[str, Any]:
    """The wire object of a row-major sorted COO matrix (``data`` None: a pattern)."""
    m, n = shape
    idx = index_dtype(m, n, int(rows.size))
    out: dict[str, Any] = {"format": fmt, "shape": [int(m), int(n)]}
    if fmt == "csr":
        out["indptr"] = csr_indptr(rows, m, idx)
        out["indices"] = cols.astype(idx, copy=False)
    else:
        out["indices"] = np.stack([rows, cols], axis=1).astype(idx, copy=False)
    if data is not None:
        out["data"] = data
    return out


@dataclass(frozen=True)
class SparseMatrix:
    """A sparse matrix as it came over the wire, when scipy is not installed.

    ``format`` is ``"csr"`` (``indptr``: (m + 1,), ``indices``: column of each entry)
    or ``"coo"`` (``indices``: (nnz, 2) rows and columns); ``data``: (nnz,) values
    (booleans for a pattern). ``toarray()`` gives the dense ``(m, n)`` numpy array.
    """

    format: str
    shape: tuple[int, int]
    indices: np.ndarray
    data: np.ndarray
    indptr: np.ndarray | None = None

    @property
    def nnz(self) -> int:
        return int(self.data.size)

    def coords(self) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, cols)`` of the entries, (nnz,) each."""
        if self.format == "coo":
            return self.indices[:, 0], self.indices[:, 1]
        assert self.indptr is not None
        rows = np.repeat(np.arange(self.shape[0]), np.diff(self.indptr))
        return rows, self.indices

    def toarray(self) -> np.ndarray:
        """The dense ``(m, n)`` array (zeros elsewhere)."""
        out = np.zeros(self.shape, dtype=self.data.dtype)
        rows, cols = self.coords()
        np.add.at(out, (rows, cols), self.data)
        return out
