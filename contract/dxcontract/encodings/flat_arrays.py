"""Long lists of numbers (or of rows of numbers) in a JSON body, parsed straight into
float64 arrays.

A JSON gradient of 10^6 float64 values is a 20 MB list. orjson makes a Python float of
each number (~50 ms here), and ``to_tree`` then checks their types and copies them into
an array (~20 ms). simdjson parses the same list into a buffer of doubles in ~19 ms.

``lift(data, keys)`` finds the value of each named key (``"x"`` of a request, the
results of an answer) that is a list of numbers, or a list of equally long lists of
numbers (a Jacobian, a batch of points), parses it with simdjson, and replaces its text
with a placeholder string; the rest of the body (names, backend, small fields) is left
for the usual parser. ``restore`` puts the arrays back where the placeholders landed.
Whatever doesn't fit exactly, the caller parses the whole body as before, so the result
is always the one the usual parser and ``to_tree`` give (typed arrays, PRNG keys among
them, are objects, never lifted):

* only a key's value that simdjson reads as an array of numbers, and no more than the
  list up to its first ``]`` (a list of rows: its first ``]`` then ``]``); a deeper
  list, a string or a ``true`` inside makes that span invalid or not all numbers, and
  rows of different lengths are no matrix: it stays text;
* a key the pattern finds inside a string, or nested below the top level, leaves its
  placeholder where ``restore`` does not look, and the body is parsed whole;
* the placeholders are strings holding U+0001, which a sender can only write as the
  escape ``\\u0001``: a body with that escape anywhere is not lifted;
* JSON numbers become the nearest float64 either way (integers too; one past 64 bits
  is an error to simdjson, and is then left to the usual parser).

What a sender writes can't make this slow: keys are looked for near the body's start
only (``PROBE_BYTES``), each byte is parsed at most once (the search goes on after the
span it just looked at), and a key found more than ``MAX_TRIES`` times leaves the body
to the usual parser.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

import numpy as np

try:
    import simdjson
except ImportError:  # pragma: no cover - exercised only without pysimdjson
    simdjson = None

#: lists shorter than this many characters are parsed with the rest of the body
MIN_CHARS = 4096
#: a body in which a key turns up more often than this is parsed whole
MAX_TRIES = 16
#: how far from the body's start (or the last lifted list) a key is looked for
PROBE_BYTES = 8 * 1024
#: lists of more lists than this are parsed with the rest of the body (each row is
#: looked at once in Python)
MAX_ROWS = 4096
_ROWS = re.compile(rb"\[[ \t\n\r]*\[")
_END_OF_ROWS = re.compile(rb"\][ \t\n\r]*\]")
_MARK = "\x01"
_ESCAPED_MARK = b"\\u0001"


@lru_cache(maxsize=64)
def _key_then_list(key: str) -> re.Pattern[bytes]:
    """``"key"``, then JSON whitespace, a colon and whitespace, then ``[``."""
    quoted = re.escape(('"' + key + '"').encode())
    return re.compile(quoted + rb"[ \t\n\r]*:[ \t\n\r]*\[")


def lift(
    data: bytes | bytearray, keys: tuple[str, ...]
) -> tuple[bytes, list[tuple[str, np.ndarray]]] | None:
    """``(data with each lifted list replaced by a placeholder, [(key, float64 array)]
    in placeholder order)``, or None when there is nothing to lift.

    A key is looked for within ``PROBE_BYTES`` of the body's start or of the end of a
    list lifted already (a request's name and backend come before x; a second result
    after the first): a body is never searched end to end for one, which would cost a
    large base64 body more than its decoding."""
    if simdjson is None or not keys:
        return None
    spans: list[tuple[int, int, str, np.ndarray]] = []
    todo, windows = list(keys), [0]
    while windows and todo:
        window = windows.pop()
        for key in list(todo):
            found = _find_list(data, key, window, window + PROBE_BYTES)
            if found is _TOO_MANY:
                return None
            if found is not None:
                start, end, floats = found
                spans.append((start, end, key, floats))
                todo.remove(key)
                windows.append(end)
    if not spans:
        return None
    # placeholders hold U+0001: a body whose sender wrote one can't be lifted (looking
    # for a backslash first: one byte is found ~40x quicker than six)
    if data.find(b"\\") >= 0 and data.find(_ESCAPED_MARK) >= 0:
        return None
    spans.sort(key=lambda span: span[0])
    view = memoryview(data)
    parts: list[Any] = []
    done = 0
    for index, (start, end, _, _) in enumerate(spans):
        parts += (view[done:start], b'"\\u0001%d"' % index)
        done = end
    parts.append(view[done:])
    return b"".join(parts), [(key, floats) for _, _, key, floats in spans]


_TOO_MANY = object()


def _find_list(data: bytes | bytearray, key: str, lo: int, hi: int) -> Any:
    """``(start, end, float64 array)`` of the first long list of numbers after ``"key":``
    that opens in ``data[lo:hi]``; None if there is none; ``_TOO_MANY`` if the key turns
    up more than ``MAX_TRIES`` times there."""
    pattern, needle = _key_then_list(key), ('"' + key + '"').encode()
    at = data.find(needle, lo, hi)
    for _ in range(MAX_TRIES):
        if at < 0:
            return None
        after = at + 1
        match = pattern.match(data, at)
        if match is not None:
            start = match.end() - 1
            rows = _ROWS.match(data, start)
            if rows is None:  # a list of numbers ends at the first "]"
                end = data.find(b"]", start) + 1
            else:  # a list of lists of numbers at the first "]" then "]"
                closed = _END_OF_ROWS.search(data, start)
                end = closed.end() if closed is not None else 0
            if end == 0:  # no list closes after this one: none can be lifted
                return None
            if end - start >= MIN_CHARS:
                if rows is None:
                    floats = _floats(memoryview(data)[start:end])
                else:
                    floats = _matrix(data, start, end)
                if floats is not None:
                    return start, end, floats
            # whatever opens inside this span closes where it does: each byte is
            # parsed at most once, however many keys a sender writes into it
            after = end
        at = data.find(needle, after, hi)
    return _TOO_MANY if at >= 0 else None


def _floats(text: memoryview) -> np.ndarray | None:
    """``text`` (one JSON array) as float64 values, or None unless it is a valid array
    of numbers only."""
    try:
        doc = simdjson.Parser().parse(text)
        if not isinstance(doc, simdjson.Array):
            return None
        return np.frombuffer(doc.as_buffer(of_type="d"), np.float64)
    except (ValueError, TypeError, RuntimeError):  # invalid, not all numbers, too big
        return None


def _matrix(data: bytes | bytearray, start: int, end: int) -> np.ndarray | None:
    """``data[start:end]`` (one JSON list of lists) as a float64 matrix, or None unless
    it is a valid list of at most ``MAX_ROWS`` lists of numbers, all of one length.

    A row holding a list would be flattened by simdjson: it is ruled out by counting,
    since then the text holds more ``[`` than one per row and one around them."""
    rows = data.count(b"[", start, end) - 1
    if not 0 < rows <= MAX_ROWS:
        return None
    try:
        doc = simdjson.Parser().parse(memoryview(data)[start:end])
        if not isinstance(doc, simdjson.Array) or len(doc) != rows:
            return None
        widths = {len(row) if isinstance(row, simdjson.Array) else -1 for row in doc}
        if len(widths) != 1 or -1 in widths:
            return None
        floats = np.frombuffer(doc.as_buffer(of_type="d"), np.float64)
    except (ValueError, TypeError, RuntimeError):  # invalid, not all numbers, too big
        return None
    cols = widths.pop()
    return floats.reshape(rows, cols) if floats.size == rows * cols else None


def restore(obj: Any, lifted: list[tuple[str, np.ndarray]]) -> bool:
    """Put each lifted array back in ``obj`` (the parsed body); False unless every
    placeholder is the top-level value of the key it was lifted from."""
    if type(obj) is not dict:
        return False
    for index, (key, _) in enumerate(lifted):
        if obj.get(key) != f"{_MARK}{index}":
            return False
    for key, floats in lifted:
        obj[key] = floats
    return True
