"""``dxcontract.encodings``, where dxclient's users found it: the wire encodings live in
the contract package shared with the server (register a new one there, or here)."""

from dxcontract.encodings import *  # noqa: F403
from dxcontract.encodings import __all__ as __all__
