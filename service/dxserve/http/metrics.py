"""Prometheus metrics, one registry per app (so tests can run several apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..preparation import PrepCache


class Metrics:
    def __init__(self, cache: PrepCache) -> None:
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
