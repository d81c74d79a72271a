"""The request layer: decode, validate, admit, run and encode, the same for every door.

A front door (the HTTP app, the Ray handle, a test) turns what it received into a
``RequestHead`` and a body (or values), and hands them to an ``OperatorCall``; it gets
back validated requests, results with progress and cancellation, and encoded
``Answer``s, or typed ``DxError``s to answer with. This layer knows no web framework.
"""

from dxserve.pipeline.operators import (
    Answer,
    BodyBuffer,
    OperatorCall,
    RequestHead,
    stored_calls,
)
from dxserve.pipeline.wire import OperatorRequest, WireMemo

__all__ = [
    "Answer",
    "BodyBuffer",
    "OperatorCall",
    "OperatorRequest",
    "RequestHead",
    "WireMemo",
    "stored_calls",
]
