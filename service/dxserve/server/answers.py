"""An encoded answer, as the server hands it to a door: media type, headers, body parts.

The request layer (``dxserve.pipeline``) encodes an operator's results into one, and
the job runner (``server.jobs.detached``) a stored result; a door sends it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Answer"]


@dataclass(slots=True)
class Answer:
    """An encoded answer: its body as consecutive bytes-like parts of ``nbytes`` in all."""

    media_type: str
    parts: list[Any]
    nbytes: int
    headers: dict[str, str] = field(default_factory=dict)
    status: int = 200
