"""Server-side functions that misbehave only while their pattern is being detected, in
the detection child (where an address-space limit is set): they crash it, exhaust its
memory or spin past its time. In the server process itself they trace normally, so
the server's own shape probe of them succeeds. For ``tests/service/test_sparse_bounds.py``;
never registered by a server that serves anything else.
"""

from __future__ import annotations

import os
import resource

import jax.numpy as jnp

import dxserve


def _in_detection_child() -> bool:
    return resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY


@dxserve.function(description="sin(x); aborts the detection child")
def sp_abort(x):
    if _in_detection_child():
        os.abort()
    return jnp.sin(x)


@dxserve.function(description="sin(x); fills the detection child's memory")
def sp_hog(x):
    if _in_detection_child():
        hoard = []
        while True:
            hoard.append(bytearray(64 << 20))
    return jnp.sin(x)


@dxserve.function(description="sin(x); spins in the detection child")
def sp_spin(x):
    if _in_detection_child():
        while True:
            pass
    return jnp.sin(x)


def _make_closure():
    scale = 2.0

    def closure(x):
        return scale * jnp.sin(x)

    return closure


#: a closure: it has no importable name, so it cannot be rebuilt in the child
sp_closure = dxserve.function(name="sp_closure", description="2 sin(x), a closure")(
    _make_closure()
)
