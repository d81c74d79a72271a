"""Is a vmapped (batched) gradient bit-identical to the unbatched one on this backend?

Request batching (merging concurrent requests into one vmapped call) must be
invisible: bit-identical results. This prints, per size and batching strategy,
whether XLA on this machine keeps the bits, and the largest difference when not.

    .venv/bin/python bench/batching_bits.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)


def rosenbrock(x):
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def main() -> None:
    rng = np.random.default_rng(0)
    single = jax.jit(jax.value_and_grad(rosenbrock))
    vmapped = jax.jit(jax.vmap(jax.value_and_grad(rosenbrock)))
    mapped = jax.jit(lambda xs: jax.lax.map(jax.value_and_grad(rosenbrock), xs))
    print(f"backend: {jax.default_backend()}, jax {jax.__version__}, batch of 8, value_and_grad(rosenbrock)")
    print()
    print("| n | vmap == unbatched | max abs diff | vmap(B=1) == vmap(B=8) row | lax.map == unbatched |")
    print("|---|---|---|---|---|")
    for n in (10, 100, 1000, 10_000, 100_000):
        xs = rng.normal(size=(8, n))
        ref_v = np.array([single(x)[0] for x in xs])
        ref_g = np.stack([single(x)[1] for x in xs])
        v, g = vmapped(xs)
        same = np.array_equal(ref_g, g) and np.array_equal(ref_v, v)
        diff = max(np.abs(ref_g - g).max(), np.abs(ref_v - v).max())
        one = vmapped(xs[:1])
        bucket = np.array_equal(one[1][0], g[0]) and np.array_equal(one[0][0], v[0])
        lm = mapped(xs)
        seq = np.array_equal(ref_g, lm[1]) and np.array_equal(ref_v, lm[0])
        print(f"| {n} | {same} | {diff:.3g} | {bucket} | {seq} |")


if __name__ == "__main__":
    main()
