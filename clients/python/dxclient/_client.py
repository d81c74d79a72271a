"""``Client`` and ``AsyncClient``: the library's API over HTTP, numpy in and out.

    client = Client("http://127.0.0.1:8000")
    g = client.gradient("rosenbrock", JaxReverse(), np.array([1.0, 2.0, 3.0]))

Both share the request model (``_models``) and the operator methods
(``_operators``); the transport is swappable, so tests can mount the ASGI app
in process (``transport=httpx.ASGITransport(app)`` for the async client).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import httpx

from . import _models
from ._models import Call, RemoteFunction, RemotePrep
from ._operators import OperatorMethods
from .backends import Backend

DEFAULT_TIMEOUT = 120.0


def _headers(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


class _OperatorURLs:
    """Operator paths resolved against the client's base URL once per path.

    httpx parses a relative path and then parses the merged URL again on every
    request: ~0.1 ms, as much as encoding and decoding a small operator call together
    (SPEC §7 small-request target). A resolved ``httpx.URL`` is used as it is. Only
    the operator table's fixed paths go through here, so the cache stays small.
    """

    def __init__(self) -> None:
        self._base: httpx.URL | None = None
        self._urls: dict[str, httpx.URL] = {}

    def resolve(self, http: httpx.Client | httpx.AsyncClient, path: str) -> httpx.URL:
        base = http.base_url
        if base is not self._base:  # first call, or base_url was reassigned
            self._base, self._urls = base, {}
        url = self._urls.get(path)
        if url is None:
            # httpx's own merge: base_url always ends in "/", the path's "/" is dropped
            url = base.copy_with(raw_path=base.raw_path + path.lstrip("/").encode("ascii"))
            self._urls[path] = url
        return url


def _export(fn: Callable, example_args: tuple, platforms: Sequence[str], **kw: Any) -> bytes:
    from .export import export_function  # needs jax: imported only when registering

    return export_function(fn, *example_args, platforms=tuple(platforms), **kw)


class Client(OperatorMethods):
    """Synchronous client. ``encoding``: "binary" (default), "b64" or "json"."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        encoding: str = "binary",
        transport: httpx.BaseTransport | None = None,
        http: httpx.Client | None = None,
    ) -> None:
        self.encoding = encoding
        self.http = http or httpx.Client(
            base_url=url, timeout=timeout, transport=transport, headers=_headers(token)
        )
        if http is not None and token:
            self.http.headers.update(_headers(token))
        self._urls = _OperatorURLs()

    def _send(self, call: Call, url: httpx.URL | None = None) -> httpx.Response:
        response = self.http.request(
            call.method, call.path if url is None else url, content=call.body, headers=call.headers
        )
        _models.raise_for_problem(response.status_code, response.headers, response.content)
        return response

    def _get(self, path: str) -> Any:
        response = self.http.get(path)
        _models.raise_for_problem(response.status_code, response.headers, response.content)
        return response.json()

    # --- operators -----------------------------------------------------------
    def _operator(self, operator, f, backend, x, tangents, contexts, prep):  # noqa: ANN001
        call = _models.operator_call(operator, f, backend, x, tangents, contexts, prep, self.encoding)
        response = self._send(call, self._urls.resolve(self.http, call.path))
        return _models.operator_result(operator, response.headers, response.content)

    def _prepare(self, operator, f, backend, x, tangents, contexts):  # noqa: ANN001
        call = _models.operator_call(
            operator, f, backend, x, tangents, contexts, None, self.encoding, prepare=True
        )
        return _models.prep_result(self._send(call, self._urls.resolve(self.http, call.path)).content)

    # --- functions -------------------------------------------------------------
    def function(self, name: str) -> RemoteFunction:
        """The registered function ``name`` (raises ``UnknownFunctionError``)."""
        return _models.function_result(self._send(Call("GET", f"/functions/{name}", b"", {})).content)

    def functions(self) -> list[RemoteFunction]:
        return [_models.function_from(o) for o in self._get("/functions")["functions"]]

    def register(
        self,
        fn: Callable,
        *example_args: Any,
        name: str | None = None,
        description: str = "",
        replace: bool = False,
        **export_options: Any,
    ) -> RemoteFunction:
        """Export ``fn(x, *contexts)`` with ``jax.export`` (needs jax locally) and upload it.

        Lowered for every platform the server reports in ``GET /ready`` unless
        ``platforms=`` says otherwise; other options go to ``export_function``
        (``polymorphic_shapes``, ``constraints``).
        """
        platforms = export_options.pop("platforms", None) or self.ready()["export_platforms"]
        bundle = _export(fn, example_args, platforms, **export_options)
        call = _models.register_call(
            name or fn.__name__, description, replace, export=bundle
        )
        return _models.function_result(self._send(call).content)

    def register_expression(
        self,
        name: str,
        expression: str,
        args: Sequence[str] = ("x",),
        *,
        description: str = "",
        replace: bool = False,
    ) -> RemoteFunction:
        """Register a whitelisted ``jnp`` expression; the first arg is the active input."""
        call = _models.register_call(
            name, description, replace, expression=expression, args=tuple(args)
        )
        return _models.function_result(self._send(call).content)

    def delete(self, f: RemoteFunction | str) -> None:
        response = self.http.delete(f"/functions/{_models.function_name(f)}")
        _models.raise_for_problem(response.status_code, response.headers, response.content)

    # --- service ---------------------------------------------------------------
    def health(self) -> dict:
        return self._get("/health")

    def ready(self) -> dict:
        return self._get("/ready")

    def backends(self) -> list[dict]:
        return self._get("/backends")["backends"]

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(OperatorMethods):
    """Asynchronous client: the same methods as ``Client``, awaited."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        encoding: str = "binary",
        transport: httpx.AsyncBaseTransport | None = None,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.encoding = encoding
        self.http = http or httpx.AsyncClient(
            base_url=url, timeout=timeout, transport=transport, headers=_headers(token)
        )
        self._urls = _OperatorURLs()

    async def _send(self, call: Call, url: httpx.URL | None = None) -> httpx.Response:
        response = await self.http.request(
            call.method, call.path if url is None else url, content=call.body, headers=call.headers
        )
        _models.raise_for_problem(response.status_code, response.headers, response.content)
        return response

    async def _get(self, path: str) -> Any:
        response = await self.http.get(path)
        _models.raise_for_problem(response.status_code, response.headers, response.content)
        return response.json()

    async def _operator(self, operator, f, backend, x, tangents, contexts, prep):  # noqa: ANN001
        call = _models.operator_call(operator, f, backend, x, tangents, contexts, prep, self.encoding)
        response = await self._send(call, self._urls.resolve(self.http, call.path))
        return _models.operator_result(operator, response.headers, response.content)

    async def _prepare(self, operator, f, backend, x, tangents, contexts):  # noqa: ANN001
        call = _models.operator_call(
            operator, f, backend, x, tangents, contexts, None, self.encoding, prepare=True
        )
        response = await self._send(call, self._urls.resolve(self.http, call.path))
        return _models.prep_result(response.content)

    async def function(self, name: str) -> RemoteFunction:
        return _models.function_from(await self._get(f"/functions/{name}"))

    async def functions(self) -> list[RemoteFunction]:
        return [_models.function_from(o) for o in (await self._get("/functions"))["functions"]]

    async def register(
        self,
        fn: Callable,
        *example_args: Any,
        name: str | None = None,
        description: str = "",
        replace: bool = False,
        **export_options: Any,
    ) -> RemoteFunction:
        platforms = export_options.pop("platforms", None) or (await self.ready())["export_platforms"]
        bundle = _export(fn, example_args, platforms, **export_options)
        call = _models.register_call(name or fn.__name__, description, replace, export=bundle)
        return _models.function_result((await self._send(call)).content)

    async def register_expression(
        self,
        name: str,
        expression: str,
        args: Sequence[str] = ("x",),
        *,
        description: str = "",
        replace: bool = False,
    ) -> RemoteFunction:
        call = _models.register_call(
            name, description, replace, expression=expression, args=tuple(args)
        )
        return _models.function_result((await self._send(call)).content)

    async def delete(self, f: RemoteFunction | str) -> None:
        response = await self.http.delete(f"/functions/{_models.function_name(f)}")
        _models.raise_for_problem(response.status_code, response.headers, response.content)

    async def health(self) -> dict:
        return await self._get("/health")

    async def ready(self) -> dict:
        return await self._get("/ready")

    async def backends(self) -> list[dict]:
        return (await self._get("/backends"))["backends"]

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


__all__ = ["AsyncClient", "Client", "RemoteFunction", "RemotePrep", "Backend"]
