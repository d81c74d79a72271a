"""Prometheus metrics, one registry per app (so tests can run several apps)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..batching import Batcher
from ..preparation import PrepCache
from ..worker import Workers


class Metrics:
    def __init__(
        self, cache: PrepCache, batcher: Batcher | None = None, workers: Workers | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "dxserve_requests", "HTTP requests answered", ["route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "dxserve_request_seconds", "Request latency (seconds) by route", ["route"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60),
            registry=self.registry,
        )
        self.errors = Counter(
            "dxserve_errors", "Problem responses by status", ["status"], registry=self.registry
        )
        self.registry.register(_CacheCollector(cache))
        if batcher is not None:
            self.registry.register(_BatchCollector(batcher))
        if workers is not None:
            self.registry.register(_DeviceCollector(workers))
        # (route, status) -> the labelled children ``record`` updates. ``labels()``
        # validates, locks and hashes on every call; a request needs only the same few
        # children again, so look them up once (a race just labels twice, harmlessly).
        self._children: dict[tuple[str, int], tuple[Any, Any, Any]] = {}

    def record(self, route: str, status: int, seconds: float) -> None:
        """Count and time one answered request (errors counted by status too)."""
        children = self._children.get((route, status))
        if children is None:
            code = str(status)
            error = self.errors.labels(code) if status >= 400 else None
            children = (self.requests.labels(route, code), self.latency.labels(route), error)
            self._children[(route, status)] = children
        requests, latency, error = children
        requests.inc()
        latency.observe(seconds)
        if error is not None:
            error.inc()


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
        return [hits, misses, size]


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
