"""Typed PRNG keys on the wire: an implementation's name and its raw uint32 words.

A JAX key array (``jax.random.key(0)``, dtype ``key<fry>``) is, underneath, a uint32
array with a trailing axis of the implementation's words (``jax.random.key_data``).
Every encoding writes it as a typed array whose ``dtype`` is ``"key<IMPL>"`` (JAX's
implementation name, e.g. ``"key<threefry2x32>"``), whose ``shape`` is the key array's
own shape (``[]`` for one key, ``[3]`` for ``jax.random.split(key, 3)``), and whose data
are the uint32 words, shape ``shape + words`` (``IMPLS``), in that encoding's usual
form (a nested list, base64 or a binary buffer of ``prod(shape + words) * 4`` bytes)::

    {"__ndarray__": [0, 0], "dtype": "key<threefry2x32>", "shape": []}

``KeyArray`` is that value without JAX: decoded bodies hold it where a key was sent,
and it encodes back to the same typed array. The server turns it into a JAX key with
``jax.random.wrap_key_data(data, impl=impl)``; the client gives back JAX keys when JAX
is importable, else these objects. Nothing here imports JAX: a framework's typed keys
are read by the functions given to ``register_key_reader`` (``dxclient`` registers
JAX's, importing JAX only when it is handed a key).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import DtypeMismatchError, InvalidArgumentError, ShapeMismatchError


@dataclass(frozen=True)
class KeyImpl:
    """A PRNG implementation as the wire knows it: ``words`` uint32 per key, and
    ``tag``, the short name JAX writes in its dtype (``key<fry>``)."""

    name: str
    words: tuple[int, ...]
    tag: str


#: The implementations keys may name: JAX's built-in ones.
IMPLS: dict[str, KeyImpl] = {
    impl.name: impl
    for impl in (
        KeyImpl("threefry2x32", (2,), "fry"),
        KeyImpl("rbg", (4,), "rbg"),
        KeyImpl("unsafe_rbg", (4,), "urbg"),
    )
}
#: JAX's dtype tag (``key<fry>``) -> the implementation's name
TAGS = {impl.tag: impl.name for impl in IMPLS.values()}
PREFIX, SUFFIX = "key<", ">"
U32 = np.dtype("<u4")


def key_dtype(impl: str) -> str:
    """The wire dtype of keys of ``impl``: ``"key<threefry2x32>"``."""
    return f"{PREFIX}{impl}{SUFFIX}"


def is_key_dtype(name: Any) -> bool:
    """Does the typed array's ``"dtype"`` name a key dtype (``"key<...>"``, known or not)?"""
    return type(name) is str and name.startswith(PREFIX)


def _known() -> str:
    return ", ".join(
        f"{key_dtype(i.name)} ({'x'.join(map(str, i.words))} uint32 per key)"
        for i in IMPLS.values()
    )


def impl_of(name: str, field: str | None) -> KeyImpl:
    """The implementation a key dtype (``"key<threefry2x32>"``) names; DtypeMismatchError
    (422) naming the known ones for any other."""
    impl = name[len(PREFIX) : -len(SUFFIX)] if name.endswith(SUFFIX) else None
    found = IMPLS.get(impl) if impl is not None else None
    if found is not None:
        return found
    hint = ""
    if impl in TAGS:  # JAX's dtype spells threefry2x32 "fry": say the wire's name
        hint = f" ({name[:40]!r} is JAX's short spelling: write {key_dtype(TAGS[impl])!r})"
    raise DtypeMismatchError(
        f"unknown PRNG key dtype {name[:40]!r}{hint}; keys are typed arrays of dtype "
        f"key<IMPL>: {_known()}, with the uint32 words of jax.random.key_data(key) as data",
        field=field,
    )


class KeyArray:
    """A typed PRNG key array without JAX: ``impl`` (``"threefry2x32"``, ``"rbg"``,
    ``"unsafe_rbg"``) and ``data``, the uint32 words of ``jax.random.key_data``, shape
    ``shape + IMPLS[impl].words``.

    ``shape`` is the key array's (``()`` for one key), ``dtype`` its wire dtype string
    (``"key<threefry2x32>"``); ``jax.random.wrap_key_data(k.data, impl=k.impl)`` makes
    the JAX key. Two are equal when impl, shape and words are. It is what a client
    without JAX gets back where a key was answered, and sends back as that key.
    Raises DtypeMismatchError / ShapeMismatchError (422) for an unknown impl, data that
    are not uint32 integers, or data whose trailing shape is not the impl's.
    """

    __slots__ = ("data", "impl")

    impl: str
    data: np.ndarray

    def __init__(self, impl: str, data: Any, *, field: str | None = None) -> None:
        spec = IMPLS.get(impl) if type(impl) is str else None
        if spec is None:
            impl_of(key_dtype(str(impl)[:40]), field)  # raises, naming the known ones
        a = np.asarray(data)
        if a.dtype.kind not in "iu" or (a.size and (a.min() < 0 or a.max() > 0xFFFFFFFF)):
            raise DtypeMismatchError(
                f"{key_dtype(impl)} data must be uint32 words (integers 0 to 4294967295, "
                f"jax.random.key_data(key)), got {a.dtype.name} values",
                field=field,
            )
        words = spec.words
        if a.shape[a.ndim - len(words) :] != words or a.ndim < len(words):
            raise ShapeMismatchError(
                f"{key_dtype(impl)} data has shape {list(a.shape)}; each key is "
                f"{list(words)} uint32 words, so data of keys of shape S is S + {list(words)}",
                field=field,
            )
        object.__setattr__(self, "impl", impl)
        object.__setattr__(self, "data", a.astype(U32, copy=False))

    @classmethod
    def trusted(cls, impl: str, data: np.ndarray) -> KeyArray:
        """A key array of data already checked (a decoder's uint32 view), not copied."""
        self = cls.__new__(cls)
        object.__setattr__(self, "impl", impl)
        object.__setattr__(self, "data", data)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("KeyArray is immutable")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape[: self.data.ndim - len(IMPLS[self.impl].words)]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> str:
        """The wire dtype, ``"key<IMPL>"`` (a string: numpy has no key dtype)."""
        return key_dtype(self.impl)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KeyArray):
            return NotImplemented
        return (
            self.impl == other.impl
            and np.array_equal(self.data, other.data)
            and (self.data.shape == other.data.shape)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"KeyArray(impl={self.impl!r}, shape={self.shape}, data={self.data.tolist()!r})"


# --------------------------------------------------------------------------- readers

#: functions turning an array framework's typed key array into a ``KeyArray`` (None:
#: not one of theirs), asked in order by ``read_key``
_READERS: list[Callable[[Any], KeyArray | None]] = []


def register_key_reader(reader: Callable[[Any], KeyArray | None]) -> None:
    """Let encoders read a framework's typed keys: ``reader(value)`` is the value's
    ``KeyArray``, or None when it is not a key of that framework. Registered once."""
    if reader not in _READERS:
        _READERS.append(reader)


def looks_like_key(value: Any) -> bool:
    """Is ``value`` an array whose dtype is a typed key's (JAX spells it ``key<fry>``)?
    Cheap: numpy dtypes are never keys."""
    dtype = getattr(value, "dtype", None)
    return dtype is not None and not isinstance(dtype, np.dtype) and str(dtype).startswith(PREFIX)


def read_key(value: Any, field: str | None = None) -> KeyArray | None:
    """``value`` as a ``KeyArray`` when it is a typed key array (a ``KeyArray`` itself,
    or a framework's that a registered reader knows); None for any other value.
    InvalidArgumentError (422) for a typed key no reader knows."""
    if type(value) is KeyArray:
        return value
    if not looks_like_key(value):
        return None
    for reader in _READERS:
        found = reader(value)
        if found is not None:
            return found
    raise InvalidArgumentError(
        f"a typed PRNG key ({value.dtype}) cannot be sent without a reader of its "
        "framework's keys: import dxclient (it reads JAX's), or send "
        "dxcontract.keys.KeyArray(impl, jax.random.key_data(key))",
        field=field or None,
    )


def dtype_name(dtype: Any) -> str:
    """numpy's name of ``dtype``, or a typed key's wire dtype (``"key<threefry2x32>"``
    for JAX's ``key<fry>``). TypeError for anything else numpy cannot read."""
    if isinstance(dtype, np.dtype):
        return dtype.name
    text = str(dtype)
    if text.startswith(PREFIX) and text.endswith(SUFFIX):
        tag = text[len(PREFIX) : -len(SUFFIX)]
        impl = TAGS.get(tag, tag)
        if impl in IMPLS:
            return key_dtype(impl)
    return np.dtype(dtype).name
