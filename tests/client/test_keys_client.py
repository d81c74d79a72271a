"""Typed JAX PRNG keys through dxclient and a real server: sent as contexts in every
encoding, for every implementation, and given back as keys.

Each served result equals the library's in-process result bit for bit (same function,
same key, same executable), and the in-process results are checked against the
analytic derivatives of ``noisy`` (``tests/references.py``) in
tests/library/test_keys_library.py; here too, once per implementation.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import pytest

import dxclient
import dxserve
from dxclient import AsyncClient, Client, KeyArray, Sparse
from dxcontract.errors import InvalidArgumentError, PreparationMismatchError
from dxserve.examples import noisy
from tests import key_functions
from tests.conftest import REPO, ServerProcess, start_server, stop_server
from tests.references import noisy_gradient, noisy_hessian

IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
ENCODINGS = ("binary", "json", "b64")
MODULES = ("dxserve.examples", "tests.key_functions")
X = np.array([1.0, 2.0, 3.0])


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("keys"), modules=MODULES)
    try:
        yield server
    finally:
        stop_server(server)


@pytest.fixture(params=ENCODINGS)
def client(srv: ServerProcess, request: pytest.FixtureRequest) -> Iterator[Client]:
    with Client(srv.url, encoding=request.param) as c:
        yield c


def same(a: Any, b: Any) -> None:
    """Bit for bit: arrays by bytes and dtype, JAX keys by implementation and words."""
    if isinstance(a, tuple | list):
        assert type(a) is type(b) and len(a) == len(b)
        for u, v in zip(a, b, strict=True):
            same(u, v)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        assert jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key), b
        assert str(a.dtype) == str(b.dtype) and a.shape == b.shape
        np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))
    else:
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), (a, b)


def draws(key: jax.Array) -> np.ndarray:
    with dxserve.float64_scope():
        return np.asarray(jax.random.normal(key, X.shape, X.dtype))


@pytest.mark.parametrize("impl", IMPLS)
def test_value_and_gradient_with_a_key_equal_the_library_bit_for_bit(
    client: Client, impl: str
) -> None:
    key = jax.random.key(0, impl=impl)
    same(client.value("noisy", "auto", X, key), dxserve.value(noisy, "auto", X, key))
    g = client.gradient("noisy", "auto", X, key)
    same(g, dxserve.gradient(noisy, "auto", X, key))
    np.testing.assert_allclose(g, noisy_gradient(X, draws(key)), rtol=1e-12)
    H = client.hessian("noisy", X, key)  # the backend left out
    same(H, dxserve.hessian(noisy, "auto", X, key))
    np.testing.assert_allclose(H, noisy_hessian(X, draws(key)), rtol=1e-12, atol=1e-15)


def test_the_exact_call_of_the_report(srv: ServerProcess) -> None:
    with Client(srv.url) as c:
        v = c.value("noisy", "auto", X, jax.random.key(0))
    same(v, dxserve.value(noisy, "auto", X, jax.random.key(0)))


@pytest.mark.parametrize("impl", IMPLS)
def test_arrays_and_pytrees_of_keys(client: Client, impl: str) -> None:
    keys = jax.random.split(jax.random.key(1, impl=impl), 4)
    g = client.gradient("noisy_keys", X, keys)
    same(g, dxserve.gradient(key_functions.noisy_keys, "auto", X, keys))
    with dxserve.float64_scope():  # as the function draws (rbg's bits differ under vmap)
        z = np.asarray(jax.vmap(lambda k: jax.random.normal(k, X.shape, X.dtype))(keys))
    np.testing.assert_allclose(g, noisy_gradient(X, z.mean(axis=0)), rtol=1e-12)
    grid = jax.random.split(jax.random.key(2, impl=impl), (2, 3))  # a 2-d key array
    same(client.value("noisy_keys", X, grid.reshape(-1)),
         dxserve.value(key_functions.noisy_keys, "auto", X, grid.reshape(-1)))
    state = {"key": jax.random.key(3, impl=impl), "scale": np.array(0.1)}
    same(client.gradient("noisy_tree", X, state),
         dxserve.gradient(key_functions.noisy_tree, "auto", X, state))


@pytest.mark.parametrize("impl", IMPLS)
def test_keys_come_back_as_keys(client: Client, impl: str) -> None:
    key = jax.random.key(4, impl=impl)
    y, new_key = client.value("noisy_step", X, key)
    same((y, new_key), dxserve.value(key_functions.noisy_step, "auto", X, key))
    assert jax.dtypes.issubdtype(new_key.dtype, jax.dtypes.prng_key)
    # the key given back is a key: the next step takes it as it is
    same(client.value("noisy_step", X, new_key),
         dxserve.value(key_functions.noisy_step, "auto", X, new_key))
    split = client.value("split_keys", X, key)
    assert split["keys"].shape == (3,)
    same(split, dxserve.value(key_functions.split_keys, "auto", X, key))


@pytest.mark.parametrize("impl", IMPLS)
def test_the_next_key_as_aux(client: Client, impl: str) -> None:
    """A training step's loss and its next key: the key is aux, never differentiated."""
    key = jax.random.key(10, impl=impl)
    (y, new_key), g = client.value_and_gradient("noisy_step", X, key, has_aux=True)
    same(((y, new_key), g),
         dxserve.value_and_gradient(key_functions.noisy_step, "auto", X, key, has_aux=True))
    assert jax.dtypes.issubdtype(new_key.dtype, jax.dtypes.prng_key)
    np.testing.assert_allclose(g, noisy_gradient(X, draws(jax.random.split(key)[1])), rtol=1e-12)


def test_a_key_made_inside_the_function_comes_back(client: Client) -> None:
    same(client.value("seeded", X), dxserve.value(key_functions.seeded, "auto", X))


def test_other_operators_and_paths(srv: ServerProcess) -> None:
    key = jax.random.key(5)
    with Client(srv.url) as c:
        t = (np.array([1.0, 0.0, -1.0]), np.array([0.5, 2.0, 0.25]))
        same(c.hvp("noisy", X, t, key), dxserve.hvp(noisy, "auto", X, t, key))
        same(c.pullback("noisy", X, (np.array(2.0),), key),
             dxserve.pullback(noisy, "auto", X, (np.array(2.0),), key))
        xs = np.stack([X, -X, 0.5 * X])  # many points, one key shared
        same(c.gradient("noisy", xs, key, batch_axis=0),
             dxserve.gradient(noisy, "auto", xs, key, batch_axis=0))
        # sparse Hessians: the pattern is found in a child process, given the key's spec
        H = c.hessian("noisy", Sparse(), X, key)
        np.testing.assert_allclose(H.toarray(), noisy_hessian(X, draws(key)), rtol=1e-12)
        assert H.nnz == 3
        prep = c.prepare_gradient("noisy", X, key)
        same(c.gradient("noisy", X, jax.random.key(6), prep=prep),
             dxserve.gradient(noisy, "auto", X, jax.random.key(6)))
        with pytest.raises(PreparationMismatchError) as err:
            c.gradient("noisy", X, jax.random.key(6, impl="rbg"), prep=prep)
        assert err.value.field == "contexts[0]" and "key<rbg>" in err.value.detail


def test_concurrent_calls_with_keys(srv: ServerProcess) -> None:
    """Concurrent calls of one prep may be merged by the server: each answers its own key."""

    async def main() -> list[Any]:
        async with AsyncClient(srv.url) as c:
            return await asyncio.gather(*(
                c.gradient("noisy", X * (i + 1), jax.random.key(i)) for i in range(8)
            ))

    for i, g in enumerate(asyncio.run(main())):
        same(g, dxserve.gradient(noisy, "auto", X * (i + 1), jax.random.key(i)))


def test_a_key_as_x_is_a_422_naming_x(client: Client) -> None:
    with pytest.raises(InvalidArgumentError, match="Pass the key as a context") as err:
        client.gradient("noisy", jax.random.key(0), X)
    assert err.value.field == "x" and err.value.status == 422
    with pytest.raises(InvalidArgumentError) as err:
        client.pushforward("noisy", X, (jax.random.key(0),), jax.random.key(1))
    assert err.value.field == "tangents[0]"


def test_a_wire_key_is_sent_as_the_key(client: Client) -> None:
    key = jax.random.key(7, impl="unsafe_rbg")
    wire = KeyArray("unsafe_rbg", np.asarray(jax.random.key_data(key)))
    same(client.gradient("noisy", X, wire), dxserve.gradient(noisy, "auto", X, key))


_WITHOUT_JAX = """
import json, sys
sys.modules["jax"] = None  # as if JAX were not installed: importing it fails
import numpy as np
import dxclient
from dxclient import KeyArray
try:
    import jax
except ImportError:
    pass
else:
    raise SystemExit("jax importable")
key = KeyArray("threefry2x32", np.array([0, 4], np.uint32))
with dxclient.Client(sys.argv[1], encoding=sys.argv[2]) as c:
    g = c.gradient("noisy", np.array([1.0, 2.0, 3.0]), key)
    y, new_key = c.value("noisy_step", np.array([1.0, 2.0, 3.0]), key)
    again = c.value("noisy_step", np.array([1.0, 2.0, 3.0]), new_key)
print(json.dumps({
    "g": g.tolist(), "y": float(y), "type": type(new_key).__name__, "impl": new_key.impl,
    "data": new_key.data.tolist(), "again": [float(again[0]), again[1].data.tolist()],
}))
"""


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_without_jax_keys_are_key_arrays(srv: ServerProcess, encoding: str) -> None:
    """dxclient imports without JAX, and keys come back as ``KeyArray``s (impl and words),
    which go back to the server as the same keys."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_WITHOUT_JAX), srv.url, encoding],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    key = jax.random.wrap_key_data(np.array([0, 4], np.uint32), impl="threefry2x32")
    same(np.array(got["g"]), dxserve.gradient(noisy, "auto", X, key))
    y, new_key = dxserve.value(key_functions.noisy_step, "auto", X, key)
    assert got["y"] == float(y) and got["type"] == "KeyArray" and got["impl"] == "threefry2x32"
    assert got["data"] == np.asarray(jax.random.key_data(new_key)).tolist()
    y2, key2 = dxserve.value(key_functions.noisy_step, "auto", X, new_key)
    assert got["again"] == [float(y2), np.asarray(jax.random.key_data(key2)).tolist()]


@pytest.mark.slow  # two servers one after the other: a restart
def test_a_restarted_server_with_an_executable_cache(
    make_server: Callable[..., ServerProcess], tmp_path: Any
) -> None:
    """Operators with keys are not persisted (a loaded executable does not take JAX's
    key arrays): the restarted server compiles them again and answers the same."""
    args = ("--compilation-cache", str(tmp_path / "xla"))
    key, keys = jax.random.key(8, impl="rbg"), jax.random.split(jax.random.key(9), 3)
    answers = []
    for _ in range(2):
        server = make_server(args=args, modules=MODULES)
        with Client(server.url) as c:
            answers.append((
                c.gradient("noisy", X, key), c.value("noisy_step", X, key),
                c.value("seeded", X), c.gradient("noisy_keys", X, keys),
                c.gradient("rosenbrock", X),  # persisted as before
            ))
        stop_server(server)
        assert "ignoring executable cache entry" not in server.log.read_text()
    same(answers[0], answers[1])
    same(answers[0][0], dxserve.gradient(noisy, "auto", X, key))
    assert dxclient.KeyArray is KeyArray
