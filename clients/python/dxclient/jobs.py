"""Detached jobs: long derivatives that outlive the connection, the client and a restart.

    job = client.submit.hessian("heavy", "jax-forward", x)    # POST /jobs/hessian: 202
    job.id, job.status()["status"]                           # "queued", "running", ...
    H = job.result(timeout=None, progress=True)              # waits, then the Hessian
    job = client.job(job.id)                                 # from another process
    job.cancel()                                             # DELETE /jobs/{id}

``result`` follows the job's event stream (``GET /jobs/{id}/events``): progress
reported as ``progress=`` says (True: a tqdm bar when tqdm is installed; a callable:
``progress(done, total)``; False: none), then the result, decoded as the operator's own
answer (typed base64: the same bits). A stream that breaks (the server restarted, the
network dropped) is followed again until the job ends or ``timeout`` seconds have
passed (``TimeoutError``). A failed job raises its error, a cancelled one
``JobCancelledError``. ``AsyncClient`` has the same, awaited (``AsyncJob``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx

from dxcontract import codec
from dxcontract.backends import Backend
from dxcontract.errors import DxError

from . import _models, models
from . import progress as progress_events
from ._models import Call, PartsCall, RemoteFunction
from ._operators import SubmitMethods

#: Errors after which the event stream is followed again: the connection broke.
_BROKEN = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError, httpx.ReadTimeout,
           httpx.RemoteProtocolError, httpx.WriteError)
#: Seconds between attempts to follow a broken stream again (doubling up to the last).
_RETRY_DELAYS = (0.1, 0.2, 0.5, 1.0, 2.0)


def job_call(operator: str, call: Call) -> Call:
    """The operator ``call`` sent as a job: the same body and headers, to ``/jobs/<op>``."""
    path = f"/jobs/{operator}"
    if isinstance(call, PartsCall):
        return PartsCall(call.method, path, call.parts, call.headers)
    return Call(call.method, path, call.body, call.headers)


def _reporter(progress: Any, operator: str) -> progress_events.Reporter | None:
    """A progress reporter; ``progress=True`` without tqdm installed reports nothing."""
    if progress is None or progress is False:
        return None
    try:
        return progress_events.Reporter(progress, operator)
    except ImportError:
        if progress is True:
            return None
        raise


class _Quiet:
    """A reporter that reports nothing (``progress=False``)."""

    def update(self, done: int, total: int, unit: str) -> None:
        pass

    def close(self) -> None:
        pass


class _JobBase:
    """What ``Job`` and ``AsyncJob`` share: the job's id and operator, its calls."""

    def __init__(
        self, client: Any, job_id: str, operator: str, model: Any = None, has_aux: bool = False
    ) -> None:
        self.client = client
        self.id = job_id
        self.operator = operator
        #: submitted with ``has_aux``: the result has the function's aux, as JAX gives it
        self.has_aux = has_aux
        self._model = model  # an Equinox/NNX model's call: results rebuilt as the model

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, operator={self.operator!r})"

    def _decode(self, data: bytes) -> Any:
        result = _models.operator_result(
            self.operator, {"content-type": codec.JSON_TYPE}, data, self.has_aux
        )
        return self._model.finish(self.operator, result) if self._model is not None else result

    def _events_headers(self) -> dict[str, str]:
        return {"accept": progress_events.ACCEPT}


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _left(deadline: float | None, job_id: str) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError(f"job {job_id} has not ended in time; job.result() again waits more")


class Job(_JobBase):
    """A detached job on a ``Client``'s server (see the module)."""

    def status(self) -> dict[str, Any]:
        """The job's status document: ``status``, ``progress``, ``timings``, ``error``."""
        return self.client._drive(_status_plan(self.id))

    def cancel(self) -> dict[str, Any] | None:
        """``DELETE /jobs/{id}``: cancel the job if it is queued or running (its status
        document back); once it has ended, remove it and its result (None)."""
        return self.client._drive(_cancel_plan(self.id))

    def result(self, timeout: float | None = None, progress: Any = True) -> Any:
        """Wait for the job and return its result, as the operator's call would."""
        deadline = _deadline(timeout)
        reporter = _reporter(progress, self.operator) or _Quiet()
        try:
            attempt = 0
            while True:
                _left(deadline, self.id)
                try:
                    return self._follow(reporter, deadline)
                except _BROKEN:
                    pass
                except DxError as exc:
                    if getattr(exc, "status", None) != 502:  # ended without a result
                        raise
                time.sleep(_RETRY_DELAYS[min(attempt, len(_RETRY_DELAYS) - 1)])
                attempt += 1
        finally:
            reporter.close()

    def _follow(self, reporter: Any, deadline: float | None) -> Any:
        http = self.client.http
        with http.stream("GET", f"/jobs/{self.id}/events", headers=self._events_headers()) as r:
            if r.status_code >= 400:
                r.read()
                _models.raise_for_problem(r.status_code, r.headers, r.content)

            def lines() -> Any:
                for line in r.iter_lines():
                    _left(deadline, self.id)
                    yield line

            return progress_events.read_events(lines(), reporter, self._decode)


class AsyncJob(_JobBase):
    """A detached job on an ``AsyncClient``'s server: ``Job``'s methods, awaited."""

    async def status(self) -> dict[str, Any]:
        """The job's status document: ``status``, ``progress``, ``timings``, ``error``."""
        return await self.client._drive(_status_plan(self.id))

    async def cancel(self) -> dict[str, Any] | None:
        """Cancel the job if queued or running; remove it once ended (None)."""
        return await self.client._drive(_cancel_plan(self.id))

    async def result(self, timeout: float | None = None, progress: Any = True) -> Any:
        """Wait for the job and return its result, as the operator's call would."""
        deadline = _deadline(timeout)
        reporter = _reporter(progress, self.operator) or _Quiet()
        try:
            attempt = 0
            while True:
                _left(deadline, self.id)
                try:
                    return await self._follow(reporter, deadline)
                except _BROKEN:
                    pass
                except DxError as exc:
                    if getattr(exc, "status", None) != 502:
                        raise
                await asyncio.sleep(_RETRY_DELAYS[min(attempt, len(_RETRY_DELAYS) - 1)])
                attempt += 1
        finally:
            reporter.close()

    async def _follow(self, reporter: Any, deadline: float | None) -> Any:
        http = self.client.http
        async with http.stream(
            "GET", f"/jobs/{self.id}/events", headers=self._events_headers()
        ) as r:
            if r.status_code >= 400:
                await r.aread()
                _models.raise_for_problem(r.status_code, r.headers, r.content)

            async def lines() -> Any:
                async for line in r.aiter_lines():
                    _left(deadline, self.id)
                    yield line

            return await progress_events.aread_events(lines(), reporter, self._decode)


def _status_plan(job_id: str) -> Any:
    response = yield Call("GET", f"/jobs/{job_id}", b"", {})
    return response.json()


def _cancel_plan(job_id: str) -> Any:
    response = yield Call("DELETE", f"/jobs/{job_id}", b"", {})
    return None if response.status_code == 204 else response.json()


def _job_plan(client: Any, cls: type[_JobBase], job_id: str) -> Any:
    doc = (yield Call("GET", f"/jobs/{job_id}", b"", {})).json()
    return cls(client, job_id, doc["operator"], has_aux=bool(doc.get("has_aux")))


def _list_plan(limit: int) -> Any:
    found: list[dict] = []
    after = None
    while True:
        query = f"?limit={limit}" + (f"&after={after}" if after else "")
        page = (yield Call("GET", f"/jobs{query}", b"", {})).json()
        found.extend(page["jobs"])
        after = page.get("next")
        if not after:
            return found


class Submitter(SubmitMethods):
    """``client.submit``: every operator's method, sending the call as a detached job."""

    def __init__(self, client: Any, job_class: type[_JobBase]) -> None:
        self._client = client
        self._job_class = job_class

    def _submit(
        self, operator: str, f: RemoteFunction | str, backend: Backend | str, x: Any,
        tangents: Any, contexts: tuple, batch_axis: int | None = None, has_aux: bool = False,
        *, holomorphic: bool = False, wrt: Any = None,
        cotangent: Any = None,
    ) -> Any:
        client = self._client
        model = models.model_call(x, tangents)  # an Equinox/NNX model: send its leaves
        if model is not None:
            x, tangents = model.x, model.tangents
        call = job_call(operator, _models.operator_call(
            operator, f, backend, x, tangents, contexts, None, client.encoding,
            batch_axis=batch_axis, has_aux=has_aux, holomorphic=holomorphic, wrt=wrt, cotangent=cotangent,
        ))
        make: Callable[[Any], _JobBase] = lambda response: self._job_class(  # noqa: E731
            client, response.json()["id"], operator, model, has_aux
        )
        return client._run(call, None, make)


def job_plan(client: Any, cls: type[_JobBase], job_id: str) -> Any:
    """The plan of ``client.job(id)``: the job's operator read from its status."""
    return _job_plan(client, cls, job_id)


def list_plan(limit: int = 100) -> Any:
    """The plan of ``client.jobs()``: every page of the caller's jobs."""
    return _list_plan(limit)


__all__ = ["AsyncJob", "Job", "Submitter"]
