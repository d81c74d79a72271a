"""What one request did, for its headers and log line; JSON log lines.

The HTTP layer opens a ``RequestInfo`` per request (``CURRENT``, a context variable,
so the ``Service`` fills it in without any transport in its signatures): the function
and operator, and when the service call began and ended and how long its computation
took. The middleware turns it into ``Server-Timing`` and the request's log line.
Code outside a request (the library, ``Service`` driven directly) finds ``None``.
"""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar
from typing import Any

#: Fields of a ``LogRecord`` itself; anything else on a record came from ``extra=``.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",
}


class RequestInfo:
    """One request's facts, filled in as it goes (``perf_counter`` seconds)."""

    __slots__ = ("id", "function", "operator", "call_start", "call_end", "compute", "caller")

    def __init__(self, request_id: str, caller: str | None = None) -> None:
        self.id = request_id
        self.caller = caller  # the client's address: per-caller caps count it
        self.function: str | None = None
        self.operator: str | None = None
        self.call_start = 0.0  # service call entered (0: none happened)
        self.call_end = 0.0
        self.compute: float | None = None  # seconds on the device (None: not measured apart)


#: The request being served in this task (None outside one).
CURRENT: ContextVar[RequestInfo | None] = ContextVar("dxserve_request", default=None)


def enter_call(function: str, operator: str) -> RequestInfo | None:
    """Mark the start of a service call on the current request (if any)."""
    info = CURRENT.get()
    if info is not None:
        info.function, info.operator, info.call_start = function, operator, time.perf_counter()
    return info


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and the record's extras."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and key not in line:
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(level: str, log_format: str) -> None:
    """The root logger's one handler (stderr): text, or JSON lines (``log_format="json"``)."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # JAX says at INFO which accelerator backends it could not start (TPU on every
    # machine without one): noise at the default level, kept for --log-level debug
    quiet = level.upper() != "DEBUG"
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING if quiet else logging.NOTSET)
