"""The ``export`` kind: an uploaded JAX export bundle (``dxserve.frameworks.jax.exported``).

Body field: ``export``, the base64 of a ``dxclient.export.export_function`` bundle.
Content: the bundle bytes. Nothing is deserialized in the server process before
the bundle passed the export gate (``dxserve.server.sandboxes.export_gate``): ``admit`` and
``stamp`` bind the gate's pass to the content's sha256 in the store's metadata.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from dxcontract.errors import MalformedRequestError
from dxserve.server.kinds import BaseKind, Built

__all__ = ["EXPORT", "ExportKind"]


class ExportKind(BaseKind):
    """Uploaded exports, gated by ``gate`` (``bind`` gives a registry its own kind over
    its server's gate; unbound, the default gate of code outside a server)."""

    name = "export"
    summary = "a JAX export"
    fields = {
        "export": (str | None, Field(None, description="base64 of a dxclient export bundle")),
    }

    def __init__(self, gate: Any = None) -> None:
        self.gate = gate

    def bind(self, export_gate: Any = None, **_: Any) -> ExportKind:
        """This kind over ``export_gate`` (an ``export_gate.ExportGate``)."""
        return ExportKind(export_gate) if export_gate is not None else self

    def _gate(self) -> Any:
        if self.gate is not None:
            return self.gate
        from dxserve.server.sandboxes.export_gate import default

        return default()

    def validate(self, values: Mapping[str, Any]) -> bytes:
        try:
            return base64.b64decode(values["export"], validate=True)
        except (binascii.Error, ValueError):
            raise MalformedRequestError("export must be base64", field="export") from None

    def admit(self, content: bytes, metadata: Mapping[str, Any] | None) -> None:
        """Before ``build``: trust a stored record's gate stamp, or gate the content now."""
        self._gate().admit(content, metadata)

    def stamp(self, content: bytes) -> dict[str, Any]:
        """Metadata to store with content that passed the gate (its sha256 and versions)."""
        return self._gate().stamp(content)

    def build(self, content: bytes) -> Built:
        # The bundle itself is checked here (InvalidExportError, field "export"):
        # loading it is the check, and validate would only do it twice. The native
        # reader runs in process only on content that passed the gate.
        from dxserve.frameworks.jax.exported import load_float64, refuse_unbounded_loops

        gate = self._gate()
        gate.require(content)

        # dxserve computes float64 in 64-bit mode, which need not be on globally: a
        # float64 export is checked and loaded in that mode, as it will run.
        loaded = load_float64(content)
        # here too: a stored bundle's stamp may date from a server that allowed them
        if gate.config.unbounded_loops != "allow":
            refuse_unbounded_loops(loaded)
        return Built(loaded.fn, loaded.signature)


EXPORT = ExportKind()
