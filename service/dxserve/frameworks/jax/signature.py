"""Signatures: what a compiled operator depends on in its inputs.

A pytree's structure and each leaf's shape and dtype, whether x carries a batch
of points (``batch_axis``) and whether the function returns an auxiliary output
(``has_aux``). ``Signature`` (hashable) keys
the in-memory preps and says what differs when a call does not match its prep;
``persistent_spec`` is the same walk as JSON, with what a persisted executable also
depends on (weak types, shardings).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from dxcontract.errors import InvalidArgumentError
from dxcontract.keys import KeyArray, dtype_name

Tree = Any
Spec = tuple[Any, tuple[tuple[tuple[int, ...], str], ...]]  # (treedef, ((shape, dtype), ...))

_LEAF = jax.tree_util.tree_structure(0)


def dtype_key(dtype: Any) -> str:
    """A dtype as signatures spell it: ``dtype.str`` ("<f4"), the name of an
    ``ml_dtypes`` type ("bfloat16"), whose ``str`` is only its size ("<V2"), or a typed
    PRNG key's JAX name ("key<fry>", one per implementation)."""
    if isinstance(dtype, np.dtype):
        dt = dtype
    elif jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return str(dtype)
    else:
        dt = np.dtype(dtype)
    return dt.name if dt.kind == "V" else dt.str


def _dtype_name(key: str) -> str:
    """A ``dtype_key`` as an error message names it ("float32", "key<threefry2x32>")."""
    return dtype_name(key) if key.startswith(_KEY) else np.dtype(key).name


_KEY = "key<"


def spec_of(tree: Tree) -> Spec:
    if type(tree) is np.ndarray:  # the common case, without flattening
        return _LEAF, ((tree.shape, dtype_key(tree.dtype)),)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(np.shape(v)), dtype_key(v.dtype)) for v in leaves)


@dataclass(frozen=True)
class Signature:
    x: Spec
    tangents: tuple[Spec, ...] | None
    contexts: tuple[Spec, ...]
    #: 0 when x (and the tangents) carry a leading axis of independent points, else None
    batch_axis: int | None = None
    #: True when the function returns ``(output, aux)`` and aux is returned too
    has_aux: bool = False

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.x, self.tangents, self.contexts, self.batch_axis, self.has_aux))

    def __hash__(self) -> int:  # every prep-cache lookup hashes one; its fields never change
        return self._hash

    @staticmethod
    def of(
        x: Tree, tangents: tuple | None, contexts: tuple, batch_axis: int | None = None,
        has_aux: bool = False,
    ) -> Signature:
        try:
            return Signature._of(x, tangents, contexts, batch_axis, has_aux)
        except (AttributeError, TypeError):  # a leaf that is no array: say where
            trees = [("x", x), *((f"tangents[{i}]", t) for i, t in enumerate(tangents or ())),
                     *((f"contexts[{i}]", c) for i, c in enumerate(contexts))]
            for field, tree in trees:
                _check_leaves(tree, field)
            raise

    @staticmethod
    def _of(
        x: Tree, tangents: tuple | None, contexts: tuple, batch_axis: int | None,
        has_aux: bool = False,
    ) -> Signature:
        signature = Signature(
            spec_of(x),
            None if tangents is None else tuple(spec_of(t) for t in tangents),
            tuple(spec_of(c) for c in contexts),
            batch_axis,
            has_aux,
        )
        # keys are contexts, never differentiated (a numpy array is never a key)
        if type(x) is not np.ndarray:
            _refuse_keys(signature.x, "x")
        for i, t in enumerate(tangents or ()):
            if type(t) is not np.ndarray:
                _refuse_keys(signature.tangents[i], f"tangents[{i}]")
        return signature

    def difference(self, prepared: Signature) -> tuple[str, str] | None:
        """``(field, what differs)`` against the prepared signature, or None."""
        if self.has_aux != prepared.has_aux:
            return "has_aux", (
                f"has_aux={self.has_aux} given, prepared with has_aux={prepared.has_aux}"
            )
        if self.batch_axis != prepared.batch_axis:  # first: every shape differs then too
            return "batch_axis", (
                f"batch_axis={self.batch_axis} given, prepared with batch_axis={prepared.batch_axis}"
            )
        if self.x != prepared.x:
            return "x", _describe(self.x, prepared.x)
        if (self.tangents is None) != (prepared.tangents is None) or (
            self.tangents is not None and len(self.tangents) != len(prepared.tangents)
        ):
            got = 0 if self.tangents is None else len(self.tangents)
            want = 0 if prepared.tangents is None else len(prepared.tangents)
            return "tangents", f"{got} tangents given, prepared for {want}"
        for i, (a, b) in enumerate(zip(self.tangents or (), prepared.tangents or (), strict=True)):
            if a != b:
                return f"tangents[{i}]", _describe(a, b)
        if len(self.contexts) != len(prepared.contexts):
            return "contexts", (
                f"{len(self.contexts)} contexts given, prepared for {len(prepared.contexts)}"
            )
        for i, (a, b) in enumerate(zip(self.contexts, prepared.contexts, strict=True)):
            if a != b:
                return f"contexts[{i}]", _describe(a, b)
        return None


def _refuse_keys(spec: Spec, field: str) -> None:
    """``InvalidArgumentError`` (422) for a typed PRNG key among ``spec``'s leaves (x or
    a tangent): keys are not differentiated, they are contexts."""
    for _, dtype in spec[1]:
        if dtype.startswith(_KEY):
            raise InvalidArgumentError(
                f"{field} holds a typed PRNG key ({_dtype_name(dtype)}): keys cannot be differentiated. "
                "Pass the key as a context, after x: op(f, backend, x, key) in process, "
                '"contexts": [key] over HTTP; x is the array that is differentiated',
                field=field,
            )


def _check_leaves(tree: Tree, field: str) -> None:
    """``InvalidArgumentError`` (422) naming the first leaf of ``tree`` that is no array:
    an object of a node type JAX does not know is a leaf to it."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        where = field + "".join(
            f".{k.key}" if isinstance(k, jax.tree_util.DictKey)
            else f"[{k.idx}]" if isinstance(k, jax.tree_util.SequenceKey) else str(k)
            for k in path
        )
        if type(leaf) is KeyArray:  # the wire's key: the server turns it into JAX's
            raise InvalidArgumentError(
                f"KeyArray at {where} is a key as the wire carries it; in process pass "
                "JAX's key: jax.random.wrap_key_data(k.data, impl=k.impl)",
                field=where,
            )
        if not (hasattr(leaf, "dtype") and hasattr(leaf, "shape")):
            raise InvalidArgumentError(
                f"{type(leaf).__name__} at {where} is not an array; pytrees are arrays in "
                "dicts, lists and tuples (None allowed)",
                field=where,
            )


def _describe(got: Spec, want: Spec) -> str:
    if got[0] != want[0]:
        return f"structure {got[0]} differs from prepared {want[0]}"
    for (gs, gd), (ws, wd) in zip(got[1], want[1], strict=True):
        if gs != ws:
            return f"shape {gs} differs from prepared {ws}"
        if gd != wd:
            return f"dtype {_dtype_name(gd)} differs from prepared {_dtype_name(wd)}"
    return "signature differs from prepared"


def persistent_spec(tree: Tree) -> list:
    """``spec_of`` as JSON: ``[treedef, [shape, dtype, weak_type(, sharding)], ...]``."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out: list = [str(treedef)]
    for leaf in leaves:
        item = [list(np.shape(leaf)), dtype_key(leaf.dtype), bool(getattr(leaf, "weak_type", False))]
        if isinstance(leaf, jax.Array):
            item.append(repr(leaf.sharding))
        out.append(item)
    return out
