"""Finding and colouring a sparsity pattern, within budgets: the part asdex does.

``SparseEngine.prepare`` hands a ``Detector`` one ``PatternJob`` (what the pattern is
of, its shape, the colouring asked for, the pattern if the descriptor carries one) and
gets back an ``Analysis``: asdex's ``SparsityPattern`` and, unless only the pattern is
wanted, its ``ColoredPattern``. Two detectors exist:

* ``InProcessDetector`` runs asdex in the preparing thread. The library uses it (its
  callables are the user's own Python, in the user's own process).
* ``dxserve.server.sandboxes.sparsity.ChildDetector`` runs the same steps (``analyse_here``) in a
  resource-limited child process; a server uses it, so neither detection's memory nor
  colouring's time (numba holds the interpreter lock) reaches the serving process.

What each step costs, and what bounds it (``DetectionBudget``):

* detection keeps a Python set of indices per element of every intermediate: about
  150 to 700 bytes per nonzero, known only once it ran. Nothing bounds it in process;
  the child's memory limit does.
* a pattern of ``nnz`` entries makes a prep hold about ``BYTES_PER_NONZERO`` bytes per
  entry: ``max_nnz`` refuses larger ones, given or detected, before they are coloured.
* greedy colouring visits every pair of entries that share a row (colouring columns),
  a column (rows) or a vertex (star): ``colouring_steps`` counts them from the pattern
  in linear time, and a colouring that could not finish within the time left even at
  ``STEPS_PER_SECOND`` is refused before it starts.
* a colouring of ``k`` colours makes the operator hold a ``(k, dim)`` seed matrix:
  refused past ``max_seed_bytes``, from a lower bound on ``k`` (``fewest_colours``)
  before colouring, and from ``k`` itself before the matrix is built.

Refusals are 422s naming ``backend``: ``BudgetExceededError`` (``limit`` names the
setting) or ``SparsityDetectionError``, each with the fix (pass the pattern as
``Sparse(dense, sparsity=...)``, or raise the setting).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from dxcontract.errors import BudgetExceededError, SparsityDetectionError

__all__ = [
    "BYTES_PER_NONZERO", "STEPS_PER_SECOND", "Analysis", "Colouring", "DetectionBudget",
    "Detector",
    "InProcessDetector", "PatternJob", "analyse_here", "asdex", "colour_arrays",
    "colored_pattern", "colouring_steps",
    "decode", "encode", "warm_up_jax",
]

#: Bytes a prep holds per nonzero of its pattern, measured (bench/sparse_detection.py:
#: ~200 at n = 10^5 and 10^6): index arrays (asdex's pattern and colouring, the BCOO's,
#: the wire form) and the compiled gather, whose indices are constants of the program.
BYTES_PER_NONZERO = 200
#: Greedy colouring steps per second assumed when refusing a colouring in advance:
#: several times what numba does here (about 3.5e8/s), so a refusal means the colouring
#: could not have finished on any machine, not that it might be slow.
STEPS_PER_SECOND = 2e9

_ASDEX: list[Any] = []


def asdex() -> Any:
    """asdex, imported once (numba comes with it: a server that never sees a sparse
    backend does not load it)."""
    if not _ASDEX:
        import asdex as module

        _ASDEX.append(module)
    return _ASDEX[0]


@dataclass(frozen=True)
class PatternJob:
    """What to find: the pattern of a ``kind`` ("jacobian" or "hessian") of ``shape``
    ((m, n) of the flattened map), coloured as ``coloring`` asks (None, "column", "row",
    "star") unless ``colour`` is False. ``given``: the descriptor's (rows, cols), int64
    (nnz,) each, sorted row-major (symmetric for a Hessian), or None to detect it."""

    kind: str
    shape: tuple[int, int]
    coloring: str | None
    colour: bool = True
    given: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def symmetric(self) -> bool:
        """Star colouring: asked for, or a Hessian's default."""
        return self.coloring == "star" or (self.kind == "hessian" and self.coloring != "column")


@dataclass(frozen=True)
class Analysis:
    """asdex's ``SparsityPattern`` and ``ColoredPattern`` (None when not coloured), and
    the ``seconds`` spent finding them."""

    pattern: Any
    coloring: Any
    seconds: float


@dataclass(frozen=True)
class DetectionBudget:
    """Bounds on one analysis (None: unbounded)."""

    #: most nonzeros of a pattern (DXSERVE_MAX_NNZ)
    max_nnz: int | None = None
    #: seconds detection and colouring may take together (DXSERVE_SPARSE_DETECTION_SECONDS)
    seconds: float | None = None
    #: bytes of the float64 seed matrix a colouring makes the operator hold
    #: (DXSERVE_MAX_REQUEST_MEMORY_BYTES)
    max_seed_bytes: int | None = None

    def check_nnz(self, nnz: int, source: str) -> None:
        """``BudgetExceededError`` when a pattern of ``nnz`` entries is over ``max_nnz``."""
        if self.max_nnz is not None and nnz > self.max_nnz:
            raise BudgetExceededError(
                f"the {source} sparsity pattern has {nnz:,} nonzeros, over the limit of "
                f"{self.max_nnz:,} (DXSERVE_MAX_NNZ; a prep holds about "
                f"{BYTES_PER_NONZERO} bytes per nonzero); use a dense backend, or raise "
                "DXSERVE_MAX_NNZ",
                field="backend", limit="max_nnz", estimate=nnz,
            )

    def check_steps(self, steps: int, left: float | None) -> None:
        """Refuse a colouring of ``steps`` that cannot finish in ``left`` seconds."""
        if left is None:
            return
        if steps / STEPS_PER_SECOND > left:
            raise BudgetExceededError(
                f"colouring this pattern takes about {steps:.3g} steps, more than "
                f"{max(left, 0):.3g} s left allows even at {STEPS_PER_SECOND:.0e} steps/s "
                "(DXSERVE_SPARSE_DETECTION_SECONDS): the pattern is too dense to colour in "
                "time; use a dense backend, or raise DXSERVE_SPARSE_DETECTION_SECONDS",
                field="backend", limit="sparse_detection_seconds",
                estimate=steps / STEPS_PER_SECOND,
            )

    def check_seeds(self, colours: int, dim: int) -> None:
        """Refuse a colouring whose ``(colours, dim)`` float64 seed matrix is over budget."""
        need = 8 * colours * dim
        if self.max_seed_bytes is not None and need > self.max_seed_bytes:
            raise BudgetExceededError(
                f"the colouring has {colours:,} colours, so the operator would hold a "
                f"({colours:,}, {dim:,}) seed matrix of {need:,} bytes, over the limit of "
                f"{self.max_seed_bytes:,} (DXSERVE_MAX_REQUEST_MEMORY_BYTES); this pattern "
                "is too dense for a sparse backend: use a dense one",
                field="backend", limit="max_request_memory_bytes", estimate=need,
            )


class Detector(Protocol):
    """Finds and colours patterns (a ``ComputeLimits.sparsity`` strategy)."""

    budget: DetectionBudget

    def analyse(self, job: PatternJob, f: Callable, x: Any, contexts: tuple) -> Analysis:
        """The pattern (and colouring) of ``f`` at ``x``'s shape, or a 422 ``DxError``."""
        ...


class InProcessDetector:
    """asdex in the calling thread, within ``budget`` (the library's detector: no time
    bound, since a running detection cannot be stopped from outside the thread)."""

    def __init__(self, budget: DetectionBudget | None = None) -> None:
        self.budget = budget or DetectionBudget()

    def analyse(self, job: PatternJob, f: Callable, x: Any, contexts: tuple) -> Analysis:
        started = time.perf_counter()
        pattern, colouring = analyse_here(job, f, x, contexts, self.budget)
        coloring = None if colouring is None else colored_pattern(pattern, colouring, self.budget)
        return Analysis(pattern, coloring, time.perf_counter() - started)


# --- the steps, wherever they run ---------------------------------------------------
def analyse_here(
    job: PatternJob, f: Callable | None, x: Any, contexts: tuple, budget: DetectionBudget,
) -> tuple[Any, Colouring | None]:
    """``(SparsityPattern, Colouring or None)`` for ``job``, in this process, each step
    checked against ``budget`` before the next starts."""
    started = time.perf_counter()
    ax = asdex()
    if job.given is not None:
        budget.check_nnz(int(job.given[0].size), "given")
        pattern = ax.SparsityPattern.from_coo(job.given[0], job.given[1], job.shape)
    else:
        assert f is not None
        pattern = detect(job.kind, f, x, contexts)
        budget.check_nnz(int(pattern.nnz), "detected")
    if not job.colour:
        return pattern, None
    left = None if budget.seconds is None else budget.seconds - (time.perf_counter() - started)
    budget.check_steps(colouring_steps(pattern.rows, pattern.cols, job.shape, job), left)
    fewest, dim = fewest_colours(pattern.rows, pattern.cols, job)
    budget.check_seeds(fewest, dim)  # before colouring, from what any colouring needs
    colouring = colour_arrays(pattern, job)
    budget.check_seeds(int(colouring.count), int(colouring.colors.size))
    return pattern, colouring


def warm_up_jax() -> None:
    """Start JAX's backend and detect, colour and encode a tiny pattern once, in 64-bit
    mode as the server traces, so the next analysis in this process finds JAX's caches
    filled (a sandboxed detector's child does it while it waits for its job)."""
    import jax.numpy as jnp

    from dxserve.frameworks.jax.precision import float64_scope

    job = PatternJob("jacobian", (4, 4), "column")
    with float64_scope():
        pattern, colouring = analyse_here(
            job, lambda v: jnp.sin(v) * jnp.cumsum(v), np.zeros(4), (), DetectionBudget()
        )
    encode(pattern, colouring)


def detect(kind: str, f: Callable, x: Any, contexts: tuple) -> Any:
    """asdex's detection with contexts as (undifferentiated) arguments: the pattern then
    holds for every value of them, as a prep (made per shapes, not values) needs."""
    ax = asdex()
    find = ax.hessian_sparsity if kind == "hessian" else ax.jacobian_sparsity
    try:
        return find(f, x, *contexts, argnums=0)
    except NotImplementedError as exc:  # a primitive asdex has no rule for
        raise SparsityDetectionError(
            f"asdex cannot detect this pattern ({str(exc).splitlines()[0][:200]}); "
            "pass it as Sparse(dense, sparsity=...)",
            field="backend",
        ) from exc


def colouring_steps(
    rows: np.ndarray, cols: np.ndarray, shape: tuple[int, int], job: PatternJob
) -> int:
    """Steps greedy colouring takes on this pattern (``job.coloring`` of a ``job.kind``):
    twice (ordering, then colouring) the pairs of entries sharing a row for columns, a
    column for rows, a vertex for star colourings. Linear in nnz."""
    m, n = shape

    def pairs(index: np.ndarray, size: int) -> int:
        counts = np.bincount(index, minlength=size).astype(np.float64)
        return int(2 * float(counts @ counts))

    if job.symmetric:
        off = rows != cols
        return pairs(np.concatenate([rows[off], cols[off]]), n)
    if job.coloring == "column" or job.kind == "hessian":
        return pairs(rows, m)
    if job.coloring == "row":
        return pairs(cols, n)
    return pairs(rows, m) + pairs(cols, n)  # both, the fewer colours kept


def fewest_colours(rows: np.ndarray, cols: np.ndarray, job: PatternJob) -> tuple[int, int]:
    """``(colours, dim)``: a lower bound on the colours of ``job``'s colouring (the entries
    of one row need distinct column colours, of one column distinct row colours) and
    the length of the seeds; star colourings are bounded only by 2 here."""
    m, n = job.shape
    if rows.size == 0:
        return 0, n
    if job.symmetric:
        return (2 if (rows != cols).any() else 1), n
    by_cols = int(np.bincount(rows, minlength=m).max())
    if job.coloring == "column" or job.kind == "hessian":
        return by_cols, n
    by_rows = int(np.bincount(cols, minlength=n).max())
    if job.coloring == "row":
        return by_rows, m
    return (by_cols, n) if by_cols * n <= by_rows * m else (by_rows, m)


@dataclass(frozen=True)
class Colouring:
    """A colouring as arrays: ``colors`` ((m,) for "rev", else (n,); -1: unseeded),
    ``count`` colours, asdex's ``mode``, ``symmetric`` (star) and its ``StarSet``."""

    colors: np.ndarray
    count: int
    mode: str
    symmetric: bool = False
    star: Any = None


def colour_arrays(pattern: Any, job: PatternJob) -> Colouring:
    """asdex's greedy colouring (the choice its ``*_coloring_from_sparsity`` make)
    without building the ``ColoredPattern``."""
    ax = asdex()
    m, n = job.shape
    mode = "fwd_over_rev" if job.kind == "hessian" else "fwd"
    if job.symmetric:
        if pattern.nnz == 0:
            return Colouring(np.full(n, -1, np.int32), 0, mode, True)
        colors, count, star = ax.color_symmetric(pattern)
        return Colouring(colors, count, mode, True, star)
    rows_only = job.kind == "jacobian" and job.coloring == "row"
    if pattern.nnz == 0:
        return Colouring(np.full(m if rows_only else n, -1, np.int32), 0,
                         "rev" if rows_only else mode)
    if rows_only:
        return Colouring(*ax.color_rows(pattern), "rev")
    by_cols = Colouring(*ax.color_cols(pattern), mode)
    if job.kind == "hessian" or job.coloring == "column":
        return by_cols
    by_rows = Colouring(*ax.color_rows(pattern), "rev")  # auto: the fewer colours
    return by_cols if by_cols.count <= by_rows.count else by_rows  # (ties: JVPs)


def colored_pattern(pattern: Any, c: Colouring, budget: DetectionBudget) -> Any:
    """asdex's ``ColoredPattern`` of these arrays, once its seed matrix fits ``budget``."""
    budget.check_seeds(int(c.count), int(c.colors.size))
    ax = asdex()
    with warnings.catch_warnings():  # asdex warns when colours == columns: reported
        warnings.simplefilter("ignore", ax.DenseColoringWarning)
        return ax.ColoredPattern(
            pattern, colors=np.asarray(c.colors, np.int32), num_colors=int(c.count),
            symmetric=c.symmetric, mode=c.mode, star_set=c.star,
        )


# --- an analysis as plain arrays (between the child and the server) ---------------------
_STAR = ("star", "hub", "edge_lo", "edge_hi", "edge_pos")
_MODES = ("fwd", "rev", "fwd_over_rev", "rev_over_fwd", "rev_over_rev")


def encode(pattern: Any, colouring: Colouring | None) -> tuple[dict[str, Any], bytes]:
    """``(header, payload)``: the pattern's rows and cols and the colouring's arrays as
    raw int32, described by a JSON-able header. Nothing is pickled."""
    arrays: dict[str, np.ndarray] = {"rows": pattern.rows, "cols": pattern.cols}
    header: dict[str, Any] = {"nnz": int(pattern.nnz)}
    if colouring is not None:
        arrays["colors"] = colouring.colors
        header.update(num_colors=int(colouring.count), mode=colouring.mode,
                      symmetric=bool(colouring.symmetric), star=colouring.star is not None)
        if colouring.star is not None:
            arrays.update({name: getattr(colouring.star, name) for name in _STAR})
    header["arrays"] = [[name, int(np.size(a))] for name, a in arrays.items()]
    payload = b"".join(np.ascontiguousarray(a, dtype="<i4").tobytes() for a in arrays.values())
    return header, payload


def decode(
    header: dict[str, Any], payload: bytes | memoryview, job: PatternJob, budget: DetectionBudget
) -> tuple[Any, Any]:
    """``(SparsityPattern, ColoredPattern or None)`` from ``encode``'s output, every array
    checked to lie inside the shape first (it came from another process).

    Raises ``SparsityDetectionError`` for an inconsistent answer, ``BudgetExceededError``
    for one over ``budget``."""
    m, n = job.shape
    arrays = _split(header, payload)
    rows, cols = arrays.get("rows"), arrays.get("cols")
    if rows is None or cols is None or rows.size != cols.size:
        raise _inconsistent("no pattern")
    budget.check_nnz(int(rows.size), "detected")
    _inside(rows, 0, m, "rows")
    _inside(cols, 0, n, "cols")
    keys = rows.astype(np.int64) * max(n, 1) + cols
    if keys.size > 1 and not (np.diff(keys) > 0).all():
        raise _inconsistent("entries not sorted row-major")
    ax = asdex()
    pattern = ax.SparsityPattern.from_coo(rows, cols, job.shape)
    if not job.colour:
        return pattern, None
    colors = arrays.get("colors")
    count, mode = header.get("num_colors"), header.get("mode")
    if colors is None or mode not in _MODES or not isinstance(count, int):
        raise _inconsistent("no colouring")
    if colors.size != (m if mode == "rev" else n) or not 0 <= count <= max(colors.size, 0):
        raise _inconsistent("colours of the wrong size")
    _inside(colors, -1, count, "colors")
    star = None
    if header.get("star"):
        parts = {name: arrays.get(name) for name in _STAR}
        if any(a is None for a in parts.values()):
            raise _inconsistent("a star colouring without its star set")
        edges = parts["edge_lo"].size
        if parts["edge_hi"].size != edges or parts["edge_pos"].size != edges:
            raise _inconsistent("edge arrays of different lengths")
        _inside(parts["edge_lo"], 0, n, "edge_lo")
        _inside(parts["edge_hi"], 0, n, "edge_hi")
        _inside(parts["edge_pos"], 0, parts["star"].size, "edge_pos")
        _inside(parts["star"], 0, parts["hub"].size, "star")
        _inside(parts["hub"], -n, n, "hub")
        star = ax.StarSet(**parts)
    symmetric = bool(header.get("symmetric"))
    if symmetric and star is None and count:
        raise _inconsistent("a star colouring without its star set")
    try:
        return pattern, colored_pattern(
            pattern, Colouring(colors, count, mode, symmetric, star), budget
        )
    except (AssertionError, ValueError, IndexError) as exc:  # asdex's own consistency checks
        raise _inconsistent(str(exc)[:200]) from None


def _split(header: dict[str, Any], payload: bytes | memoryview) -> dict[str, np.ndarray]:
    listed = header.get("arrays")
    if not isinstance(listed, list):
        raise _inconsistent("no arrays")
    out: dict[str, np.ndarray] = {}
    offset = 0
    for item in listed:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], int) and item[1] >= 0):
            raise _inconsistent("a malformed array entry")
        name, size = item
        end = offset + 4 * size
        if end > len(payload):
            raise _inconsistent("arrays longer than the answer")
        out[name] = np.frombuffer(payload, dtype="<i4", count=size, offset=offset).astype(np.int32)
        offset = end
    if offset != len(payload):
        raise _inconsistent("bytes left over")
    return out


def _inside(a: np.ndarray, low: int, high: int, name: str) -> None:
    if a.size and (int(a.min()) < low or int(a.max()) >= max(high, low)):
        raise _inconsistent(f"{name} outside [{low}, {high})")


def _inconsistent(what: str) -> SparsityDetectionError:
    return SparsityDetectionError(
        f"the detection process answered an inconsistent pattern ({what}); pass the "
        "pattern as Sparse(dense, sparsity=...)",
        field="backend",
    )
