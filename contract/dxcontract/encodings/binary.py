"""The "binary" encoding: a JSON header, then the arrays' raw bytes.

Body = JSON header (space-padded to a multiple of 64 bytes) + raw buffers, each padded
to a multiple of 64 bytes, media type ``application/vnd.dxserve.binary``. The HTTP header
``Dxserve-Header-Length`` is the padded header length; arrays in the header are
``{"__ndarray__": {"offset": o, "nbytes": k}, "dtype", "shape"}`` with ``o`` relative to
the end of the header, little-endian C-order bytes. Decoding returns read-only numpy
views into the body (no copy); it accepts any offsets (unaligned ones give arrays with
``flags.aligned`` False). A typed PRNG key has dtype ``"key<IMPL>"``, shape the key
array's, and a buffer of its uint32 words (``nbytes = prod(shape + words) * 4``); it
decodes to a ``dxcontract.keys.KeyArray`` over a view of the body.

A repeated call sends the same header (same function, backend, shapes, dtypes), so both
directions remember it: encoding keeps the header bytes of a tree shape (``_HEADERS``),
decoding the checked ``BinaryLayout`` of a header (``_LAYOUTS``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import MalformedRequestError
from ..keys import IMPLS, PREFIX, U32, KeyArray
from ..lru import LRU
from .common import (
    LE,
    MARKER,
    MAX_DEPTH,
    SeqNode,
    check_dtype,
    dumps,
    encode_tree,
    join,
    key_data_error,
    le_contig,
    loads,
    prod,
    typed_header,
    typed_value,
    wire_ready,
)
from .nodes import NamedNode

BINARY_TYPE = "application/vnd.dxserve.binary"
HEADER_LENGTH = "Dxserve-Header-Length"
ALIGN = 64
MAX_HEADER_BYTES = 16 * 1024 * 1024
_REF_KEYS = frozenset(("offset", "nbytes"))


class Binary:
    """A JSON header with buffer references, then the arrays' bytes, 64-byte aligned."""

    name = "binary"
    media_type = BINARY_TYPE
    decode_factor = 1.0  # arrays are views of the body
    encode_factor = 0.0  # the arrays' own memory is sent
    body_limit = "max_body_bytes"
    views = True

    def encode_array(self, a: np.ndarray, buffers: Any, field: str) -> Any:
        """An array -> ``{"__ndarray__": {"offset", "nbytes"}, "dtype", "shape"}``, its
        little-endian C-order data added to ``buffers`` (the body's ``_Buffers``)."""
        name = check_dtype(a, field)
        shape = list(a.shape)
        le = le_contig(a)
        if buffers is None:
            raise ValueError("binary encoding needs a buffers collector")
        offset = buffers.add(le)
        return {MARKER: {"offset": offset, "nbytes": le.nbytes}, "dtype": name, "shape": shape}

    def encode_body(self, payload: dict) -> tuple[bytes, str, dict[str, str]]:
        """``payload`` -> ``(body, media type, {Dxserve-Header-Length: n})``; the body is
        one ``b"".join`` over the header and the arrays, so each array is copied once."""
        parts, content_type, headers = self.encode_body_parts(payload)
        return b"".join(parts), content_type, headers

    def encode_body_parts(self, payload: dict) -> tuple[list[Any], str, dict[str, str]]:
        """``encode_body`` without the final join.

        The arrays' parts are byte memoryviews of the arrays themselves (not copied), so a
        server can write them to the socket one after another. (Joining them copies with
        the GIL held -- CPython's ``bytes.join`` lets go of it only when every part is
        ``bytes`` -- which stalls every other thread: ~20 ms for an 18 MB Jacobian.)
        """
        arrays: list[np.ndarray] = []
        key = _header_key(payload, arrays)
        header = _HEADERS.get(key) if key is not None else None
        if header is None:
            buffers = _Buffers()
            header = dumps(encode_tree(payload, self, buffers, ""))
            header += b" " * (-len(header) % ALIGN)
            arrays = buffers.items
            if key is not None and len(header) <= BinaryLayout.MAX_HEADER:
                _HEADERS.put(key, header)
        else:
            arrays = [le_contig(a) for a in arrays]
        parts: list[Any] = [header]
        for a in arrays:
            if a.nbytes:
                parts.append(memoryview(array_bytes(a)))
                if a.nbytes % ALIGN:
                    parts.append(padding(a.nbytes))
        return parts, BINARY_TYPE, {HEADER_LENGTH: str(len(header))}

    def decode_body(
        self, body: bytes | bytearray | memoryview, header_length: str | None,
        max_header_bytes: int = MAX_HEADER_BYTES,
    ) -> tuple[dict, BinaryLayout | None]:
        """A binary body -> ``(its header object with every buffer reference replaced by
        a read-only view into body, the header's BinaryLayout)``; the layout is None for
        headers over ``BinaryLayout.MAX_HEADER`` bytes.

        The same header comes back again and again (same function, backend, shapes and
        dtypes), so its layout is remembered: a repeated header is not parsed again (the
        same layout object comes back, so a caller may key what it derives on it).
        """
        field = HEADER_LENGTH
        if header_length is None:
            raise MalformedRequestError(
                f"binary body needs the {HEADER_LENGTH} header", field=field
            )
        text = header_length.strip()
        if not text.isascii() or not text.isdigit() or len(text) > 18:
            raise MalformedRequestError(
                f"must be a decimal integer, got {header_length!r}", field=field
            )
        n = int(text)
        if n == 0:
            raise MalformedRequestError("header length must be positive", field=field)
        if n > max_header_bytes:
            raise MalformedRequestError(
                f"header length {n} exceeds {max_header_bytes}", field=field
            )
        if n > len(body):
            raise MalformedRequestError(
                f"header length {n} exceeds the body length {len(body)}", field=field
            )
        # views into a writable body (a bytearray received in place) stay read-only, as
        # views of bytes are: decoded arrays never write into what was received
        buf = body if isinstance(body, bytes) else memoryview(body).toreadonly()
        head = bytes(buf[:n]) if n <= BinaryLayout.MAX_HEADER else None
        layout = _LAYOUTS.get(head) if head is not None else None
        if layout is not None and len(buf) - n >= layout.end:
            return layout.fill(layout.tree, buf, n), layout
        header = loads(memoryview(body)[:n], field="header")
        if not isinstance(header, dict):
            raise MalformedRequestError("the binary header must be a JSON object", field="header")
        for key in list(header):
            header[key] = _resolve_refs(header[key], key, buf, n, 0)
        if head is not None:  # checked in full just now: the next body like it skips all that
            layout = BinaryLayout(loads(head))
            _LAYOUTS.put(head, layout)
        return header, layout


class _Slot:
    """An array's place in a binary body, from a header already checked once."""

    __slots__ = ("count", "dtype", "end", "impl", "offset", "shape")

    def __init__(self, ref: dict) -> None:
        name = ref["dtype"]
        self.impl = None
        if name.startswith(PREFIX):  # a key array: its words (``typed_header``)
            self.impl = name[len(PREFIX) : -1]
            self.dtype, self.shape = U32, (*ref["shape"], *IMPLS[self.impl].words)
        else:
            self.dtype, self.shape = LE[name], tuple(ref["shape"])
        self.count, self.offset = prod(self.shape), ref[MARKER]["offset"]
        self.end = self.offset + ref[MARKER]["nbytes"]


class BinaryLayout:
    """A checked binary header: its JSON with every buffer reference turned into a slot.

    Decoding a body with a known layout is a copy of the small JSON tree plus one
    ``np.frombuffer`` view per array. Built only from a header ``decode_body`` has just
    checked in full, so a layout is valid for every body at least ``end`` bytes past it.
    """

    MAX_HEADER = 2048  # bytes; longer headers are parsed every time

    def __init__(self, header: dict) -> None:
        self.end = 0
        self.tree = self._slots(header)

    def _slots(self, value: Any) -> Any:
        if isinstance(value, dict):
            if MARKER in value and isinstance(value[MARKER], dict):
                slot = _Slot(value)
                self.end = max(self.end, slot.end)
                return slot
            return {k: self._slots(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._slots(v) for v in value]
        return value

    def fill(self, value: Any, body: Any, start: int) -> Any:
        """A fresh copy of ``value`` with read-only views into ``body`` for its slots."""
        kind = type(value)
        if kind is _Slot:
            a = np.frombuffer(body, value.dtype, value.count, start + value.offset)
            a = a.reshape(value.shape)
            return a if value.impl is None else KeyArray.trusted(value.impl, a)
        if kind is dict:
            return {k: self.fill(v, body, start) for k, v in value.items()}
        if kind is list:
            return [self.fill(v, body, start) for v in value]
        return value


#: header bytes -> BinaryLayout, for decoding
_LAYOUTS: LRU[Any, Any] = LRU(512)
#: ``_header_key`` -> padded header bytes, for encoding: the same call, the same header
_HEADERS: LRU[Any, Any] = LRU(512)
# Bounded in bytes by their count: only headers of at most ``BinaryLayout.MAX_HEADER``
# bytes are kept, and no array (measured: 512 of each for 1.2 kB headers, ~5 MB).


def _resolve_refs(value: Any, field: str, body: Any, start: int, depth: int) -> Any:
    """Replace binary buffer references inside ``value`` by views into ``body``."""
    if depth > 2 * MAX_DEPTH:
        raise MalformedRequestError("binary header nested too deeply", field=field)
    if isinstance(value, dict):
        if MARKER in value and isinstance(value[MARKER], dict):
            return _buffer_view(value, field, body, start)
        for key in list(value):
            v = value[key]
            if isinstance(v, dict | list):
                value[key] = _resolve_refs(v, join(field, key), body, start, depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if isinstance(v, dict | list):
                value[i] = _resolve_refs(v, f"{field}[{i}]", body, start, depth + 1)
    return value


def _buffer_view(obj: dict, field: str, body: Any, start: int) -> Any:
    dt, shape = typed_header(obj, field, MAX_DEPTH)
    ref = obj[MARKER]
    if ref.keys() != _REF_KEYS:
        raise MalformedRequestError(
            f"buffer reference must have exactly the keys ['nbytes', 'offset'], got {sorted(ref)}",
            field=field,
        )
    offset, nbytes = ref["offset"], ref["nbytes"]
    for name, v in (("offset", offset), ("nbytes", nbytes)):
        if type(v) is not int or v < 0:
            raise MalformedRequestError(
                f"buffer {name} must be a non-negative int, got {v!r}", field=field
            )
    expected = prod(shape) * dt.itemsize
    if nbytes != expected and obj["dtype"].startswith(PREFIX):
        raise key_data_error(obj["dtype"], shape, f"a buffer of {nbytes} bytes", field)
    if nbytes != expected:
        raise MalformedRequestError(
            f"buffer nbytes {nbytes} != prod(shape {list(shape)}) * itemsize {dt.itemsize} "
            f"= {expected}",
            field=field,
        )
    available = len(body) - start
    if offset > available or nbytes > available - offset:
        raise MalformedRequestError(
            f"buffer [offset {offset}, +{nbytes}) runs past the {available} buffer bytes",
            field=field,
        )
    count = prod(shape)
    try:
        a = np.frombuffer(body, dtype=dt, count=count, offset=start + offset)
        return typed_value(obj, a.reshape(shape))
    except ValueError as exc:  # pragma: no cover - guarded above
        raise MalformedRequestError(f"bad buffer: {exc}", field=field) from None


class _Buffers:
    """Collects the raw buffers of a binary body and their 64-aligned offsets."""

    def __init__(self) -> None:
        self.items: list[np.ndarray] = []
        self.size = 0

    def add(self, a: np.ndarray) -> int:
        offset = self.size
        self.items.append(a)
        self.size += -(-a.nbytes // ALIGN) * ALIGN
        return offset


_PADDING = [bytes(k) for k in range(ALIGN)]

#: How far ``encodes_as_views``/``decodes_as_views`` look before calling a body big work.
VIEWS_MAX_LEAVES = 64
VIEWS_MAX_HEADER_BYTES = 64 * 1024


def encodes_as_views(tree: Any) -> bool:
    """Is encoding ``tree`` only a small header plus views of its arrays (a few numpy
    arrays already C-contiguous and little-endian: nothing to copy or byte-swap)?"""
    leaves, stack = VIEWS_MAX_LEAVES, [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
        elif isinstance(node, np.ndarray):
            leaves -= 1
            if leaves < 0 or not wire_ready(node):
                return False
        elif hasattr(node, "__array__"):
            return False  # a device array: its copy to the host is real work
        if len(stack) > 4 * VIEWS_MAX_LEAVES:
            return False
    return True


def decodes_as_views(header_length: str | None) -> bool:
    """Is decoding a binary body with this header length only a small header plus
    views of its buffers?"""
    return (
        header_length is not None and header_length.isdigit()
        and int(header_length) <= VIEWS_MAX_HEADER_BYTES
    )


def array_bytes(a: np.ndarray) -> np.ndarray:
    """``a`` as the binary encoding stores it: little-endian, C order (copied if needed)."""
    return le_contig(a).reshape(-1).view(np.uint8)


def padding(nbytes: int) -> bytes:
    """The zero bytes that follow ``nbytes`` of array data in a binary body."""
    return _PADDING[-nbytes % ALIGN]


def _header_key(tree: Any, arrays: list[np.ndarray]) -> Any:
    """What a binary header depends on: the tree with each array reduced to its dtype
    and shape (the arrays are appended to ``arrays`` in ``encode_tree``'s order), or None
    when the tree holds something else (floats, scalars, JAX arrays): not remembered."""
    kind = type(tree)
    if kind is np.ndarray:
        arrays.append(tree)
        return tree.dtype, tree.shape
    if kind is dict:
        items = []
        for k, v in tree.items():
            sub = _header_key(v, arrays)
            if sub is None:
                return None
            items.append((k, sub))
        return dict, tuple(items)
    if kind is list or kind is tuple:
        subs = tuple(_header_key(v, arrays) for v in tree)
        return None if None in subs else (list, subs)
    if kind is str or kind is int or kind is bool or tree is None:
        return kind, tree
    if kind is SeqNode:  # a pytree's tuple/list node: its marker and its items' keys
        subs = tuple(_header_key(v, arrays) for v in tree.items)
        return None if None in subs else (SeqNode, tree.marker, subs)
    if kind is NamedNode:  # its name, fields and items' keys
        subs = tuple(_header_key(v, arrays) for v in tree.items)
        return None if None in subs else (NamedNode, tree.name, tuple(tree.fields), subs)
    return None
