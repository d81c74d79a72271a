"""``Client`` and ``AsyncClient``: the library's API over HTTP, numpy in and out.

    client = Client("http://127.0.0.1:8000")
    g = client.gradient("rosenbrock", JaxReverse(), np.array([1.0, 2.0, 3.0]))

Every method is written once, in ``_ClientBase``, without doing any I/O: it builds
``Call``s and parses their responses. The two classes differ only in how a call
travels, two small methods each:

* ``_run(call, url, parse, *args)`` sends one call and returns
  ``parse(*args, response)``: right away for ``Client``, as an awaitable for
  ``AsyncClient``. Operator calls (the hot path) go straight through it.
* other methods are plans, generators that ``yield`` each ``Call``, receive its
  response and ``return`` the result (``register`` asks ``/ready`` first). ``_drive``
  runs a plan, each call through ``_run``.

The transport is swappable, so tests can mount the ASGI app in process
(``transport=httpx.ASGITransport(app)`` for the async client).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import time
import urllib.request
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, TypeVar

import httpx

from dxcontract.backends import Backend
from dxcontract.errors import UnknownPreparationError
from dxcontract.lru import LRU

from . import _models, models
from . import progress as progress_events
from ._models import Call, PartsCall, RemoteFunction, RemotePrep
from ._operators import OperatorMethods
from .errors import ServerUnreachableError
from .jobs import AsyncJob, Job, Submitter, job_plan, list_plan
from .transport import FastPath

DEFAULT_TIMEOUT = 120.0

T = TypeVar("T")
#: A method's requests and result, without I/O: yields calls, is sent their responses,
#: returns the result. ``Client`` returns that result, ``AsyncClient`` an awaitable of it.
Plan = Generator[Call, httpx.Response, T]


#: Errors after which a request may be sent again: the connection failed or broke
#: before an answer came. Only idempotent calls are retried after these.
_TRANSPORT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError,
                     httpx.RemoteProtocolError, httpx.WriteError)
MAX_RETRY_DELAY = 30.0
#: Statuses that, without dxserve's problem+json body, come from a proxy or load balancer
#: in front of the server: retried like a connection error.
_GATEWAY_ERRORS = (500, 502, 504)
#: Errors that mean no connection was made: past the last retry, a ServerUnreachableError.
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)


def _full_url(http: httpx.Client | httpx.AsyncClient, call: Call) -> str:
    """The address ``call`` goes to: the client's base URL and the call's path."""
    return str(http.base_url).rstrip("/") + "/" + call.path.lstrip("/")


def _unreachable(exc: httpx.TransportError, url: str, tries: int) -> ServerUnreachableError:
    """``exc``, the last of ``tries`` failed connections to ``url``, as the client's
    typed error (the request kept, for callers that read it as httpx's)."""
    err = ServerUnreachableError(url, tries, str(exc) or type(exc).__name__)
    try:
        err.request = exc.request
    except RuntimeError:  # raised before a request was attached
        pass
    return err


def _idempotent(call: Call) -> bool:
    """Operator and preparation POSTs, GETs and DELETEs can be repeated safely;
    registration (``POST /functions``) and job submission (``POST /jobs/<op>``) cannot
    (a retry could register twice, or run the job twice)."""
    return call.method != "POST" or not call.path.startswith(("/functions", "/jobs"))


def _retry_delay(response: httpx.Response | None, attempt: int, backoff: float) -> float | None:
    """Seconds to wait before trying again, or None when this answer is final.

    A 503 says when to come back in ``Retry-After`` (seconds); without one, and after
    a connection error, the wait doubles from ``backoff``.
    """
    if response is not None:
        if response.status_code in _GATEWAY_ERRORS and not response.headers.get(
            "content-type", ""
        ).startswith("application/problem+json"):
            # not dxserve's answer but a proxy's in front of it (Ray Serve's proxy says 500
            # when the replica running the call dies): the call may be sent again
            return min(backoff * 2**attempt, MAX_RETRY_DELAY)
        if response.status_code != 503:
            return None
        after = response.headers.get("retry-after")
        if after is not None:
            try:
                return min(max(float(after), 0.0), MAX_RETRY_DELAY)
            except ValueError:
                pass
    return min(backoff * 2**attempt, MAX_RETRY_DELAY)


def _headers(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


class _OperatorURLs:
    """Operator paths resolved against the client's base URL once per path.

    httpx parses a relative path and then parses the merged URL again on every
    request: ~0.1 ms, as much as encoding and decoding a small operator call together,
    which is most of a small call's client-side cost. A resolved ``httpx.URL`` is used
    as it is. Only the operator table's fixed paths go through here, so the cache stays
    small.
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
    try:
        import jax  # noqa: F401  (imported only when registering)
    except ImportError as exc:
        from dxcontract.extras import install_hint

        raise ImportError(
            f"registering a Python function exports it with JAX: {install_hint('jax')}"
        ) from exc
    from .export import export_function

    return export_function(fn, *example_args, platforms=tuple(platforms), **kw)


class _AsyncParts:
    """A ``PartsCall``'s parts as the async iterable httpx's async transports read."""

    def __init__(self, parts: tuple) -> None:
        self.parts = parts

    async def __aiter__(self) -> Any:
        for part in self.parts:
            yield part


def _send_args(call: Call, asynchronous: bool = False) -> dict[str, Any]:
    """``content`` and ``headers`` of ``call`` as httpx sends them (a ``PartsCall``'s
    parts one by one, never joined)."""
    if type(call) is PartsCall:
        return {
            "content": _AsyncParts(call.parts) if asynchronous else call.parts,
            "headers": {**call.headers, "content-length": str(call.size)},
        }
    return {"content": call.body, "headers": call.headers}


def _parts(call: Call) -> tuple[Any, ...]:
    """``call``'s body as parts (bytes-like, in order)."""
    return call.parts if type(call) is PartsCall else (call.body,)


#: what a response that has been read streams from here on
_READ = httpx.ByteStream(b"")


def _unbind(response: httpx.Response) -> None:
    """Drop httpx's wrapper around the stream of ``response``, which has been read: the
    wrapper refers back to the response, and that cycle keeps the body alive until the
    garbage collector runs. Without it a large answer's buffer is free as soon as the
    caller lets go of what was decoded from it."""
    response.stream = _READ


def _get(path: str) -> Call:
    return Call("GET", path, b"", {})


def _response(response: httpx.Response) -> httpx.Response:
    return response


def _operator_answer(operator: str, has_aux: bool, response: httpx.Response) -> Any:
    return _models.operator_result(operator, response.headers, response.content, has_aux)


def _streamed_answer(operator: str, has_aux: bool, data: bytes) -> Any:
    """The ``result`` event's data (JSON, typed base64 arrays), decoded like an answer."""
    return _models.operator_result(operator, _JSON_HEADERS, data, has_aux)


_JSON_HEADERS = {"content-type": "application/json"}


def _prep_answer(request: Call, response: httpx.Response) -> RemotePrep:
    return _models.prep_result(response.content, request)


#: Handles renewed after the server dropped them, remembered per client so a prep whose
#: handle expired is prepared again once, not on every later call that passes it.
_RENEWED_HANDLES = 256


def _plan(method: Callable[..., Plan[Any]]) -> Callable[..., Any]:
    """Make a plan-writing method public: ``Client`` runs it, ``AsyncClient`` awaits it."""

    @functools.wraps(method)
    def run(self: _ClientBase, *args: Any, **kwargs: Any) -> Any:
        return self._drive(method(self, *args, **kwargs))

    return run


class _ClientBase(OperatorMethods):
    """Everything ``Client`` and ``AsyncClient`` share: each method, once."""

    http: Any  # httpx.Client or httpx.AsyncClient
    _HTTP: type[httpx.Client] | type[httpx.AsyncClient]
    _JOB: type[Job] | type[AsyncJob]

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        encoding: str = "binary",
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
        http: httpx.Client | httpx.AsyncClient | None = None,
        retries: int = 3,
        backoff: float = 0.1,
    ) -> None:
        """``encoding``: "binary" (default), "b64" or "json". ``http``: an httpx client
        to use instead of a new one (``url``, ``timeout`` and ``transport`` then unused).
        ``retries``: how many times an idempotent call (every operator and preparation,
        not registration) is sent again after a 503 (waiting its ``Retry-After``) or a
        connection error (waiting ``backoff`` seconds, doubling); 0 turns retrying off."""
        self.encoding = encoding
        self.retries = retries
        self.backoff = backoff
        #: operator calls over the client's own sockets (dxclient.transport), while it
        #: uses httpx's default transport; with proxies configured in the environment
        #: httpx applies them
        self._fast = (
            FastPath()
            if http is None and transport is None and not urllib.request.getproxies()
            else None
        )
        self.http = http or self._HTTP(
            base_url=url, timeout=timeout, transport=transport, headers=_headers(token)
        )
        if http is not None and token:
            self.http.headers.update(_headers(token))
        self._urls = _OperatorURLs()
        self._renewed: LRU[str, RemotePrep] = LRU(_RENEWED_HANDLES)

    # --- how calls travel: one implementation per class ---------------------------
    def _run(self, call: Call, url: httpx.URL | None, parse: Callable[..., T], *args: Any) -> Any:
        """Send ``call`` (to ``url``, its path resolved, if given); ``parse(*args, response)``.

        A problem document raises its ``DxError``.
        """
        raise NotImplementedError

    def _drive(self, plan: Plan[T]) -> Any:
        """Send each call ``plan`` yields; its return value."""
        raise NotImplementedError

    def _stream(self, operator: str, call: Call, progress: Any, has_aux: bool = False) -> Any:
        """Send ``call`` asking for its progress events (``dxclient.progress``); its
        result, decoded as the plain answer would be."""
        raise NotImplementedError

    # --- operators -------------------------------------------------------------
    def _operator(
        self, operator: str, f: RemoteFunction | str, backend: Backend | str, x: Any,
        tangents: Any, contexts: tuple, prep: RemotePrep | None, batch_axis: int | None = None,
        progress: Any = None, has_aux: bool = False, *, holomorphic: bool = False, wrt: Any = None,
        cotangent: Any = None,
    ) -> Any:
        model = models.model_call(x, tangents)  # an Equinox/NNX model: send its leaves
        if model is not None:
            return model.finish(operator, self._operator(
                operator, f, backend, model.x, model.tangents, contexts, prep, batch_axis,
                progress, has_aux, holomorphic=holomorphic, wrt=wrt, cotangent=cotangent), has_aux)
        if progress is not None and progress is not False:  # streamed: dxclient.progress
            call = _models.operator_call(
                operator, f, backend, x, tangents, contexts, prep, self.encoding,
                batch_axis=batch_axis, has_aux=has_aux, holomorphic=holomorphic, wrt=wrt, cotangent=cotangent,
            )
            return self._stream(operator, call, progress, has_aux)
        if prep is not None and prep.request is not None:
            def build(p: RemotePrep) -> Call:
                return _models.operator_call(
                    operator, f, backend, x, tangents, contexts, p, self.encoding,
                    batch_axis=batch_axis, has_aux=has_aux, holomorphic=holomorphic, wrt=wrt, cotangent=cotangent,
                )

            return self._run_prepared(operator, prep, build, has_aux)
        call = _models.operator_call(
            operator, f, backend, x, tangents, contexts, prep, self.encoding,
            batch_axis=batch_axis, has_aux=has_aux, holomorphic=holomorphic, wrt=wrt, cotangent=cotangent,
        )
        return self._run_operator(operator, call, has_aux)

    def _url(self, call: Call) -> httpx.URL:
        """``call``'s URL: its path (an operator's or a preparation's) resolved once."""
        return self._urls.resolve(self.http, call.path)

    def _run_operator(self, operator: str, call: Call, has_aux: bool = False) -> Any:
        return self._run(call, self._url(call), _operator_answer, operator, has_aux)

    def _run_prepared(
        self, operator: str, prep: RemotePrep, build: Callable[[RemotePrep], Call],
        has_aux: bool = False,
    ) -> Any:
        """Run ``build(prep)``; if the server no longer holds the handle (404
        ``UnknownPreparationError``), send ``prep.request`` again and retry once."""
        raise NotImplementedError

    def _prepare(
        self, operator: str, f: RemoteFunction | str, backend: Backend | str, x: Any,
        tangents: Any, contexts: tuple, batch_axis: int | None = None, has_aux: bool = False,
        *, holomorphic: bool = False, wrt: Any = None,
        cotangent: Any = None,
    ) -> Any:
        model = models.model_call(x, tangents)
        if model is not None:
            x, tangents = model.x, model.tangents
        call = _models.operator_call(
            operator, f, backend, x, tangents, contexts, None, self.encoding, prepare=True,
            batch_axis=batch_axis, has_aux=has_aux, holomorphic=holomorphic, wrt=wrt, cotangent=cotangent,
        )
        return self._run(call, self._url(call), _prep_answer, call)

    # --- detached jobs ----------------------------------------------------------
    @property
    def submit(self) -> Submitter:
        """Every operator's method, sending the call as a detached job (``POST
        /jobs/<op>``): ``job = client.submit.hessian(f, backend, x)``, then
        ``job.result()`` (see ``dxclient.jobs``); ``AsyncClient``: awaited."""
        return Submitter(self, self._JOB)

    def job(self, job_id: str) -> Any:
        """The job ``job_id`` of this client's token, reattached (``UnknownJobError``
        for none): a ``Job`` (``AsyncClient``: an awaitable of an ``AsyncJob``)."""
        return self._drive(job_plan(self, self._JOB, job_id))

    def jobs(self) -> Any:
        """The status documents of this client's token's jobs, newest first."""
        return self._drive(list_plan())

    # --- functions -------------------------------------------------------------
    @_plan
    def function(self, name: str) -> Plan[RemoteFunction]:
        """The registered function ``name`` (raises ``UnknownFunctionError``)."""
        response = yield _get(f"/functions/{name}")
        return _models.function_from(response.json())

    @_plan
    def functions(self) -> Plan[list[RemoteFunction]]:
        """Every registered function."""
        response = yield _get("/functions?details=true")
        return [_models.function_from(o) for o in response.json()["functions"]]

    @_plan
    def register(
        self,
        fn: Callable,
        *example_args: Any,
        name: str | None = None,
        description: str = "",
        replace: bool = False,
        **export_options: Any,
    ) -> Plan[RemoteFunction]:
        """Export ``fn(x, *contexts)`` with ``jax.export`` (needs jax locally) and upload it.

        ``x`` may be an Equinox or Flax NNX model: its parameters are uploaded as ``x``
        (a list of leaves) and the rest is folded in (``dxclient.models``).

        Lowered for every platform the server reports in ``GET /ready`` unless
        ``platforms=`` says otherwise; other options go to ``export_function``
        (``polymorphic_shapes``, ``constraints``).
        """
        name = name or fn.__name__
        if example_args and models.is_model(example_args[0]):
            # x is the model's parameter leaves; its static part is folded into the export
            fn, example_args = models.for_export(fn, example_args)
        platforms = export_options.pop("platforms", None)
        if not platforms:
            platforms = (yield _get("/ready")).json()["export_platforms"]
        bundle = _export(fn, example_args, platforms, **export_options)
        fields = {"export": base64.b64encode(bundle).decode("ascii")}
        call = _models.register_call(name, description, replace, fields)
        return _models.function_result((yield call).content)

    @_plan
    def register_expression(
        self,
        name: str,
        expression: str,
        args: Sequence[str] = ("x",),
        *,
        description: str = "",
        replace: bool = False,
    ) -> Plan[RemoteFunction]:
        """Register a whitelisted ``jnp`` expression; the first arg is the active input."""
        fields = {"expression": expression, "args": list(args)}
        call = _models.register_call(name, description, replace, fields)
        return _models.function_result((yield call).content)

    @_plan
    def register_kind(
        self, name: str, fields: Mapping[str, Any], *, description: str = "",
        replace: bool = False,
    ) -> Plan[RemoteFunction]:
        """Register a function of any kind the server knows, from that kind's body fields
        (``GET /openapi.json`` lists them under ``RegisterFunction``)."""
        call = _models.register_call(name, description, replace, fields)
        return _models.function_result((yield call).content)

    @_plan
    def delete(self, f: RemoteFunction | str) -> Plan[None]:
        """Remove a registered function."""
        yield Call("DELETE", f"/functions/{_models.function_name(f)}", b"", {})

    # --- service ---------------------------------------------------------------
    @_plan
    def health(self) -> Plan[dict]:
        """Liveness: ``{"status": "ok"}``."""
        return (yield _get("/health")).json()

    @_plan
    def ready(self) -> Plan[dict]:
        """Readiness, with the platforms exports should be lowered for."""
        return (yield _get("/ready")).json()

    @_plan
    def backends(self) -> Plan[list[dict]]:
        """The backends the server offers, with their parameters and operators."""
        return (yield _get("/backends")).json()["backends"]


class Client(_ClientBase):
    """Synchronous client. ``encoding``: "binary" (default), "b64" or "json"."""

    _HTTP = httpx.Client
    _JOB = Job
    http: httpx.Client

    def _run(self, call: Call, url: httpx.URL | None, parse: Callable[..., T], *args: Any) -> T:
        retries = self.retries if _idempotent(call) else 0
        attempt = 0
        while True:
            try:
                response = self._send(call, url)
            except _TRANSPORT_ERRORS as exc:
                if attempt >= retries:
                    if isinstance(exc, _CONNECT_ERRORS):
                        target = str(url) if url is not None else _full_url(self.http, call)
                        raise _unreachable(exc, target, attempt + 1) from exc
                    raise
                response = None
            delay = _retry_delay(response, attempt, self.backoff) if attempt < retries else None
            if delay is None and response is not None:
                break
            time.sleep(delay or 0.0)
            attempt += 1
        _models.raise_for_problem(response.status_code, response.headers, response.content)
        return parse(*args, response)

    def _send(self, call: Call, url: httpx.URL | None) -> Any:
        """One try of ``call``: its ``httpx.Response`` (or the fast path's ``Answer``)."""
        if url is not None and self._fast is not None:
            answer = self._fast.send(self.http, call.method, url, call.headers, _parts(call))
            if answer is not None:
                return answer
        response = self.http.request(
            call.method, call.path if url is None else url, **_send_args(call)
        )
        _unbind(response)
        return response

    def _drive(self, plan: Plan[T]) -> T:
        try:
            call = next(plan)
            while True:
                call = plan.send(self._run(call, None, _response))
        except StopIteration as done:
            return done.value

    def _stream(self, operator: str, call: Call, progress: Any, has_aux: bool = False) -> Any:
        reporter = progress_events.Reporter(progress, operator)
        headers = {**call.headers, "accept": progress_events.ACCEPT}
        try:  # leaving the block (Ctrl-C too) closes the connection: the server cancels
            with self.http.stream(call.method, call.path, content=call.body, headers=headers) as r:
                if r.status_code >= 400:
                    r.read()
                    _models.raise_for_problem(r.status_code, r.headers, r.content)
                return progress_events.read_events(
                    r.iter_lines(), reporter,
                    functools.partial(_streamed_answer, operator, has_aux),
                )
        finally:
            reporter.close()

    def _run_prepared(
        self, operator: str, prep: RemotePrep, build: Callable[[RemotePrep], Call],
        has_aux: bool = False,
    ) -> Any:
        current = self._renewed.get(prep.handle) or prep
        try:
            return self._run_operator(operator, build(current), has_aux)
        except UnknownPreparationError:
            request = prep.request
            assert request is not None
            fresh = self._run(request, self._url(request), _prep_answer, request)
            self._renewed.put(prep.handle, fresh)
            return self._run_operator(operator, build(fresh), has_aux)

    def scipy(self, f: RemoteFunction | str, backend: Backend | str = "auto", *contexts: Any) -> Any:
        """``f`` shaped for ``scipy.optimize.minimize``: a ``dxclient.scipy.ScipyProblem``
        with ``fun``, ``jac`` (one value_and_gradient request per point), ``hessp``, ``hess``."""
        from .scipy import ScipyProblem

        return ScipyProblem(self, f, backend, *contexts)

    def close(self) -> None:
        self.http.close()
        if self._fast is not None:
            self._fast.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_ClientBase):
    """Asynchronous client: the same methods as ``Client``, awaited."""

    _HTTP = httpx.AsyncClient
    _JOB = AsyncJob
    http: httpx.AsyncClient

    async def _run(
        self, call: Call, url: httpx.URL | None, parse: Callable[..., T], *args: Any
    ) -> T:
        retries = self.retries if _idempotent(call) else 0
        attempt = 0
        while True:
            try:
                response = await self._send(call, url)
            except _TRANSPORT_ERRORS as exc:
                if attempt >= retries:
                    if isinstance(exc, _CONNECT_ERRORS):
                        target = str(url) if url is not None else _full_url(self.http, call)
                        raise _unreachable(exc, target, attempt + 1) from exc
                    raise
                response = None
            delay = _retry_delay(response, attempt, self.backoff) if attempt < retries else None
            if delay is None and response is not None:
                break
            await asyncio.sleep(delay or 0.0)
            attempt += 1
        _models.raise_for_problem(response.status_code, response.headers, response.content)
        return parse(*args, response)

    async def _send(self, call: Call, url: httpx.URL | None) -> Any:
        """One try of ``call``: its ``httpx.Response`` (or the fast path's ``Answer``)."""
        if url is not None and self._fast is not None:
            answer = await self._fast.asend(self.http, call.method, url, call.headers, _parts(call))
            if answer is not None:
                return answer
        response = await self.http.request(
            call.method, call.path if url is None else url, **_send_args(call, True)
        )
        _unbind(response)
        return response

    async def _drive(self, plan: Plan[T]) -> T:
        try:
            call = next(plan)
            while True:
                call = plan.send(await self._run(call, None, _response))
        except StopIteration as done:
            return done.value

    async def _stream(
        self, operator: str, call: Call, progress: Any, has_aux: bool = False
    ) -> Any:
        reporter = progress_events.Reporter(progress, operator)
        headers = {**call.headers, "accept": progress_events.ACCEPT}
        try:  # leaving the block (cancelled too) closes the connection: the server cancels
            async with self.http.stream(
                call.method, call.path, content=call.body, headers=headers
            ) as r:
                if r.status_code >= 400:
                    await r.aread()
                    _models.raise_for_problem(r.status_code, r.headers, r.content)
                return await progress_events.aread_events(
                    r.aiter_lines(), reporter,
                    functools.partial(_streamed_answer, operator, has_aux),
                )
        finally:
            reporter.close()

    async def _run_prepared(
        self, operator: str, prep: RemotePrep, build: Callable[[RemotePrep], Call],
        has_aux: bool = False,
    ) -> Any:
        current = self._renewed.get(prep.handle) or prep
        try:
            return await self._run_operator(operator, build(current), has_aux)
        except UnknownPreparationError:
            request = prep.request
            assert request is not None
            fresh = await self._run(request, self._url(request), _prep_answer, request)
            self._renewed.put(prep.handle, fresh)
            return await self._run_operator(operator, build(fresh), has_aux)

    async def aclose(self) -> None:
        await self.http.aclose()
        if self._fast is not None:
            self._fast.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


__all__ = ["AsyncClient", "Client", "RemoteFunction", "RemotePrep", "Backend"]
