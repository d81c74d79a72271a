"""Sparse Jacobians and Hessians (``Sparse``, DI's ``AutoSparse``) with asdex.

At preparation, ``SparseEngine.prepare`` has its pattern found once (asdex's jaxpr-based
``jacobian_sparsity`` / ``hessian_sparsity``, or the pattern the descriptor carries) and
coloured (asdex's greedy column/row colouring, star colouring for symmetric Hessians)
by a ``sparse_detection.Detector``: in the preparing thread for the library, in a
bounded child process for a server (``ComputeLimits.sparsity``; see
``sparse_detection`` and ``dxserve.server.sandboxes.sparsity``). The compiled operator then does
one pass of the dense engine per colour (pushforwards for column colourings, pullbacks
for row colourings, HVPs for Hessians) on the 0/1 seed matrix, and asdex's
``decompress_data`` gathers the nonzeros from the compressed products. Results are
``jax.experimental.sparse.BCOO`` matrices of the flattened map, ``(y.size, x.size)``
(``(x.size, x.size)`` for Hessians), entries sorted row-major; the compiled executable
returns only their ``data`` and the constant indices are attached afterwards, so
nothing but nnz values leaves the device. The engine keeps the results' wire form
without data too (``sparse_wire``), so only ``data`` is new per call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.sparse import BCOO

from dxcontract import sparse as wire
from dxcontract.backends import (
    Auto,
    Backend,
    JaxForward,
    JaxReverse,
    SecondOrder,
    Sparse,
)
from dxcontract.errors import (
    InvalidBackendError,
    ShapeMismatchError,
    UnsupportedOperatorError,
)
from dxcontract.operators import OPERATORS
from dxserve.core.backends.engine import Engine, Fn
from dxserve.core.backends.plugins import PLUGINS
from dxserve.core.backends.real_parts import for_complex
from dxserve.core.footprint import array_bytes
from dxserve.frameworks.jax.sparse_detection import Detector, InProcessDetector, PatternJob, asdex

__all__ = ["BCOO", "SparseEngine", "resolve_sparse", "sparse_engines", "sparse_wire"]


#: the library's detector: asdex in the preparing thread, no budget
IN_PROCESS = InProcessDetector()


# --- resolution and engines ----------------------------------------------------
def _mode_of(dense: Backend) -> str:
    """The direction a first-order ``dense`` engine computes natively."""
    plugin = PLUGINS[dense.type]
    assert plugin.engine is not None
    return plugin.engine(dense, traced=True, nested=False).mode


def resolve_sparse(backend: Sparse, family: str, *, traced: bool, n: int = 0, m: int = 0) -> Backend:
    """``Sparse`` for ``family``: the dense backend's resolution for families it does not
    serve; for Jacobians and Hessians its dense part resolved and its colouring named."""
    from dxserve.core.backends.selection import resolve_backend

    if not OPERATORS[family].sparse:  # the spec says: the dense backend serves it
        return resolve_backend(backend.dense, family, traced=traced, n=n, m=m)
    dense, coloring = backend.dense, backend.coloring
    if family == "jacobian":
        if isinstance(dense, SecondOrder):
            raise UnsupportedOperatorError(
                "a sparse Jacobian needs a first-order dense backend, not second-order",
                field="backend.dense",
            )
        if isinstance(dense, Auto):
            if coloring == "row":
                dense = JaxReverse()
            elif coloring in ("column", "star"):
                dense = JaxForward()
            # None: stays auto, and preparation takes the colouring with fewer colours
        elif coloring is None and traced:
            coloring = "row" if _mode_of(dense) == "reverse" else "column"
    elif family == "hessian":
        if coloring == "row":
            raise InvalidBackendError(
                "a Hessian is coloured by columns ('column') or symmetrically ('star')",
                field="backend.coloring",
            )
        dense = resolve_backend(dense, "hessian", traced=traced, n=n, m=m)
        coloring = coloring or "star"
    return replace(backend, dense=dense, coloring=coloring)


def sparse_engines(backend: Sparse, *, traced: bool) -> tuple[Engine, Engine | None]:
    """``(SparseEngine, inner)``: for a Hessian the sparse engine drives the outer mode
    and ``inner`` is the gradient's engine, as for ``SecondOrder``."""
    from dxserve.core.backends.selection import engine_for, engines_for

    if not traced:
        raise UnsupportedOperatorError(
            "sparse needs a function JAX can trace (the pattern is read from its jaxpr); "
            "use a dense backend for black-box functions",
            field="backend",
        )
    dense = backend.dense
    if isinstance(dense, SecondOrder):
        outer, inner = engines_for(dense, traced=traced)
        return SparseEngine(backend, outer), inner
    if isinstance(dense, Auto):
        return SparseEngine(backend, None), None  # the engine follows the colouring
    return SparseEngine(backend, engine_for(dense, traced=traced)), None


# --- the engine ---------------------------------------------------------------------
class SparseEngine(Engine):
    """One dense pass per colour, then decompression into a BCOO; see the module doc.

    ``prepare`` must run first (preparation calls it): it sets ``coloring`` (asdex's
    ``ColoredPattern``), ``indices`` ((nnz, 2) int32 on the device) and the report.
    """

    def __init__(self, backend: Sparse, dense: Engine | None) -> None:
        self.backend = backend
        self.dense = dense
        self.kind = "jacobian"  # or "hessian": what the pattern is of
        self.coloring: Any = None
        self.pattern: Any = None  # asdex SparsityPattern
        self.shape: tuple[int, int] = (0, 0)
        self.indices: Any = None
        self.y_shape: tuple[int, ...] = ()
        self._report: dict[str, Any] = {}
        #: the results' wire object without ``data`` (see ``sparse_wire``)
        self.wire: dict[str, Any] | None = None
        self.values = True  # False for the sparsity operator: a pattern has no data
        #: the backend named in refusals, once complex numbers are served (``for_complex``)
        self.complex_name: str | None = None

    # the primitives: the dense engine's (other operators never reach this engine)
    def pushforward(self, g: Fn, x: Any, tx: Any) -> tuple[Any, Any]:
        return self._dense().pushforward(g, x, tx)

    def pullback(self, g: Fn, x: Any, ty: Any) -> tuple[Any, Any]:
        return self._dense().pullback(g, x, ty)

    def for_complex(self, name: str) -> Engine:
        """Complex x or f(x): the dense passes in JAX's convention (``RealParts``), and
        ``jacobian`` combines them into JAX's Jacobian (see there)."""
        self.complex_name = name
        if self.dense is not None:
            self.dense = for_complex(self.dense, name)
        return self

    def _dense(self) -> Engine:
        if self.dense is None:
            raise RuntimeError("SparseEngine.prepare has not run")
        return self.dense

    # --- preparation: the pattern and its colouring, once ----------------------
    def prepare(self, family: str, f: Callable, inputs: Any, limits: Any = None) -> None:
        """Find and colour the pattern with ``limits.sparsity`` (a ``Detector``; the
        library's: in this thread, unbounded)."""
        x, contexts, y = inputs.x, inputs.contexts, inputs.y
        for tree, field, what in ((x, "x", "input"), (y, "function", "output")):
            if isinstance(tree, dict | list | tuple) or not hasattr(tree, "shape"):
                # the pattern is of one flat matrix; blocks of pytrees are dense-only
                raise UnsupportedOperatorError(
                    f"sparse backends need an array {what}, not a pytree; use a dense "
                    "backend for Jacobian/Hessian blocks of pytrees",
                    field=field,
                )
        if self.complex_name is not None:
            self._refuse_complex(family, x, y)
        detector: Detector = getattr(limits, "sparsity", None) or IN_PROCESS
        n, m = int(np.size(x)), int(np.prod(np.shape(y), dtype=np.int64))
        self.y_shape = tuple(np.shape(y))
        if family == "sparsity":
            self.kind = "hessian" if np.shape(y) == () else "jacobian"
        else:
            self.kind = family
        shape = (n, n) if self.kind == "hessian" else (m, n)
        colour = family != "sparsity"
        if colour and self.kind == "jacobian" and self.backend.coloring == "star" and m != n:
            raise InvalidBackendError(
                f"star colouring needs a square Jacobian, this one is {list(shape)}",
                field="backend.coloring",
            )
        given = self.backend.sparsity
        pair = None
        if given is not None:
            if tuple(given.shape) != shape:
                raise ShapeMismatchError(
                    f"the given sparsity pattern is {list(given.shape)}, but this "
                    f"{self.kind} is {list(shape)} (flattened: y.size by x.size)",
                    field="backend.sparsity",
                )
            detector.budget.check_nnz(given.nnz, "given")
            rows, cols = given.rows, given.cols
            if self.kind == "hessian":  # a Hessian is symmetric: so is its pattern
                keys = np.unique(np.concatenate([rows * n + cols, cols * n + rows]))
                rows, cols = keys // max(n, 1), keys % max(n, 1)
            pair = (rows, cols)
        job = PatternJob(self.kind, shape, self.backend.coloring, colour, pair)
        found = detector.analyse(job, f, x, contexts)
        self.pattern, self.coloring, self.shape = found.pattern, found.coloring, shape
        report: dict[str, Any] = {
            "of": self.kind, "shape": list(shape), "nnz": int(found.pattern.nnz),
            "source": "given" if given is not None else "detected",
        }
        if colour:
            self._choose_dense()
            report.update(
                colors=int(self.coloring.num_colors), coloring=self._coloring_name(),
                mode=self._mode_name(),
            )
        report["seconds"] = round(found.seconds, 6)
        self._report = {"sparsity": report}
        with jax.ensure_compile_time_eval():
            rows = np.asarray(found.pattern.rows, dtype=np.int32)
            cols = np.asarray(found.pattern.cols, dtype=np.int32)
            self.indices = jnp.asarray(np.stack([rows, cols], axis=1).reshape(-1, 2))
        # the results' wire form without data, made once (only data is new per call)
        self.wire = wire.wire_object(self.backend.format, shape, rows, cols)
        self.values = colour

    def _refuse_complex(self, family: str, x: Any, y: Any) -> None:
        """The sparse cases JAX's convention for complex numbers rules out."""
        hessian = family == "hessian" or (family == "sparsity" and np.shape(y) == ())
        if not hessian:
            return
        if np.dtype(y.dtype).kind == "c":
            raise UnsupportedOperatorError(
                "sparse Hessians of complex-valued functions are not served; use a dense "
                "backend ('jax-reverse' or 'auto')",
                field="backend",
            )
        if family == "hessian" and self.backend.coloring == "star":
            raise UnsupportedOperatorError(
                "star colouring recovers a symmetric Hessian, and JAX's Hessian of a "
                "real function of complex x (jax.jacfwd(jax.grad(f), holomorphic=True)) "
                "is not symmetric; use coloring 'column', or a dense backend",
                field="backend.coloring",
            )

    def _choose_dense(self) -> None:
        """With ``dense="auto"``, the engine follows the colouring asdex picked."""
        if self.dense is None:
            from dxserve.core.backends.selection import engine_for

            chosen = JaxReverse() if self.coloring.mode == "rev" else JaxForward()
            self.dense = engine_for(chosen, traced=True)
            if self.complex_name is not None:
                self.dense = for_complex(self.dense, self.complex_name)

    def _coloring_name(self) -> str:
        if self.coloring.symmetric:
            return "star"
        return "row" if self.coloring.mode == "rev" else "column"

    def _mode_name(self) -> str:
        if self.kind == "hessian":
            dense = self.backend.dense
            if isinstance(dense, SecondOrder):
                return f"{_direction(dense.outer)}-over-{_direction(dense.inner)}"
            return "hvp"
        return "reverse" if self.coloring.mode == "rev" else "forward"

    def result_elements(self, family: str, n: int, m: int, k: int) -> int | None:
        nnz = int(self.pattern.nnz) if self.pattern is not None else None
        if nnz is None:
            return None
        return {"jacobian": nnz + m, "hessian": nnz + n + 1}.get(family, nnz)

    def report(self) -> dict[str, Any]:
        return self._report

    def held_bytes(self) -> int:
        return array_bytes(self.pattern, self.coloring, self.indices, self.wire, self.backend)

    # --- the compiled maths ----------------------------------------------------------
    def jacobian(self, g: Fn, x: Any) -> tuple[Any, Any]:
        """``(g(x), J)``: ``J`` a BCOO of shape (y.size, x.size) with the pattern's entries
        (for the Hessian family ``g`` is the gradient and ``J`` the Hessian)."""
        c = self.coloring
        dense = self._dense()
        k = int(c.num_colors)
        spec = jax.eval_shape(g, x)
        complex_x, complex_y = jnp.iscomplexobj(x), jnp.iscomplexobj(spec)
        # x's dtype, complex where x or y is
        dtype = jnp.result_type(x.dtype, spec.dtype) if complex_x or complex_y else x.dtype
        if k == 0:
            y = g(x)
            data = jnp.zeros((0,), dtype=dtype)
            return y, self._bcoo(data)
        seeds = c.colors == np.arange(k)[:, None]  # (k, dim) of 0/1
        if c.mode == "rev":  # one pullback per colour of rows
            ones = jnp.reshape(jnp.asarray(seeds, spec.dtype), (k, *spec.shape))
            y, out = dense.pullback(g, x, ones)
            if complex_y:  # JAX's rows ∂g/∂x, from the pullbacks of 1 and of i
                _, out_i = dense.pullback(g, x, 1j * ones)
                out = (jnp.real(out) - 1j * jnp.real(out_i)).astype(dtype)
        else:  # one pushforward (HVP for a Hessian, either direction) per colour of columns
            push = dense.symmetric_products if self.kind == "hessian" else dense.pushforward
            ones = jnp.reshape(jnp.asarray(seeds, x.dtype), (k, *np.shape(x)))
            y, out = push(g, x, ones)
            if complex_x and not complex_y:  # real-valued g: ∂g/∂x - i ∂g/∂y (jax.jacrev's)
                _, out_i = push(g, x, 1j * ones)
                out = out - 1j * out_i
        compressed = jnp.reshape(out, (k, -1))
        data = asdex().decompress_data(compressed, c)
        return y, self._bcoo(data)

    def _bcoo(self, data: Any) -> BCOO:
        matrix = BCOO(
            (data, self.indices), shape=self.shape, indices_sorted=True, unique_indices=True
        )
        matrix._dxserve_engine = self  # its wire form, for sparse_wire
        return matrix

    def pattern_bcoo(self) -> BCOO:
        """The pattern alone: a BCOO of int8 ones (int8, not bool, so ``todense`` works)."""
        return self._bcoo(jnp.ones((int(self.pattern.nnz),), dtype=jnp.int8))

    def compile(self, fn: Callable, args: tuple, key: Any = None) -> Callable:
        """Compile ``fn`` so the executable returns the BCOO results' data only (the
        indices are constants, attached again here without a device copy)."""
        is_sparse = lambda v: isinstance(v, BCOO)  # noqa: E731
        spec = jax.eval_shape(fn, *args)
        leaves, treedef = jax.tree_util.tree_flatten(spec, is_leaf=is_sparse)
        sparse_at = tuple(i for i, leaf in enumerate(leaves) if is_sparse(leaf))

        def data_only(*a: Any) -> list:
            out = jax.tree_util.tree_flatten(fn(*a), is_leaf=is_sparse)[0]
            return [leaf.data if is_sparse(leaf) else leaf for leaf in out]

        exe = self._dense().compile(data_only, args, key) if self.dense else jax.jit(data_only)

        def run(*a: Any) -> Any:
            out = list(exe(*a))
            for i in sparse_at:
                out[i] = self._bcoo(out[i])
            return jax.tree_util.tree_unflatten(treedef, out)

        run.__wrapped__ = exe  # type: ignore[attr-defined]  # its size: footprint
        return run


def _direction(b: Backend) -> str:
    return {"jax-forward": "forward", "jax-reverse": "reverse"}.get(b.type, b.type)


# --- results on the wire ---------------------------------------------------------------
def sparse_wire(matrix: BCOO) -> dict[str, Any]:
    """A BCOO result -> its wire object (``dxcontract.sparse``) with numpy arrays; the index
    arrays the engine made at preparation are reused, only ``data`` is new."""
    engine = getattr(matrix, "_dxserve_engine", None)
    if isinstance(engine, SparseEngine) and engine.wire is not None and (
        matrix.indices is engine.indices
    ):
        return {**engine.wire, "data": np.asarray(matrix.data)} if engine.values else engine.wire
    data = np.asarray(matrix.data)
    # another BCOO (a batched call's row): sort its entries row-major
    idx = np.asarray(matrix.indices).reshape(-1, 2).astype(np.int64)
    order = np.lexsort((idx[:, 1], idx[:, 0]))
    shape = (int(matrix.shape[0]), int(matrix.shape[1]))
    return wire.wire_object("csr", shape, idx[order, 0], idx[order, 1], data[order])
