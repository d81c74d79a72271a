"""Shared fixtures: the REAL server in a subprocess (``dxserve serve``).

``server`` (session scope) runs ``python -m dxserve.cli serve`` on a free port with a
temporary store and ``FUNCTION_MODULES`` registered; ``make_server`` (function scope)
starts extra servers with their own environment / flags (a token, a small body limit)
and stops them when the test ends. Servers are stopped by PID: SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
#: Modules whose ``@dxserve.function``s the test servers register.
FUNCTION_MODULES: tuple[str, ...] = ("dxserve.examples", "tests.scenarios")
#: Bounds on waits that end on an event (a server answering /health, a process exiting):
#: only a broken server reaches them, so they are generous enough for a loaded machine
#: (two ``make test`` runs side by side on two cores start a server in well over 60 s).
STARTUP_TIMEOUT = 300.0
STOP_TIMEOUT = 10.0
#: The default of every test client, httpx's and dxclient's, that does not choose its
#: own: as long as the server's own deadline (``Settings.request_timeout``), not httpx's
#: 5 s or dxclient's 120 s, which a loaded machine passes on a slow but healthy answer.
#: Set through the functions' keyword defaults, so ``httpx.get(url)``, ``httpx.Client()``
#: and ``dxclient.Client(url)`` take it alike; tests give no shorter timeout of their own
#: (except those about timeouts, and the liveness probes below).
REQUEST_DEADLINE = 300.0
HTTP_TIMEOUT = httpx.Timeout(REQUEST_DEADLINE)


def _test_http_timeout() -> None:
    import dxclient

    for fn in (httpx.request, httpx.stream, httpx.get, httpx.post, httpx.put, httpx.patch,
               httpx.delete, httpx.head, httpx.options, httpx.Client.__init__,
               httpx.AsyncClient.__init__):
        fn = getattr(fn, "__wrapped__", fn)  # httpx.stream is a context manager's
        if fn.__kwdefaults__ and "timeout" in fn.__kwdefaults__:
            fn.__kwdefaults__["timeout"] = HTTP_TIMEOUT
    for cls in (dxclient.Client, dxclient.AsyncClient):
        defaults = cls.__init__.__kwdefaults__
        if defaults and "timeout" in defaults:
            defaults["timeout"] = REQUEST_DEADLINE


_test_http_timeout()

#: The timeout of a ``/health`` probe that checks a server stays live under an attack: it
#: fails when the server stops answering, not when a loaded machine answers slowly.
LIVENESS_TIMEOUT = 30.0


@dataclass
class ServerProcess:
    url: str
    port: int
    store: Path
    proc: subprocess.Popen
    log: Path

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except OSError:
            return ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HandlerInThread:
    """A ``http.server`` handler class served by a ``ThreadingHTTPServer`` in a thread of
    this process on 127.0.0.1 (a free port): ``url``, and ``close()`` to stop it."""

    def __init__(self, handler: type) -> None:
        from http.server import ThreadingHTTPServer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@contextlib.contextmanager
def uvicorn_in_thread(app: Callable, **options: object) -> Iterator[str]:
    """``app`` served by uvicorn in a thread of this process on 127.0.0.1 (a free port),
    with uvicorn ``options`` (e.g. ``http=`` a protocol class); yields its URL, stops it."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


#: Tries at a free port: another process (a second ``make test`` beside this one) may take
#: the port ``free_port`` found before the server listens on it.
PORT_TRIES = 5


def start_server(
    workdir: Path,
    *,
    env: Mapping[str, str] | None = None,
    args: Sequence[str] = (),
    modules: Sequence[str] = FUNCTION_MODULES,
    timeout: float = STARTUP_TIMEOUT,
) -> ServerProcess:
    """Start ``dxserve serve`` and wait (bounded) until ``/health`` answers; on a port
    taken meanwhile (the server says so and exits), again on another."""
    for _ in range(PORT_TRIES - 1):
        try:
            return _start_server(workdir, env=env, args=args, modules=modules, timeout=timeout)
        except PortTaken:
            continue
    return _start_server(workdir, env=env, args=args, modules=modules, timeout=timeout)


class PortTaken(RuntimeError):
    """The server exited at once: its port was taken after ``free_port`` found it."""


def _start_server(
    workdir: Path,
    *,
    env: Mapping[str, str] | None,
    args: Sequence[str],
    modules: Sequence[str],
    timeout: float,
) -> ServerProcess:
    workdir.mkdir(parents=True, exist_ok=True)
    store = workdir / "store"
    log = workdir / "server.log"
    port = free_port()
    cmd = [
        sys.executable, "-m", "dxserve.cli", "serve",
        "--host", "127.0.0.1", "--port", str(port),
        "--store", str(store), "--compilation-cache", "",
        "--functions", ",".join(modules),
        *args,
    ]  # fmt: skip
    child_env = {
        k: v for k, v in os.environ.items() if not (k.startswith("DXSERVE_") or k in ("HOST", "PORT"))
    }
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )
    child_env.update(env or {})
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env, stdout=out, stderr=subprocess.STDOUT)
    server = ServerProcess(f"http://127.0.0.1:{port}", port, store, proc, log)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            if f"port {port} on 127.0.0.1 is already in use" in server.output():
                raise PortTaken(server.output())
            raise RuntimeError(f"dxserve exited with {proc.returncode}:\n{server.output()}")
        try:
            # answered, and by this process (not by another's server on a port taken meanwhile)
            answer = httpx.get(server.url + "/health", timeout=LIVENESS_TIMEOUT)
            if answer.status_code == 200 and proc.poll() is None:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(f"dxserve not healthy after {timeout:g} s:\n{server.output()}")
        time.sleep(0.1)


def stop_server(server: ServerProcess) -> None:
    """SIGTERM the server's PID, then SIGKILL it if it has not exited in time."""
    proc = server.proc
    if proc.poll() is not None:
        return
    try:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_TIMEOUT)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One real server for the whole session (examples + test scenarios registered)."""
    srv = start_server(tmp_path_factory.mktemp("dxserve"))
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture
def make_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProcess]]:
    """Factory for extra servers with custom ``env`` / ``args``; all stopped at test end."""
    started: list[ServerProcess] = []

    def make(
        *,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
        modules: Sequence[str] = ("dxserve.examples",),
    ) -> ServerProcess:
        srv = start_server(tmp_path_factory.mktemp("dxserve-extra"), env=env, args=args, modules=modules)
        started.append(srv)
        return srv

    try:
        yield make
    finally:
        for srv in started:
            stop_server(srv)


def memory_of(pid: int) -> dict[str, int]:
    """``{"VmRSS": ..., "VmHWM": ...}``: a process's resident and peak resident memory,
    in bytes, from ``/proc/<pid>/status``."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


#: Long tests that `make test-slow` runs (CI runs it) and `make test` leaves out, so that
#: `make test` stays within ten minutes on two cores. Each promise keeps a quicker check in
#: `make test`: one protocol, encoding or key kind of a grid, the shorter attacks of a
#: family. Node ids, or the start of one (every parameter of a test).
LONG_TESTS = (
    # the long attacks: their shorter siblings stay
    "tests/http/test_send_path.py::test_unread_job_answers_stay_in_the_budget[h11-",
    "tests/http/test_send_path.py::test_unread_job_answers_stay_in_the_budget[httptools-events]",
    "tests/http/test_unbounded_loops.py::test_sigterm_stops_the_server_with_a_spin_in_flight",
    "tests/http/test_hostile_inputs.py::test_16_concurrent_long_registrations_no_5xx",
    "tests/http/test_jobs_limits.py::test_owners_take_turns_so_a_long_queue_does_not_hold_back",
    "tests/http/test_jobs_limits.py::test_a_job_computes_the_function_version_it_was_submitted",
    "tests/http/test_jobs_limits.py::test_the_jobs_stored_bytes_stay_under_the_limit",
    "tests/http/test_jobs_limits.py::test_without_tokens_every_bearer_token_is_the_anonymous",
    "tests/http/test_jobs_http.py::test_events_are_a_streamed_operators_and_closing_them_cancels",
    "tests/http/test_jobs_http.py::test_quotas_429_and_507_and_nothing_acknowledged_is_lost",
    "tests/service/test_compile_off_worker.py::test_slow_compile_never_holds_the_device_worker",
    "tests/service/test_memory_bounds.py::test_memory_is_given_back_after_a_large_dense_hessian",
    "tests/service/test_memory_bounds.py::test_dense_preps_and_prepare_handles_evict_by_bytes",
    "tests/service/test_budgets.py::test_memory_bounded_under_concurrent_large_bodies_and_hessians",
    "tests/service/test_detection_lane.py::test_a_caller_past_its_detection_cap_gets_429",
    "tests/service/test_batching.py::test_concurrent_clients_get_unbatched_bits[json]",
    "tests/service/test_batch_points.py::test_in_process_other_operators",
    # grids: one encoding, kind or backend of each stays
    "tests/client/test_keys_client.py::test_value_and_gradient_with_a_key_equal_the_library_bit_for_bit[json-r",
    "tests/client/test_keys_client.py::test_value_and_gradient_with_a_key_equal_the_library_bit_for_bit[json-u",
    "tests/client/test_keys_client.py::test_value_and_gradient_with_a_key_equal_the_library_bit_for_bit[b64-",
    "tests/client/test_keys_client.py::test_arrays_and_pytrees_of_keys[json-",
    "tests/client/test_keys_client.py::test_arrays_and_pytrees_of_keys[b64-",
    "tests/client/test_keys_client.py::test_keys_come_back_as_keys[json-",
    "tests/client/test_keys_client.py::test_keys_come_back_as_keys[b64-",
    "tests/client/test_keys_client.py::test_the_next_key_as_aux[json-",
    "tests/client/test_keys_client.py::test_the_next_key_as_aux[b64-",
    "tests/library/test_nesting.py::test_under_jit_vmap_and_derivatives[gradient-jax-forward]",
    "tests/library/test_nesting.py::test_under_jit_vmap_and_derivatives[jacobian-jax-reverse]",
    "tests/library/test_nesting.py::test_under_jit_vmap_and_derivatives[pushforward-jax-reverse]",
    "tests/library/test_nesting.py::test_under_jit_vmap_and_derivatives[pullback-jax-forward]",
    "tests/library/test_nesting.py::test_under_jit_vmap_and_derivatives[hvp-rev-over-fwd]",
    "tests/library/test_nesting.py::test_under_jit_vmap_and_derivatives[hvp-fwd-over-fwd]",
    "tests/library/test_nesting.py::test_under_jit_vmap_and_derivatives[hessian-fwd-over-rev]",
    "tests/library/test_nesting.py::test_under_jit_vmap_and_derivatives[hessian-fwd-over-fwd]",
    "tests/library/test_pytrees.py::test_scalar_scenarios_in_process[pt_mlp_loss]",
    "tests/library/test_pytrees.py::test_scalar_scenarios_in_process[pt_nested_scalar]",
    "tests/library/test_pytrees.py::test_scalar_scenarios_in_process[pt_list_scalar]",
    "tests/library/test_dtype_grid.py::test_dtype_grid_in_process",
    "tests/library/test_models.py::test_equinox_nn_mlp",
    "tests/library/test_models.py::test_flax_nnx_gradient_and_training",
    "tests/client/test_aux_training.py::test_jax_shapes_of_other_operators",
    "tests/client/test_wrt_bridge.py::test_second_order_of_an_array_valued_served_function",
    "tests/client/test_wrt_bridge.py::test_second_order_of_an_array_valued_function_in_its_contexts[(0, 1)]",
    "tests/http/test_fast_paths.py::test_every_dtype_and_layout_round_trips_identically[json]",
    "tests/http/test_keys_http.py::test_a_key_written_by_hand[rbg]",
    "tests/http/test_keys_http.py::test_a_key_written_by_hand[unsafe_rbg]",
    "tests/http/test_low_precision_wire.py::test_the_client_gets_the_librarys_bits_in_x_dtype[bfloat16-b",
    "tests/http/test_low_precision_wire.py::test_the_client_gets_the_librarys_bits_in_x_dtype[bfloat16-json]",
    "tests/http/test_low_precision_wire.py::test_the_client_gets_the_librarys_bits_in_x_dtype[float16-b",
    "tests/client/test_backend_names.py::test_a_server_side_plug_in_by_name[backend",
    "tests/library/test_custom_nodes.py::test_every_operator_keeps_the_node_in_process[jax-",
    "tests/client/test_aux_training.py::test_sync_client_training_loop[json]",
    "tests/client/test_aux_training.py::test_sync_client_training_loop[b64]",
    "tests/client/test_aux_training.py::test_async_client_training_loop[json]",
    "tests/client/test_forward_only_upload.py::test_forward_operators_match_the_analytic_deriv",
    "tests/http/test_auto_fallback_http.py::test_auto_answers_every_operator_by_forward_mode",
    "tests/http/test_registry_http.py::test_uploaded_export_matches_in_process[up_vector_map]",
    "tests/http/test_http_protocols.py::test_both_protocols_answer_alike[gradient b64]",
    "tests/http/test_http_protocols.py::test_both_protocols_answer_alike[gradient json]",
    "tests/http/test_http_protocols.py::test_both_protocols_answer_alike[value_and_gradient b64]",
    "tests/http/test_http_protocols.py::test_both_protocols_answer_alike[hvp json]",
    "tests/http/test_http_protocols.py::test_both_protocols_answer_alike[binary, 80 KB]",
    "tests/client/test_client_survives.py::test_async_client_prepares_again",
    "tests/client/test_upload_parity.py::test_complex_x",
    "tests/http/test_answer_buffers.py::test_kept_results_are_never_written_over_sync",
    "tests/http/test_registry_http.py::test_uploaded_export_matches_in_process[up_pytree_loss]",
    # the suite's own lists (collecting their files imports most of the package)
    "tests/project/test_suite_lists.py::",
)

#: Grids of many quick cases: `make test` runs every other case (of those not already
#: slow), `make test-slow` the rest.
HALF_GRIDS = (
    "tests/library/test_conformance.py::test_operator",
    "tests/http/test_http_conformance.py::test_served_equals_library_to_the_bit",
    "tests/library/test_complex.py::test_against_jax",
    "tests/library/test_exported.py::test_transformation_matches_original",
)

#: The files that take longest, run first: with each file on one process, a long file
#: dealt out last would keep one process busy while the others wait.
LONGEST_FILES_FIRST = (
    "tests/http/test_http_conformance.py",
    "tests/library/test_conformance.py",
    "tests/http/test_jobs_http.py",
    "tests/http/test_hostile_inputs.py",
    "tests/client/test_wrt_bridge.py",
    "tests/http/test_http_protocols.py",
    "tests/http/test_jobs_limits.py",
    "tests/client/test_keys_client.py",
    "tests/library/test_complex.py",
    "tests/project/test_docs_blocks.py",
    "tests/library/test_exported.py",
    "tests/library/test_nesting.py",
    "tests/client/test_jax_bridge.py",
    "tests/http/test_aux_http.py",
    "tests/http/test_registry_http.py",
    "tests/library/test_wrt.py",
    "tests/library/test_pytrees.py",
    "tests/service/test_sparse_bounds.py",
    "tests/library/test_sparse.py",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``LONG_TESTS`` and every other case of ``HALF_GRIDS`` are marked ``slow`` before
    ``-m`` selects; ``LONGEST_FILES_FIRST`` go first (a stable sort: the order within a
    file is kept)."""
    seen: dict[str, int] = {}
    for item in items:
        if item.nodeid.startswith(LONG_TESTS):
            item.add_marker(pytest.mark.slow)
        grid = item.nodeid.split("[")[0]
        if grid in HALF_GRIDS and item.get_closest_marker("slow") is None:
            seen[grid] = seen.get(grid, 0) + 1
            if seen[grid] % 2 == 0:
                item.add_marker(pytest.mark.slow)
    first = {name: rank for rank, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))
