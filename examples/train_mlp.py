"""Train a small MLP with optax, its gradients computed by the server.

    make serve &                       # or: dxserve serve
    python examples/train_mlp.py       # DXSERVE_URL=http://127.0.0.1:8000 by default

The loss ``loss(params, X, Y)`` (a dict of weights as ``x``; the data as contexts) is
uploaded once with ``client.register`` (``jax.export``, StableHLO, no pickle). Locally it
becomes a JAX function through ``dxclient.jax.remote_function``, so the training step is
plain ``jax.value_and_grad`` + ``optax.adam`` under ``jax.jit``: each step is one
``/value_and_gradient`` request and nothing about the model is differentiated locally.

Checks (exit status 1 on failure): the first served gradient equals the local
``jax.grad`` of the same loss, and the loss falls to under a tenth of its start.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dxclient import Client
from dxclient.jax import remote_function

URL = os.environ.get("DXSERVE_URL", "http://127.0.0.1:8000")
STEPS = 300


def mlp_loss(params: dict, X: jax.Array, Y: jax.Array) -> jax.Array:
    """Mean squared error of a 1-16-16-1 tanh MLP; X, Y: (n, 1) float32."""
    h = jnp.tanh(X @ params["w1"] + params["b1"])
    h = jnp.tanh(h @ params["w2"] + params["b2"])
    return jnp.mean((h @ params["w3"] + params["b3"] - Y) ** 2)


def init(key: jax.Array) -> dict:
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "w1": jax.random.normal(k1, (1, 16)), "b1": jnp.zeros(16),
        "w2": jax.random.normal(k2, (16, 16)) / 4.0, "b2": jnp.zeros(16),
        "w3": jax.random.normal(k3, (16, 1)) / 4.0, "b3": jnp.zeros(1),
    }  # fmt: skip


def main() -> int:
    X = jnp.linspace(-1.5, 1.5, 64, dtype=jnp.float32)[:, None]
    Y = jnp.sin(2.5 * X)
    params = init(jax.random.key(0))

    client = Client(URL)
    # replace=True: running the example again re-uploads the same name without a 409
    served = client.register(mlp_loss, params, X, Y, name="example_mlp_loss", replace=True)
    loss = remote_function(client, served)

    # the served gradient is the local one (float32 on both sides)
    served_grad = jax.grad(loss)(params, X, Y)
    local_grad = jax.grad(mlp_loss)(params, X, Y)
    for key in params:
        if not np.allclose(served_grad[key], local_grad[key], rtol=1e-4, atol=1e-6):
            print(f"FAIL: served gradient of {key} differs from the local one", file=sys.stderr)
            return 1

    optimizer = optax.adam(1e-2)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state):
        value, grads = jax.value_and_grad(loss)(params, X, Y)  # one /value_and_gradient
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for i in range(STEPS):
        params, state, value = step(params, state)
        losses.append(float(value))
        if i % 50 == 0:
            print(f"step {i:4d}  loss {losses[-1]:.5f}")
    final = float(mlp_loss(params, X, Y))
    print(f"loss: {losses[0]:.5f} -> {final:.5f} in {STEPS} steps (gradients from {URL})")
    client.close()
    if not final < 0.1 * losses[0]:
        print("FAIL: the loss did not fall below a tenth of its start", file=sys.stderr)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
