"""Minimize the served Rosenbrock with SciPy's ``trust-ncg`` and plot the path (PNG).

    make serve &
    python examples/scipy_trust_ncg.py [OUT_DIR]     # default OUT_DIR: examples/output

``client.scipy("rosenbrock")`` gives ``fun`` and ``jac`` (one ``/value_and_gradient``
per point, shared) and ``hessp`` (one ``/hvp`` per product, forward-over-reverse on the
server). The iterates are drawn over the function's contours with matplotlib (Agg, no
display) into ``OUT_DIR/rosenbrock-trust-ncg.png``.

Checks (exit status 1 on failure): SciPy reports success, the optimum is (1, 1) to
1e-6, and the PNG was written.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from scipy.optimize import minimize  # noqa: E402

from dxclient import Client  # noqa: E402

URL = os.environ.get("DXSERVE_URL", "http://127.0.0.1:8000")


def rosenbrock(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The served function's formula at n = 2, on a grid (for the contours only)."""
    return 100.0 * (y - x**2) ** 2 + (1.0 - x) ** 2


def main() -> int:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "output")
    out_dir.mkdir(parents=True, exist_ok=True)

    with Client(URL) as client:
        problem = client.scipy("rosenbrock", backend="auto")
        x0 = np.array([-1.2, 1.0])
        path = [x0.copy()]
        result = minimize(
            problem.fun, x0, jac=problem.jac, hessp=problem.hessp, method="trust-ncg",
            callback=lambda xk: path.append(np.copy(xk)), options={"gtol": 1e-10},
        )
    path = np.array(path)
    print(f"trust-ncg: {result.nit} iterations, f = {result.fun:.3e}, x = {result.x}, "
          f"{problem.requests} service requests")

    fig, ax = plt.subplots(figsize=(6, 4.5))
    gx, gy = np.meshgrid(np.linspace(-1.6, 1.6, 300), np.linspace(-0.6, 1.6, 300))
    ax.contour(gx, gy, np.log1p(rosenbrock(gx, gy)), levels=25, cmap="viridis", linewidths=0.6)
    ax.plot(path[:, 0], path[:, 1], "o-", color="crimson", markersize=3, label="trust-ncg iterates")
    ax.plot([1.0], [1.0], "k*", markersize=12, label="optimum (1, 1)")
    ax.set_title(f"Rosenbrock via dxserve: {result.nit} trust-ncg iterations")
    ax.set_xlabel("x[0]")
    ax.set_ylabel("x[1]")
    ax.legend(loc="lower right")
    png = out_dir / "rosenbrock-trust-ncg.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    print(f"plot: {png}")

    if not result.success or not np.allclose(result.x, 1.0, atol=1e-6):
        print(f"FAIL: trust-ncg did not reach (1, 1): {result.message}", file=sys.stderr)
        return 1
    if png.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
        print(f"FAIL: {png} is not a PNG", file=sys.stderr)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
