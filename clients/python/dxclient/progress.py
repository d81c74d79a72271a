"""Progress of long operator calls: the server's event stream, read by the client.

``client.hessian(f, backend, x, progress=True)`` sends the request with
``Accept: text/event-stream; arrays=b64`` and reads Server-Sent Events while the
server computes (see the README, "Progress and cancellation"):

* ``progress`` events (``{"done", "total", "unit"}``) update a ``tqdm`` bar
  (the client's ``progress`` extra: ``pip install './clients/python[progress]'`` from a
  clone of dxserve, or ``pip install tqdm``), or call ``progress(done, total)`` when
  ``progress`` is a callable;
* the ``result`` event is decoded exactly as the plain answer would be (typed base64,
  so the same bits);
* an ``error`` event raises the problem's typed ``DxError``.

Leaving early (Ctrl-C, an exception in the callback) closes the stream, and closing the
connection is what cancels the computation on the server.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from dxcontract.errors import DxError

#: What a streamed operator request accepts: events, with arrays as typed base64.
ACCEPT = "text/event-stream; arrays=b64"

Progress = bool | Callable[[int, int], Any] | None


class Reporter:
    """Turns progress events into a tqdm bar or ``callback(done, total)`` calls."""

    def __init__(self, progress: Progress, operator: str) -> None:
        self.callback: Callable[[int, int], Any] | None = None
        self.bar: Any = None
        self.operator = operator
        if callable(progress):
            self.callback = progress
        else:
            self._tqdm = _tqdm()  # fail before sending anything when tqdm is missing

    def update(self, done: int, total: int, unit: str) -> None:
        if self.callback is not None:
            self.callback(done, total)
            return
        if self.bar is None:
            self.bar = self._tqdm(total=total, unit=f" {unit}", desc=self.operator)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _tqdm() -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError as exc:
        from dxcontract.extras import install_hint

        raise ImportError(
            f"progress=True shows a tqdm progress bar: {install_hint('progress')}; "
            "or pass progress=callable, called with (done, total)"
        ) from exc
    return tqdm


class EventParser:
    """An incremental Server-Sent Events parser: ``feed(line)`` -> ``(event, data)`` or
    None (comments, such as the server's ``: keep-alive``, are skipped)."""

    def __init__(self) -> None:
        self.event = "message"
        self.data: list[str] = []

    def feed(self, line: str) -> tuple[str, str] | None:
        if not line:  # a blank line ends an event
            if not self.data:
                self.event = "message"
                return None
            out = (self.event, "\n".join(self.data))
            self.event, self.data = "message", []
            return out
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self.event = value
        elif name == "data":
            self.data.append(value)
        return None


def read_events(
    lines: Iterable[str], reporter: Reporter, decode: Callable[[bytes], Any]
) -> Any:
    """Consume a stream's lines: report progress, return ``decode(result data)``."""
    parser = EventParser()
    for line in lines:
        found = parser.feed(line)
        if found is not None:
            outcome = handle(found, reporter, decode)
            if outcome is not _MORE:
                return outcome
    raise DxError.from_problem(502, {"detail": "the event stream ended without a result"})


_MORE = object()


def handle(found: tuple[str, str], reporter: Reporter, decode: Callable[[bytes], Any]) -> Any:
    """One event: progress reported (``_MORE``), the result decoded, an error raised."""
    name, data = found
    if name == "progress":
        state = json.loads(data)
        reporter.update(int(state["done"]), int(state["total"]), str(state.get("unit", "")))
        return _MORE
    if name == "result":
        return decode(data.encode())
    if name == "error":
        problem = json.loads(data)
        raise DxError.from_problem(int(problem.get("status", 500)), problem)
    return _MORE


async def aread_events(lines: Any, reporter: Reporter, decode: Callable[[bytes], Any]) -> Any:
    """``read_events`` over an async iterator of lines."""
    parser = EventParser()
    async for line in lines:
        found = parser.feed(line)
        if found is not None:
            outcome = handle(found, reporter, decode)
            if outcome is not _MORE:
                return outcome
    raise DxError.from_problem(502, {"detail": "the event stream ended without a result"})
