"""Draw the detected sparsity pattern of a 2-D 5-point Laplacian and save it as a PNG.

    python examples/sparsity_pattern.py [out.png]

The pattern comes from the ``sparsity`` operator (asdex's detection, in process). With
matplotlib installed (``pip install -e '.[plot]'``) it is drawn with ``spy``; without
it, a tiny numpy + zlib PNG writer saves the same picture, one pixel block per entry.
"""

from __future__ import annotations

import struct
import sys
import zlib
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import dxserve


def laplacian_2d(x):
    """4u - (up + down + left + right) + u^3 on a k x k grid, zero boundary; x: (k*k,)."""
    k = int(round(x.shape[0] ** 0.5))
    u = jnp.reshape(x, (k, k))
    p = jnp.pad(u, 1)
    lap = 4.0 * u - p[:-2, 1:-1] - p[2:, 1:-1] - p[1:-1, :-2] - p[1:-1, 2:]
    return jnp.reshape(lap + u**3, (-1,))


def write_png(path: Path, image: np.ndarray) -> None:
    """Grayscale uint8 (h, w) image -> PNG (no dependency beyond numpy and zlib)."""
    h, w = image.shape
    raw = b"".join(b"\x00" + image[i].tobytes() for i in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                     + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("sparsity-laplacian.png")
    k = 8
    x = np.random.default_rng(0).uniform(-1, 1, k * k)
    pattern = dxserve.sparsity(laplacian_2d, "auto", x)  # BCOO (n, n), int8 ones
    idx = np.asarray(pattern.indices)
    dense = np.zeros(pattern.shape, dtype=bool)
    dense[idx[:, 0], idx[:, 1]] = True
    prep = dxserve.prepare_jacobian(laplacian_2d, dxserve.Sparse(), x)
    info = prep.report["sparsity"]
    title = (f"2-D 5-point Laplacian, {k}x{k} grid: {info['shape'][0]}x{info['shape'][1]}, "
             f"nnz {info['nnz']}, {info['colors']} colours")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        scale = 6
        image = np.where(dense, 0, 255).astype(np.uint8).repeat(scale, 0).repeat(scale, 1)
        write_png(out, image)
    else:
        fig, ax = plt.subplots(figsize=(5, 5), dpi=100)
        ax.spy(dense, markersize=3)
        ax.set_title(title, fontsize=8)
        fig.tight_layout()
        fig.savefig(out)
    print(f"{title}\nsaved {out}")


if __name__ == "__main__":
    main()
