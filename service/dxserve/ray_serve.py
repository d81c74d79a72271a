"""dxserve on Ray Serve (the ``ray`` extra: ``pip install -e '.[ray]'`` at the repository
root): one deployment whose replicas each run the transport-agnostic ``Service`` behind
the same FastAPI app as ``dxserve serve`` (``http.create_app``), so every route,
encoding and error is identical.

Three ways to run it::

    serve run deploy/ray-serve.yaml                      # config file (replicas, GPUs, ...)
    dxserve ray --replicas 2 --store postgresql://...    # the CLI (blocks until Ctrl-C)
    handle = dxserve.ray_serve.start(replicas=2)         # from Python, returns a handle
    await handle.call.remote("gradient", "sq", "auto", [1.0, 2.0])

Replicas share the registry through the store (``DXSERVE_STORE``: an SQLite path when
every replica runs on one machine, ``postgresql://`` across nodes), so a function
registered through any replica is served by all. Settings reach the replicas as
``DXSERVE_*`` variables in the deployment's ``runtime_env`` (``settings_env``) or as
the ``settings`` argument, so a replica on another node sees the same configuration.

Batching: each replica keeps dxserve's own request batcher (``request_batching``),
which merges concurrent calls of one function, operator and signature into one
vmapped executable, and does not use ``@serve.batch``. ``@serve.batch`` batches calls to
one Python method regardless of what they compute, so a replica would have to regroup
each batch by (function, operator, backend, signature) itself, which is exactly what
dxserve's batcher does already, after decoding and on the same event loop; adding
``@serve.batch`` in front only adds its wait (``batch_wait_timeout_s``) to every call,
and covers only the handle path (HTTP requests reach the replica through the ingress
app, not through a batched method). Measured (``bench/ray_batching.py``, one replica, 32
handle calls in flight, 2-core VM): dxserve's batcher 504 calls/s, ``@serve.batch``
(2 ms wait) 499, neither 458: Ray's per-call cost, not the replica's compute, bounds a
replica there, so the simpler path that also serves HTTP is kept.
"""

from __future__ import annotations

import os
from typing import Any

from dxserve.settings import Settings

__all__ = ["build", "build_app", "start"]

#: Ray's name for the application and the deployment.
APP_NAME = "dxserve"
DEPLOYMENT_NAME = "dxserve"


def _serve() -> Any:
    try:
        from ray import serve
    except ImportError as exc:  # pragma: no cover - the extra is missing
        from dxcontract.extras import SERVER, install_hint

        raise RuntimeError(f"dxserve on Ray needs Ray Serve: {install_hint('ray', SERVER)}") from exc
    return serve


def _deployment_class() -> Any:
    serve = _serve()

    @serve.ingress()
    class DxserveDeployment:
        """One replica: a ``Service`` and its HTTP app (``__serve_build_asgi_app__``),
        plus methods for ``DeploymentHandle`` callers (no HTTP on that path)."""

        def __init__(self, settings: dict[str, Any] | None = None) -> None:
            from dxserve.server.runtime import bootstrap
            from dxserve.server.service import Service

            self.settings = Settings(**(settings or {}))
            bootstrap(self.settings)
            self.service = Service(self.settings)

        def __serve_build_asgi_app__(self) -> Any:
            from dxserve.http import create_app

            return create_app(self.settings, service=self.service)

        # --- the DeploymentHandle entry points -------------------------------------
        async def call(self, operator: str, function: str, backend: Any, x: Any,
                       tangents: Any = None, contexts: Any = (), *, token: str | None = None,
                       **options: Any) -> dict:
            """``Service.call`` through the request layer, as an HTTP request goes
            (validation, budgets, progress and cancellation): ``{result name: array}``.
            ``options``: the request's other fields (``prep``, ``batch_axis``)."""
            from dxcontract.codec import JSON_TYPE
            from dxcontract.errors import InvalidArgumentError
            from dxcontract.operators import OPERATORS
            from dxserve.core.progress import Job
            from dxserve.pipeline import OperatorCall, RequestHead

            op = OPERATORS.get(operator)
            if op is None:
                raise InvalidArgumentError(
                    f"no operator {operator!r}; operators: {', '.join(OPERATORS)}",
                    field="operator",
                )
            message = {"function": function, "backend": backend, "x": x,
                       "contexts": list(contexts), **options}
            if tangents is not None:
                message["tangents"] = list(tangents)
            call = OperatorCall(self.service, op, RequestHead(JSON_TYPE, token=token))
            with call.ticket:
                return await call.run(call.parse(message), Job())

        async def register(self, body: dict) -> tuple[dict, bool]:
            """``POST /functions``'s body; ``(description, created)``."""
            return await self.service.register(body)

        async def delete(self, name: str) -> str:
            return await self.service.delete(name)

        def functions(self) -> list[dict]:
            return self.service.functions()

        def knows(self, name: str) -> tuple[int, bool]:
            """``(this replica's pid, whether it serves function name)``."""
            from dxcontract.errors import UnknownFunctionError

            try:
                self.service.function(name)
            except UnknownFunctionError:
                return os.getpid(), False
            return os.getpid(), True

    return DxserveDeployment


def __getattr__(name: str) -> Any:
    if name == "DxserveDeployment":  # built on first use, so importing needs no Ray
        return _deployment_class()
    raise AttributeError(name)


def build(
    *,
    replicas: int = 1,
    num_gpus: float = 0,
    num_cpus: float | None = None,
    autoscaling: dict[str, Any] | None = None,
    settings: dict[str, Any] | None = None,
    settings_env: dict[str, str] | None = None,
    max_ongoing_requests: int = 256,
) -> Any:
    """The bound Ray Serve application: ``replicas`` replicas (or ``autoscaling``, Ray's
    ``autoscaling_config``, passed through), each with ``num_gpus`` GPUs.

    ``settings``: ``Settings`` fields for every replica; ``settings_env``: ``DXSERVE_*``
    variables set in every replica's environment (``runtime_env``).
    """
    serve = _serve()
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": {"num_gpus": num_gpus,
                              **({"num_cpus": num_cpus} if num_cpus is not None else {})},
        "max_ongoing_requests": max_ongoing_requests,
        # a replica that stops answering is replaced
        "health_check_period_s": 2,
        "health_check_timeout_s": 30,
    }
    if settings_env:
        options["ray_actor_options"]["runtime_env"] = {"env_vars": dict(settings_env)}
    if autoscaling:
        options["autoscaling_config"] = dict(autoscaling)
    else:
        options["num_replicas"] = replicas
    deployment = serve.deployment(_deployment_class()).options(**options)
    return deployment.bind(settings or {})


def build_app(args: dict[str, Any]) -> Any:
    """The application builder of ``deploy/ray-serve.yaml`` (``import_path:
    dxserve.ray_serve:build_app``): ``args`` are ``build``'s keywords."""
    return build(**(args or {}))


def start(
    *, host: str = "127.0.0.1", port: int = 8000, route_prefix: str = "/", **kwargs: Any
) -> Any:
    """Start Ray Serve (and a local Ray, if none is running) with dxserve on
    ``http://host:port``; returns the ``DeploymentHandle``."""
    import ray

    serve = _serve()
    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    # the replicas decide who may register from the address clients reach them on
    kwargs["settings"] = {"host": host, **(kwargs.get("settings") or {})}
    return serve.run(build(**kwargs), name=APP_NAME, route_prefix=route_prefix)
