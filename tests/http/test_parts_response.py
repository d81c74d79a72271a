"""Large results go out as parts (header, then each array's own memory), never joined.

Joining an 18 MB binary body copied it with the GIL held and stalled the event loop for
~20 ms at the end of every long Jacobian; the answer goes out as parts instead (see
``dxserve.pipeline.operators.OperatorCall.encode``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import numpy as np
import pytest

from dxclient import AsyncClient, Client, FiniteDifferences
from dxcontract import codec

PAYLOADS = {
    "one array": {"jacobian": np.arange(12.0).reshape(3, 4)},
    "odd sizes and dtypes": {
        "value": np.float64(2.5),
        "a": np.arange(7, dtype=np.float32),  # 28 bytes: padded to 64
        "b": np.arange(5, dtype=">f8"),  # big-endian: converted
        "c": np.zeros((0, 3)),
        "d": np.ones((3, 5)).T,  # not contiguous: copied once
    },
    "large": {"jacobian": np.random.default_rng(0).normal(size=(300, 300))},
    "large, every shape": {  # codec.JSON_CHUNK elements per block; rows above it split
        "a": np.random.default_rng(1).normal(size=40_000),
        "b": np.random.default_rng(2).normal(size=(2, 3, 20_000)),
        "c": np.random.default_rng(3).normal(size=(20_000, 1)),
        "n": np.arange(50_000),
        "nan": np.array([np.nan, np.inf, 1.0] * 10_000),
    },
}


@pytest.mark.parametrize("encoding", ["binary", "json", "b64"])
@pytest.mark.parametrize("name", list(PAYLOADS))
def test_parts_join_to_the_one_body(name: str, encoding: str) -> None:
    payload = PAYLOADS[name]
    parts, media, headers = codec.encode_body_parts(payload, encoding)
    body, media1, headers1 = codec.encode_body(payload, encoding)
    assert b"".join(parts) == body
    assert (media, headers) == (media1, headers1)
    decoded = codec.decode_response(
        body, media, headers.get(codec.HEADER_LENGTH), arrays=list(payload)
    )
    for key, value in payload.items():
        np.testing.assert_array_equal(decoded[key], value)


def test_json_parts_split_large_arrays() -> None:
    a = np.random.default_rng(4).normal(size=(1000, 100))
    parts, _, _ = codec.encode_body_parts({"jacobian": a}, "json")
    assert len(parts) > a.size // codec.JSON_CHUNK  # not one long orjson call
    assert b"".join(parts) == codec.encode_body({"jacobian": a}, "json")[0]


def test_binary_parts_are_the_arrays_memory() -> None:
    a = np.random.default_rng(1).normal(size=(500, 400))
    parts, _, _ = codec.encode_body_parts({"jacobian": a}, "binary")
    views = [p for p in parts if isinstance(p, memoryview)]
    assert len(views) == 1 and views[0].nbytes == a.nbytes
    assert np.shares_memory(np.frombuffer(views[0], np.uint8), a)  # not copied


def _jacobian_expected(x: np.ndarray) -> np.ndarray:
    # sin_cumsum: y_i = sin(x_i) * sum_{j<=i} x_j
    n = x.size
    c = np.cumsum(x)
    J = np.tril(np.ones((n, n))) * np.sin(x)[:, None]
    J[np.arange(n), np.arange(n)] += np.cos(x) * c
    return J


@pytest.mark.parametrize("encoding", ["binary", "json"])
def test_large_result_over_the_real_server(server: Any, encoding: str) -> None:
    x = np.linspace(-1.0, 1.0, 300)  # 720 KB result: above the 256 KiB "large" bound
    with Client(server.url, encoding=encoding) as client:
        J = client.jacobian("sin_cumsum", FiniteDifferences(), x)
    np.testing.assert_allclose(J, _jacobian_expected(x), rtol=1e-6, atol=1e-8)


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from dxserve.http import create_app
    from dxserve.settings import Settings

    store = tmp_path_factory.mktemp("parts")
    return create_app(Settings(store=store, compilation_cache="", functions=["dxserve.examples"]))


def test_large_result_over_asgi_transport(app: Any) -> None:
    x = np.linspace(-1.0, 1.0, 300)

    async def main() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with AsyncClient("http://dxserve.test", transport=transport) as client:
            return await client.jacobian("sin_cumsum", FiniteDifferences(), x)

    np.testing.assert_allclose(asyncio.run(main()), _jacobian_expected(x), rtol=1e-6, atol=1e-8)


@pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")
def test_large_result_over_starlette_testclient(app: Any) -> None:
    from starlette.testclient import TestClient

    x = np.linspace(-1.0, 1.0, 300)
    with TestClient(app) as http:
        J = Client(http=http).jacobian("sin_cumsum", FiniteDifferences(), x)
        response = http.post(
            "/jacobian", json={"function": "sin_cumsum", "x": x.tolist(),
                               "backend": {"type": "finite-differences"}},
        )  # fmt: skip
    np.testing.assert_allclose(J, _jacobian_expected(x), rtol=1e-6, atol=1e-8)
    assert response.status_code == 200
    assert int(response.headers["content-length"]) == len(response.content)
    np.testing.assert_allclose(response.json()["jacobian"], J, rtol=1e-12)


def test_answer_parts_are_flat_byte_views_that_join_to_the_body() -> None:
    from dxserve.pipeline.operators import byte_parts

    a = np.random.default_rng(3).normal(size=(700, 400))  # 2.2 MB
    parts, _, _ = codec.encode_body_parts({"jacobian": a}, "binary")
    flat = byte_parts(parts)
    assert all(len(p) == memoryview(p).nbytes > 0 for p in flat)
    assert b"".join(bytes(p) for p in flat) == b"".join(bytes(p) for p in parts)
