"""Typed PRNG keys between the wire and JAX: ``KeyArray`` in, JAX keys out, and back.

A request's keys decode to ``dxcontract.keys.KeyArray``s (an impl name and uint32
words); ``inputs_to_jax`` makes them JAX typed keys with the public
``jax.random.wrap_key_data(data, impl=...)`` before the library sees them, and
``to_wire`` turns the JAX keys of a result back into ``KeyArray``s for the encoder.
Keys are contexts: the library refuses them as x or tangents (``signature``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from dxcontract.keys import IMPLS, PREFIX, TAGS, KeyArray

Tree = Any


def is_jax_key(value: Any) -> bool:
    """Is ``value`` a JAX typed key array (or its abstract spec)?"""
    dtype = getattr(value, "dtype", None)
    if dtype is None or isinstance(dtype, np.dtype | str):
        return False
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:  # another framework's dtype (torch's): not JAX's, so not a key
        return False


def to_jax(tree: Tree) -> Tree:
    """``tree`` with each ``KeyArray`` as a JAX typed key (``tree`` itself when it holds
    none)."""
    kind = type(tree)
    if kind is np.ndarray:  # the common case
        return tree
    if kind is KeyArray:
        return jax.random.wrap_key_data(np.asarray(tree.data), impl=tree.impl)
    if kind is dict:
        out = {k: to_jax(v) for k, v in tree.items()}
        return out if any(out[k] is not v for k, v in tree.items()) else tree
    if kind is tuple or kind is list:
        items = [to_jax(v) for v in tree]
        return tree if all(a is b for a, b in zip(items, tree, strict=True)) else kind(items)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a NamedTuple keeps its type
        items = [to_jax(v) for v in tree]
        return tree if all(a is b for a, b in zip(items, tree, strict=True)) else kind(*items)
    return tree


def inputs_to_jax(x: Tree, tangents: Any, contexts: Any) -> tuple[Tree, Any, Any]:
    """A request's inputs with their ``KeyArray``s as JAX keys (keys in x or a tangent
    are then refused by the library, naming the field)."""
    if not contexts and tangents is None and type(x) is np.ndarray:  # most requests
        return x, tangents, contexts
    if tangents is not None and isinstance(tangents, tuple | list):
        tangents = type(tangents)(to_jax(t) for t in tangents)
    if isinstance(contexts, tuple | list):
        contexts = type(contexts)(to_jax(c) for c in contexts)
    return to_jax(x), tangents, contexts


def key_array(value: Any) -> KeyArray:
    """A JAX typed key array (concrete) as the wire's ``KeyArray``."""
    tag = str(value.dtype)[len(PREFIX) : -1]
    impl = TAGS.get(tag) or str(jax.random.key_impl(value))
    return KeyArray(impl if impl in IMPLS else tag, np.asarray(jax.random.key_data(value)))


def to_wire(tree: Tree) -> Tree:
    """``tree`` (arrays, pytrees) with each JAX typed key as a ``KeyArray``."""
    if is_jax_key(tree):
        return key_array(tree)
    if isinstance(tree, dict):
        return {k: to_wire(v) for k, v in tree.items()}
    if isinstance(tree, tuple | list):
        items = [to_wire(v) for v in tree]
        if hasattr(tree, "_fields"):  # a NamedTuple keeps its type (and field names)
            return type(tree)(*items)
        return items if isinstance(tree, list) else tuple(items)
    return tree
