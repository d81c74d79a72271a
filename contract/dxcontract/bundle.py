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

The manifest's ``modes`` says which modes of differentiation the bundle carries:
``["forward", "reverse"]`` (every artifact) or ``["forward"]`` (the primal and the
forward maps ``jvp`` and ``jvp_jvp``, for a function whose reverse mode does not trace,
a ``lax.while_loop`` say). Format version 1 carries every artifact and may omit
``modes`` (bundles written before it existed); a forward-only bundle is version 2,
which servers that predate it refuse by its version instead of misreading it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

from .encodings.common import loads_checked

MAGIC = b"DXEXPORT"
FORMAT_NAME = "dxserve-export"
#: The newest format version (what a forward-only bundle needs); ``FORMAT_VERSIONS``
#: are those this code reads.
FORMAT_VERSION = 2
FORMAT_VERSIONS = (1, 2)
BATCH_DIM = "dxk"
ARTIFACTS = ("primal", "jvp", "vjp", "jvp_jvp", "jvp_vjp")
#: The modes a bundle may carry, and the artifacts each adds to the primal. Reverse
#: mode's second-order map (``jvp_vjp``) is forward over reverse: reverse needs forward.
MODES = ("forward", "reverse")
MODE_ARTIFACTS = {"forward": ("jvp", "jvp_jvp"), "reverse": ("vjp", "jvp_vjp")}
MAX_MANIFEST_BYTES = 1 << 20

__all__ = [
    "ARTIFACTS",
    "BATCH_DIM",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "FORMAT_VERSIONS",
    "MAGIC",
    "MAX_MANIFEST_BYTES",
    "MODES",
    "MODE_ARTIFACTS",
    "artifacts_for",
    "bundle_modes",
    "bundle_signature",
    "format_version_for",
    "pack",
    "split_bundle",
    "tree_spec",
]


def artifacts_for(modes: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The artifacts a bundle carrying ``modes`` holds, in ``ARTIFACTS`` order."""
    held = {"primal"}.union(*(MODE_ARTIFACTS[m] for m in modes))
    return tuple(a for a in ARTIFACTS if a in held)


def format_version_for(modes: tuple[str, ...] | list[str]) -> int:
    """The version a bundle carrying ``modes`` is written as: 1 with every mode (read by
    servers from before ``modes`` existed), else 2."""
    return 1 if tuple(modes) == MODES else 2


def bundle_modes(manifest: dict[str, Any]) -> tuple[str, ...]:
    """The modes a manifest declares, checked (in ``MODES`` order). Raises ``ValueError``
    naming ``modes`` for a malformed declaration."""
    version = manifest.get("format_version")
    declared = manifest.get("modes")
    if declared is None and "modes" not in manifest and version == 1:
        return MODES  # written before bundles declared their modes: every artifact
    if not isinstance(declared, list) or not declared:
        raise ValueError(
            f"manifest field 'modes' must be a non-empty list of {list(MODES)}, "
            f"got {declared!r}"[:300]
        )
    for mode in declared:
        if not isinstance(mode, str) or mode not in MODES:
            raise ValueError(f"manifest field 'modes' names an unknown mode {mode!r}"[:300])
    if len(set(declared)) != len(declared):
        raise ValueError(f"manifest field 'modes' repeats a mode: {declared!r}"[:300])
    if "forward" not in declared:
        raise ValueError(
            "manifest field 'modes' must include 'forward' (reverse mode's artifacts "
            "build on the forward ones)"
        )
    modes = tuple(m for m in MODES if m in declared)
    if version == 1 and modes != MODES:
        raise ValueError(
            f"format_version 1 carries every mode; a bundle with modes {list(modes)} "
            f"is format_version {format_version_for(modes)}"
        )
    return modes


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

    Checks the magic, the format name/version, the declared ``modes`` and that the
    artifacts are exactly theirs, that every artifact lies inside the bundle, that
    nothing trails the last artifact, and every blob's sha256.
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
    if type(version) is not int or version not in FORMAT_VERSIONS:
        raise ValueError(
            f"unknown format_version {version!r}; this code reads versions "
            f"{', '.join(map(str, FORMAT_VERSIONS))}"[:300]
        )
    held = artifacts_for(bundle_modes(manifest))
    arts = manifest.get("artifacts")
    if not isinstance(arts, dict) or set(arts) != set(held):
        raise ValueError(f"manifest must list exactly the artifacts {list(held)}")
    body = bundle[start + n :]
    blobs: dict[str, bytes] = {}
    end = 0
    for name in held:
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
    """The bundle's manifest (format, versions, modes, platforms, signature, artifacts).

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
    ``{"shape": [int | "symbolic expr"], "dtype": "float64"}`` (a typed PRNG key's
    dtype is its wire dtype, ``"key<threefry2x32>"``).
    """
    from .keys import dtype_name

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
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):  # a typed key: "key<threefry2x32>"
        return {"shape": [_dim_str(d) for d in tree.shape], "dtype": dtype_name(tree.dtype)}
    raise ValueError(
        f"{where}: unsupported pytree node {type(tree).__name__} "
        "(use dicts with string keys, lists, tuples, None and arrays)"
    )
