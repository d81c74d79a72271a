"""The export bundle: the container of an uploaded JAX function (no pickle, no source).

    b"DXEXPORT"                 8-byte magic
    uint32 big-endian N         length of the manifest
    N bytes                     UTF-8 JSON manifest (see ``bundle_signature``)
    blobs                       the serialized ``Exported`` of each artifact,
                                at ``offset``/``length`` (relative to the end of
                                the manifest), each with its sha256

The client writes it (``dxclient.export.export_function``), the server reads it
(``split_bundle``); what each artifact is, ``dxclient.export`` says. Reading one needs
no JAX.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

from .encodings.common import loads_checked

MAGIC = b"DXEXPORT"
FORMAT_NAME = "dxserve-export"
FORMAT_VERSION = 1
BATCH_DIM = "dxk"
ARTIFACTS = ("primal", "jvp", "vjp", "jvp_jvp", "jvp_vjp")
MAX_MANIFEST_BYTES = 1 << 20

__all__ = [
    "ARTIFACTS",
    "BATCH_DIM",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_MANIFEST_BYTES",
    "bundle_signature",
    "pack",
    "split_bundle",
    "tree_spec",
]


# ----------------------------------------------------------------------------
# container
# ----------------------------------------------------------------------------
def pack(manifest: dict[str, Any], blobs: dict[str, bytes]) -> bytes:
    artifacts = {}
    offset = 0
    body = bytearray()
    for name, blob in blobs.items():
        artifacts[name] = {
            "offset": offset,
            "length": len(blob),
            "sha256": hashlib.sha256(blob).hexdigest(),
        }
        body += blob
        offset += len(blob)
    manifest = dict(manifest, artifacts=artifacts)
    head = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    return MAGIC + struct.pack(">I", len(head)) + head + bytes(body)


def split_bundle(bundle: bytes) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Parse the container: ``(manifest, {artifact: blob})``. Raises ``ValueError``.

    Checks the magic, the format name/version, that every artifact lies inside the
    bundle, that nothing trails the last artifact, and every blob's sha256.
    """
    if not isinstance(bundle, bytes | bytearray | memoryview):
        raise ValueError(f"a bundle is bytes, got {type(bundle).__name__}")
    bundle = bytes(bundle)
    if len(bundle) < len(MAGIC) + 4 or not bundle.startswith(MAGIC):
        raise ValueError("not a dxserve export bundle (bad magic)")
    (n,) = struct.unpack(">I", bundle[len(MAGIC) : len(MAGIC) + 4])
    start = len(MAGIC) + 4
    if n > MAX_MANIFEST_BYTES or start + n > len(bundle):
        raise ValueError(f"manifest length {n} is out of range")
    try:  # finite numbers only, bounded nesting: the manifest is walked recursively
        manifest = loads_checked(bundle[start : start + n])
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"manifest is not JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ValueError(f"manifest does not name the format {FORMAT_NAME!r}")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"unknown format_version {version!r}; this code reads version {FORMAT_VERSION}"
        )
    arts = manifest.get("artifacts")
    if not isinstance(arts, dict) or set(arts) != set(ARTIFACTS):
        raise ValueError(f"manifest must list exactly the artifacts {list(ARTIFACTS)}")
    body = bundle[start + n :]
    blobs: dict[str, bytes] = {}
    end = 0
    for name in ARTIFACTS:
        a = arts[name]
        try:
            off, length, digest = int(a["offset"]), int(a["length"]), str(a["sha256"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"artifact {name!r} has a bad entry") from None
        if off < 0 or length <= 0 or off + length > len(body):
            raise ValueError(f"artifact {name!r} lies outside the bundle")
        blob = body[off : off + length]
        if hashlib.sha256(blob).hexdigest() != digest:
            raise ValueError(f"artifact {name!r} does not match its sha256 (corrupt bundle)")
        blobs[name] = blob
        end = max(end, off + length)
    if end != len(body):
        raise ValueError(f"{len(body) - end} trailing bytes after the last artifact")
    return manifest, blobs


def bundle_signature(bundle: bytes) -> dict[str, Any]:
    """The bundle's manifest (format, versions, platforms, signature, artifacts).

    Verifies the container (magic, version, hashes) but not the StableHLO inside;
    needs no JAX. Raises ``ValueError`` for anything that is not a valid bundle.
    """
    manifest, _ = split_bundle(bundle)
    return manifest


# ----------------------------------------------------------------------------
# signature helpers (JSON description of pytrees of ShapeDtypeStructs)
# ----------------------------------------------------------------------------
def _dim_str(d: Any) -> int | str:
    return d if isinstance(d, int) else str(d)


def tree_spec(tree: Any, where: str) -> dict[str, Any]:
    """JSON description of a pytree of arrays/ShapeDtypeStructs.

    Nodes: ``{"dict": {key: node}}`` (string keys), ``{"list": [...]}``,
    ``{"tuple": [...]}``, ``{"none": true}``, leaves
    ``{"shape": [int | "symbolic expr"], "dtype": "float64"}``.
    """
    import numpy as np

    if tree is None:
        return {"none": True}
    if isinstance(tree, dict):
        if not all(isinstance(k, str) for k in tree):
            raise ValueError(f"{where}: dict keys must be strings")
        if type(tree) is not dict:
            raise ValueError(f"{where}: only plain dicts are supported, got {type(tree).__name__}")
        return {"dict": {k: tree_spec(tree[k], f"{where}.{k}") for k in sorted(tree)}}
    if type(tree) is list:
        return {"list": [tree_spec(v, f"{where}[{i}]") for i, v in enumerate(tree)]}
    if type(tree) is tuple:
        return {"tuple": [tree_spec(v, f"{where}[{i}]") for i, v in enumerate(tree)]}
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        return {"shape": [_dim_str(d) for d in tree.shape], "dtype": np.dtype(tree.dtype).name}
    raise ValueError(
        f"{where}: unsupported pytree node {type(tree).__name__} "
        "(use dicts with string keys, lists, tuples, None and arrays)"
    )
