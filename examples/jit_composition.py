"""A served function inside a local, jitted JAX loss, with its Hessian.

    make serve &
    python examples/jit_composition.py

``rosenbrock`` runs on the server; ``loss`` adds local JAX terms around it and is
``jax.jit``-compiled. ``jax.grad(loss)`` and ``jax.hessian(loss)`` differentiate through
the served part with the service's own derivatives (``/value_and_gradient`` and one
``/hvp`` request carrying a batch of tangents), never finite differences.

Checks (exit status 1 on failure): value, gradient and Hessian equal those of the same
loss built on a local Rosenbrock, at rtol 1e-12 (float64).
"""

from __future__ import annotations

import os
import sys

import jax

jax.config.update("jax_enable_x64", True)  # this script's own setting: float64 throughout

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dxclient import Client  # noqa: E402
from dxclient.jax import remote_function  # noqa: E402

URL = os.environ.get("DXSERVE_URL", "http://127.0.0.1:8000")


def local_rosenbrock(x: jax.Array) -> jax.Array:
    """The served ``rosenbrock``'s formula, for the comparison."""
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def make_loss(rosenbrock):
    """A local loss around ``rosenbrock``: a change of variables and a penalty."""
    def loss(z: jax.Array) -> jax.Array:
        x = jnp.tanh(z) * 1.5 + 0.1 * z  # local, nonlinear
        return jnp.log1p(rosenbrock(x)) + 0.01 * jnp.sum(z**4)

    return loss


def main() -> int:
    client = Client(URL)
    served = make_loss(remote_function(client, "rosenbrock"))
    local = make_loss(local_rosenbrock)

    z = jnp.array([0.3, -0.7, 1.1, 0.2, -0.4])
    pairs = {
        "value": (jax.jit(served)(z), jax.jit(local)(z)),
        "gradient": (jax.jit(jax.grad(served))(z), jax.jit(jax.grad(local))(z)),
        "hessian": (jax.jit(jax.hessian(served))(z), jax.jit(jax.hessian(local))(z)),
    }
    client.close()
    worst = 0.0
    for name, (got, want) in pairs.items():
        got, want = np.asarray(got), np.asarray(want)
        err = float(np.max(np.abs(got - want) / (np.abs(want) + 1e-300)))
        worst = max(worst, err)
        print(f"{name:9s} shape {str(got.shape):7s} max relative difference {err:.1e}")
        if not np.allclose(got, want, rtol=1e-12, atol=1e-12):
            print(f"FAIL: served {name} differs from the local one", file=sys.stderr)
            return 1
    H = np.asarray(pairs["hessian"][0])
    print(f"Hessian symmetric: {np.allclose(H, H.T, rtol=1e-12)}; eigenvalues {np.linalg.eigvalsh(H).round(3)}")
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
