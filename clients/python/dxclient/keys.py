"""Typed PRNG keys: JAX's keys to the wire and back, JAX imported only when met.

Importing dxclient registers ``read_jax_key`` with the contract, so a JAX key
(``jax.random.key(0)``, ``jax.random.split(key, 3)``; impls threefry2x32, rbg and
unsafe_rbg) given as a context is sent as its impl and uint32 words
(``dxcontract.keys``). Keys in an answer come back as JAX keys when JAX is importable;
without JAX they stay ``dxcontract.keys.KeyArray``s (impl, uint32 ``data``, ``shape``),
which keep what a key needs to be sent back unchanged: raw uint32 words alone would
lose the impl, and would go back as an array rather than a key.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from dxcontract.keys import IMPLS, PREFIX, TAGS, KeyArray, register_key_reader

__all__ = ["KeyArray", "from_wire", "read_jax_key"]


def read_jax_key(value: Any) -> KeyArray | None:
    """A JAX typed key array as a ``KeyArray`` (None for any other value). JAX is
    imported here only: a value whose dtype is a key's comes from JAX already."""
    module = type(value).__module__ or ""
    if not module.startswith(("jax", "jaxlib")):
        return None
    import jax

    if not jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        return None
    tag = str(value.dtype)[len(PREFIX) : -1]  # JAX's dtype: key<fry>
    impl = TAGS.get(tag) or str(jax.random.key_impl(value))
    if impl not in IMPLS:
        return KeyArray(impl, np.zeros(0, np.uint32))  # raises, naming the known impls
    return KeyArray(impl, np.asarray(jax.random.key_data(value)))


register_key_reader(read_jax_key)


@functools.cache
def _jax() -> Any:
    """The ``jax`` module, or None where it is not installed (asked once)."""
    try:
        import jax
    except ImportError:
        return None
    return jax


def from_wire(tree: Any) -> Any:
    """``tree`` (a decoded result) with each ``KeyArray`` as a JAX typed key
    (``jax.random.wrap_key_data``) when JAX is importable; else unchanged."""
    if type(tree) is np.ndarray:  # the common case: no key in it
        return tree
    if type(tree) is KeyArray:
        jax = _jax()
        return tree if jax is None else jax.random.wrap_key_data(tree.data, impl=tree.impl)
    if isinstance(tree, dict):
        return {k: from_wire(v) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a NamedTuple: its own type
        return type(tree)(*(from_wire(v) for v in tree))
    if isinstance(tree, tuple | list):
        return type(tree)(from_wire(v) for v in tree)
    return tree
