"""Preparation: pay tracing and compilation once per call signature.

``prepare(operator, f, backend, x, tangents, contexts)`` probes the function,
resolves the backend, validates the inputs, builds the operator's pure JAX
function and compiles it. The returned ``Prep`` holds the executable; calls with
a matching signature run it directly, calls with another signature raise
``PreparationMismatchError``. Without an explicit prep, ``call`` keeps compiled
preps in an LRU keyed by (function, operator, backend, signature), bounded by count
and by the bytes the preps keep alive (``Prep.nbytes``).

One module per concern, their public names re-exported here:

* ``failures``: out of memory (a 503) and the short form of any other failure;
* ``inputs``: the inputs normalized, their signature and size, and f probed;
* ``prep``: the ``Prep`` type and the registry of operator families;
* ``batches``: batches of points (``batch_axis=0``), auxiliary outputs (``has_aux``)
  and the HVP of ``<cotangent, f>``;
* ``explain``: which backend ``Auto`` picks and why, and why a mode does not trace;
* ``pipeline``: ``prepare`` itself;
* ``cache``: the implicit cache (``PrepCache``, ``CACHE``);
* ``calls``: ``lookup`` and ``call``, and ``Ready``, a prepared call made straight.

Everything framework-specific (probing, compiling, vmapping, devices, precision) goes
through the function's ``Framework`` (``frameworks``; JAX unless the function names
another).
"""

from dxserve.core.preparation.batches import (
    batch_points,
    check_batch_axis,
    function_name,
    over_points,
    primary,
    refuse_aux,
    split_aux,
    with_aux,
    with_cotangent,
)
from dxserve.core.preparation.cache import CACHE, PrepCache, made_for
from dxserve.core.preparation.calls import NOT_READY, Lookup, Ready, call, lookup
from dxserve.core.preparation.explain import resolve, trace_error
from dxserve.core.preparation.failures import out_of_memory
from dxserve.core.preparation.inputs import Tree, as_tree, normalize, probe, tree_size
from dxserve.core.preparation.pipeline import MAX_RESULT_ELEMENTS, prepare
from dxserve.core.preparation.prep import (
    BATCH_RESULTS,
    FAMILIES,
    PREP_BYTES,
    Builder,
    Family,
    Inputs,
    Prep,
    packing,
    register_family,
)

__all__ = [
    "BATCH_RESULTS",
    "CACHE",
    "FAMILIES",
    "MAX_RESULT_ELEMENTS",
    "NOT_READY",
    "PREP_BYTES",
    "Builder",
    "Family",
    "Inputs",
    "Lookup",
    "Prep",
    "PrepCache",
    "Ready",
    "Tree",
    "as_tree",
    "batch_points",
    "call",
    "check_batch_axis",
    "function_name",
    "lookup",
    "made_for",
    "normalize",
    "out_of_memory",
    "over_points",
    "packing",
    "prepare",
    "primary",
    "probe",
    "refuse_aux",
    "register_family",
    "resolve",
    "split_aux",
    "trace_error",
    "tree_size",
    "with_aux",
    "with_cotangent",
]
