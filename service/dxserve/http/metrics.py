"""Prometheus metrics, one registry per app (so tests can run several apps)."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from dxserve.core.preparation import PrepCache
from dxserve.core.request_batching import Batcher
from dxserve.frameworks import loaded_frameworks
from dxserve.server.admission import Budget
from dxserve.server.worker import Workers


class Metrics:
    def __init__(
        self, cache: PrepCache, batcher: Batcher | None = None, workers: Workers | None = None,
        cancelled: dict[str, int] | None = None, budget: Budget | None = None,
        jobs: Callable[[], dict[str, int]] | None = None,
        streams: Callable[[], tuple[int, int, int]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        # process_* (CPU, memory, open files, start time; Linux) and python_info, on this
        # app's own registry so several apps in one process each expose them
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.requests = _RequestCollector()
        self.registry.register(self.requests)
        self.registry.register(_CacheCollector(cache))
        self.registry.register(_FrameworkCollector())
        if batcher is not None:
            self.registry.register(_BatchCollector(batcher))
        if workers is not None:
            self.registry.register(_DeviceCollector(workers))
        if cancelled is not None:
            self.registry.register(_CancelCollector(cancelled))
        if budget is not None:
            self.registry.register(_BudgetCollector(budget))
        if jobs is not None:
            self.registry.register(_JobCollector(jobs))
        if streams is not None:
            self.registry.register(_StreamCollector(streams))

    def record(self, route: str, status: int, seconds: float) -> None:
        """Count and time one answered request (errors counted by status too)."""
        self.requests.record(route, status, seconds)


class _RequestCollector:
    """``dxserve_requests``, ``dxserve_request_seconds`` and ``dxserve_errors``.

    Counted in plain dicts and read at scrape time. ``record`` runs on the event loop
    for every request; prometheus_client's ``Counter`` and ``Histogram`` take a lock per
    update and look up labelled children,, which a small request felt. Only
    the event-loop thread records, so no lock is needed; a scrape copies first.
    """

    BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60)

    def __init__(self) -> None:
        self._bounds = (*self.BUCKETS, math.inf)
        self._counts: dict[tuple[str, int], int] = {}  # (route, status) -> requests
        self._latency: dict[str, list] = {}  # route -> [count per bucket..., sum]
        self._errors: dict[int, int] = {}  # status -> problem responses

    def record(self, route: str, status: int, seconds: float) -> None:
        key = (route, status)
        self._counts[key] = self._counts.get(key, 0) + 1
        latency = self._latency.get(route)
        if latency is None:
            latency = self._latency[route] = [0] * len(self._bounds) + [0.0]
        latency[bisect.bisect_left(self._bounds, seconds)] += 1
        latency[-1] += seconds
        if status >= 400:
            self._errors[status] = self._errors.get(status, 0) + 1

    def collect(self):
        requests = CounterMetricFamily(
            "dxserve_requests", "HTTP requests answered", labels=["route", "status"]
        )
        for (route, status), n in list(self._counts.items()):
            requests.add_metric([route, str(status)], n)
        latency = HistogramMetricFamily(
            "dxserve_request_seconds", "Request latency (seconds) by route", labels=["route"]
        )
        for route, counts in list(self._latency.items()):
            cumulative = list(itertools.accumulate(counts[:-1]))
            buckets = [(floatToGoString(b), c) for b, c in zip(self._bounds, cumulative, strict=True)]
            latency.add_metric([route], buckets, sum_value=counts[-1])
        errors = CounterMetricFamily("dxserve_errors", "Problem responses by status", labels=["status"])
        for status, n in list(self._errors.items()):
            errors.add_metric([str(status)], n)
        return [requests, latency, errors]


class _CacheCollector:
    """Compile-cache counters read at scrape time from the prep cache."""

    def __init__(self, cache: PrepCache) -> None:
        self.cache = cache

    def collect(self):
        hits = CounterMetricFamily("dxserve_compile_cache_hits", "Calls served by a compiled executable")
        hits.add_metric([], self.cache.hits)
        misses = CounterMetricFamily("dxserve_compile_cache_misses", "Calls that had to trace and compile")
        misses.add_metric([], self.cache.misses)
        size = GaugeMetricFamily("dxserve_compile_cache_entries", "Compiled executables held")
        size.add_metric([], len(self.cache))
        held = GaugeMetricFamily(
            "dxserve_prep_cache_bytes",
            "Bytes the cached preps keep alive (executables, sparsity patterns), estimated",
        )
        held.add_metric([], self.cache.nbytes)
        return [hits, misses, size, held]


class _FrameworkCollector:
    """``dxserve_background_compiles_total{framework, outcome}``: hot executables a
    framework compiled in the background (torch's), read at scrape time."""

    def collect(self):
        family = CounterMetricFamily(
            "dxserve_background_compiles",
            "Hot executables compiled in the background: served compiled, or kept eager",
            labels=["framework", "outcome"],
        )
        for framework in loaded_frameworks():
            outcomes = getattr(framework, "background_compiles", None)
            for outcome, n in (outcomes() if outcomes is not None else {}).items():
                family.add_metric([framework.name, outcome], n)
        return [family]


class _BatchCollector:
    """Request-batching counters read at scrape time from the batcher."""

    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher

    def collect(self):
        batches = CounterMetricFamily(
            "dxserve_batches", "Merged calls answered from one vmapped executable"
        )
        batches.add_metric([], self.batcher.batches)
        requests = CounterMetricFamily(
            "dxserve_batched_requests", "Requests answered from a merged call"
        )
        requests.add_metric([], self.batcher.batched_requests)
        refused = CounterMetricFamily(
            "dxserve_batching_refused",
            "Batched executables dropped because they did not reproduce unbatched bits",
        )
        refused.add_metric([], self.batcher.refused)
        compiles = CounterMetricFamily(
            "dxserve_batch_compiles", "Batched executables compiled (one per bucket and key)"
        )
        compiles.add_metric([], self.batcher.compiles)
        return [batches, requests, refused, compiles]


class _DeviceCollector:
    """Per-device work counters read at scrape time from the device workers."""

    def __init__(self, workers: Workers) -> None:
        self.workers = workers

    def collect(self):
        jobs = CounterMetricFamily(
            "dxserve_device_jobs", "Requests run on each device's worker thread", labels=["device"]
        )
        queued = GaugeMetricFamily(
            "dxserve_device_pending", "Requests queued or running per device", labels=["device"]
        )
        for worker in self.workers.workers:
            jobs.add_metric([str(worker.device)], worker.jobs)
            queued.add_metric([str(worker.device)], worker.pending)
        return [jobs, queued]


class _CancelCollector:
    """``dxserve_cancelled_total{operator}``: computations stopped early (client gone,
    or past the deadline) at a chunk boundary or before they started; read from
    ``Service.cancelled`` at scrape time."""

    def __init__(self, cancelled: dict[str, int]) -> None:
        self.cancelled = cancelled

    def collect(self):
        family = CounterMetricFamily(
            "dxserve_cancelled", "Computations cancelled before they finished",
            labels=["operator"],
        )
        for operator, n in list(self.cancelled.items()):
            family.add_metric([operator], n)
        return [family]


class _BudgetCollector:
    """The in-flight budget (``admission.Budget``), read at scrape time."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget

    def collect(self):
        budget = self.budget
        held = GaugeMetricFamily(
            "dxserve_inflight_bytes", "Bytes held by requests in flight (bodies, results until written)"
        )
        held.add_metric([], budget.used)
        limit = GaugeMetricFamily("dxserve_inflight_limit_bytes", "DXSERVE_MAX_INFLIGHT_BYTES")
        limit.add_metric([], budget.limit)
        peak = GaugeMetricFamily("dxserve_inflight_peak_bytes", "Most bytes held at once")
        peak.add_metric([], budget.peak)
        large = GaugeMetricFamily("dxserve_large_results", "Large results being computed")
        large.add_metric([], budget.large)
        refused = CounterMetricFamily(
            "dxserve_inflight_refused", "Requests refused (503) because the budget was full"
        )
        refused.add_metric([], budget.refused)
        sending = GaugeMetricFamily(
            "dxserve_answers_sending",
            "Answers being written now (the metrics answer itself among them)",
        )
        sending.add_metric([], budget.sending)
        return [held, limit, peak, large, refused, sending]


class _JobCollector:
    """``dxserve_jobs{status}``: detached jobs in the store by status (every process
    sharing the store reports the same counts), read at scrape time."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self.counts = counts

    def collect(self):
        family = GaugeMetricFamily(
            "dxserve_jobs", "Detached jobs in the store, by status", labels=["status"]
        )
        try:
            counts = self.counts()
        except Exception:  # noqa: BLE001 - the store unreachable: a scrape without them
            return []
        for status, n in counts.items():
            family.add_metric([status], n)
        return [family]


class _StreamCollector:
    """Job event streams open in this process, the jobs they follow, and the store
    reads their shared watches made (one per followed job per poll interval)."""

    def __init__(self, counts: Callable[[], tuple[int, int, int]]) -> None:
        self.counts = counts

    def collect(self):
        streams, watched, reads = self.counts()
        open_ = GaugeMetricFamily("dxserve_job_streams", "Job event streams open now")
        open_.add_metric([], streams)
        jobs = GaugeMetricFamily("dxserve_job_streams_jobs", "Jobs those streams follow")
        jobs.add_metric([], watched)
        done = CounterMetricFamily(
            "dxserve_job_stream_reads", "Store reads made for job streams (shared per job)"
        )
        done.add_metric([], reads)
        return [open_, jobs, done]
