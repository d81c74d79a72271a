"""A call's inputs as operators take them: normalized pytrees, their signature and size.

``normalize`` turns Python numbers and lists into float64 arrays (numpy and JAX arrays keep
their dtype, torch tensors become numpy arrays), ``probe`` asks the function's framework
whether it traces f and what f returns, and ``tree_size`` counts a pytree's elements.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dxcontract.encodings.common import is_array_list
from dxcontract.errors import DxError, FunctionEvaluationError, ShapeMismatchError
from dxserve.core.arity import check_contexts
from dxserve.core.preparation.failures import _short
from dxserve.frameworks import Framework, framework_of, host_array

if TYPE_CHECKING:
    from dxserve.frameworks.jax.signature import Signature

Tree = Any


def _signature_of(*args: Any) -> Signature:
    """``Signature.of(x, tangents, contexts, batch_axis, has_aux)``, loaded when first used."""
    from dxserve.frameworks.jax.signature import Signature

    return Signature.of(*args)


def as_tree(value: Any) -> Tree:
    """Normalize one input: Python numbers and lists of numbers become float64 arrays.

    numpy and JAX arrays keep their dtype, torch tensors become numpy arrays of theirs;
    dicts, tuples and lists of anything else (arrays, pytrees, None) are pytree nodes.
    """
    if type(value) is np.ndarray:
        return value  # (the fast path; any other array falls through unchanged)
    if type(value) is dict:
        return {k: as_tree(v) for k, v in value.items()}
    if type(value) is tuple:
        return tuple(as_tree(v) for v in value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple keeps its type
        return type(value)(*(as_tree(v) for v in value))
    if isinstance(value, dict):  # an OrderedDict, a defaultdict: JAX's nodes, kept as they are
        return _custom_node(value)
    if isinstance(value, tuple):
        return tuple(as_tree(v) for v in value)
    if isinstance(value, np.generic):
        return np.asarray(value)
    if isinstance(value, bool):
        return np.asarray(value)
    if isinstance(value, list) and not is_array_list(value):  # a list node of a pytree
        return [as_tree(v) for v in value]
    if isinstance(value, (int, float, list)):
        return np.asarray(value, dtype=np.float64)
    host = host_array(value)  # a torch tensor: its data, on the host, of its dtype
    if host is not None:
        return host
    if hasattr(value, "dtype"):  # a JAX (or other) array
        return value
    return _custom_node(value)


def _custom_node(value: Any) -> Tree:
    """A node JAX's ``tree_util`` knows (a registered dataclass: ``flax.struct``, an
    ``equinox.Module``, ...) with its children normalized; its type is kept. Anything
    else (an array, an unknown object) is returned as it is."""
    from dxserve.frameworks.jax.framework import (
        rebuild_node,  # only for objects no framework claims
    )

    return rebuild_node(value, as_tree)


def normalize(x: Any, tangents: Sequence | None, contexts: Sequence) -> tuple:
    """``(x, tangents, contexts)`` as operators take them (see ``as_tree``)."""
    x = as_tree(x)
    if tangents is not None:
        if not isinstance(tangents, (tuple, list)):
            raise ShapeMismatchError(
                "tangents must be a tuple (a batch) of tangents, e.g. (t,)", field="tangents"
            )
        tangents = tuple(as_tree(t) for t in tangents)
    return x, tangents, tuple(as_tree(c) for c in contexts)


def probe(
    f: Callable, x: Tree, contexts: tuple, framework: Framework | None = None
) -> tuple[bool, Tree]:
    """``(traced, output spec)``: can ``f``'s framework trace ``f``, and what does it
    return (``Framework.probe``; errors of ``f`` as ``FunctionEvaluationError``)."""
    framework = framework or framework_of(f)
    check_contexts(f, contexts)  # a missing context is named, not blamed on x
    try:
        return framework.probe(f, x, contexts)
    except DxError:
        raise
    except Exception as exc:
        raise FunctionEvaluationError(_short(exc), field="x") from exc


def tree_size(framework: Framework, tree: Tree) -> int:
    """Elements in ``tree``'s leaves, summed."""
    # Python ints (math.prod), not numpy's int64: a shape's product cannot overflow
    return sum(math.prod(np.shape(v)) for v in framework.leaves(tree))


def _extent(framework: Framework, tree: Tree) -> int:
    """Elements ``tree`` would hold if its zero dimensions were ones: a zero-size array
    with huge other dimensions holds nothing, but XLA still lays out its shape."""
    return sum(math.prod(d or 1 for d in np.shape(v)) for v in framework.leaves(tree))
