"""Prometheus metrics and sliding-window percentiles for /metrics and /stats, and the audit log of keyed requests."""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from typing import Callable, Mapping

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from service.engine.search_engine import STAGES, StageTimings

STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
audit_log = logging.getLogger("service.audit")


def _percentiles(values: list[float]) -> dict[str, float]:
    p50, p90, p99 = np.percentile(values, [50, 90, 99]) if values else (0.0, 0.0, 0.0)
    return {"p50": round(float(p50), 3), "p90": round(float(p90), 3), "p99": round(float(p99), 3)}


class Monitor:
    """One per app: its own registry, so several apps (tests, reloads) never share counters."""

    def __init__(self, window: int) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "search_http_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self._request_counters: dict[tuple[str, int], Counter] = {}
        self.stage_seconds = Histogram(
            "search_stage_seconds", "Time per search stage", ["stage"], buckets=STAGE_BUCKETS, registry=self.registry
        )
        self.rerank_seconds = Histogram(
            "search_rerank_seconds", "Rerank time per query, by reranker", ["reranker"], buckets=STAGE_BUCKETS,
            registry=self.registry,
        )
        self.batch_size = Histogram(
            "search_batch_size", "Texts per encoder call: queries, or embeddings inputs", buckets=BATCH_BUCKETS, registry=self.registry
        )
        self.rejected = Counter(
            "search_rejected_requests", "Search requests refused with 429: the service was at its concurrency cap",
            registry=self.registry,
        )
        self.dropped = Counter(
            "search_dropped_requests", "Queued search requests dropped unrun because their client disconnected",
            registry=self.registry,
        )
        self.key_requests = Counter(
            "search_key_requests", "Requests by API key name (\"unknown\": no key or a wrong one) and outcome: "
            "allowed, or refused with 401 or 403", ["key", "outcome"], registry=self.registry,
        )
        self.queued = Gauge("search_queue_size", "Search requests waiting for the model", registry=self.registry)
        self.in_flight = Gauge("search_in_flight_requests", "Search requests in the service (queued or running)",
                               registry=self.registry)
        self.write_log_failures = Counter(
            "search_write_log_failures", "Writes the write log refused (a failed write or fsync, a full disk, a log "
            "removed): nothing of them was kept", registry=self.registry,
        )
        self.key_rejected = Counter(
            "search_key_rejected_requests", "Search requests refused by admission (429, or 503 while stopping), by API "
            "key name (\"open\" where no key is configured)", ["key"], registry=self.registry,
        )
        self._key_rejected_children: dict[str, Counter] = {}
        # Children looked up once: `labels()` on every request is a locked dict lookup per stage.
        self._stage_children = {stage: self.stage_seconds.labels(stage=stage) for stage in STAGES}
        self._window = {stage: deque(maxlen=window) for stage in STAGES}
        self._rerank_window: dict[str, deque] = {}
        self._window_size = window
        self._served = 0
        self._lock = threading.Lock()

    def observe_key(self, name: str, outcome: str) -> None:
        self.key_requests.labels(key=name, outcome=outcome).inc()

    def observe_key_refusal(self, name: str) -> None:
        # A child per key, looked up once, as observe_request's: refusals come in waves.
        counter = self._key_rejected_children.get(name)
        if counter is None:
            counter = self._key_rejected_children[name] = self.key_rejected.labels(key=name)
        counter.inc()

    def watch_key_in_flight(self, read: Callable[[], Mapping[str, int]]) -> None:
        """Exposes `read()` (key name -> its search requests in the service) as search_key_in_flight_requests,
        read when /metrics is scraped rather than kept up to date on every request."""
        self.registry.register(_PerKeyGauge(
            "search_key_in_flight_requests", "Search requests in the service (queued or running), by API key name "
            "(\"open\" where no key is configured)", read))

    def watch_state(self, read: Callable[[], "ServingState"]) -> None:
        """Exposes `read()` (what /ready tells) as gauges read at each scrape, for alerts: search_ready,
        search_index_generation_info{generation}, search_index_built_timestamp_seconds, search_reload_failed,
        search_write_path_degraded."""
        self.registry.register(_StateGauges(read))

    def observe_request(self, route: str, status: int) -> None:
        # One labelled child per route and status, looked up once: labels() costs several times inc(), and a
        # wave of refusals counts a thousand at once.
        counter = self._request_counters.get((route, status))
        if counter is None:
            counter = self._request_counters[route, status] = self.requests.labels(route=route, status=str(status))
        counter.inc()

    def observe_search(self, timings: StageTimings, reranker: str | None = None) -> None:
        """One query's stage times; `reranker` names the reranker that rescored it, if any."""
        values = timings.as_dict()
        with self._lock:
            self._served += 1
            for stage, ms in values.items():
                self._window[stage].append(ms)
            if reranker is not None:
                self._rerank_window.setdefault(reranker, deque(maxlen=self._window_size)).append(timings.rerank)
        for stage, ms in values.items():
            self._stage_children[stage].observe(ms / 1000)
        if reranker is not None:
            self.rerank_seconds.labels(reranker=reranker).observe(timings.rerank / 1000)

    def observe_batch(self, size: int) -> None:
        self.batch_size.observe(size)

    def stats(self) -> dict:
        """Queries served, and p50/p90/p99 ms per stage over the last `window` queries."""
        with self._lock:
            windows = {stage: list(values) for stage, values in self._window.items()}
            reranks = {name: list(values) for name, values in self._rerank_window.items()}
            served = self._served
        return {
            "queries_served": served,
            "window": len(windows["total"]),
            "latency_ms": {stage: _percentiles(values) for stage, values in windows.items()},
            "rerank_ms": {name: _percentiles(values) for name, values in reranks.items()},
        }

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _PerKeyGauge:
    """A Prometheus collector of one gauge labelled by key, its values read at each scrape."""

    def __init__(self, name: str, documentation: str, read: Callable[[], Mapping[str, int]]) -> None:
        self.name, self.documentation, self.read = name, documentation, read

    def collect(self):
        family = GaugeMetricFamily(self.name, self.documentation, labels=["key"])
        for key, value in sorted(self.read().items()):
            family.add_metric([key], value)
        yield family


@dataclass(frozen=True)
class ServingState:
    """What a scrape reads of the service's state: whether an index serves, which generation (its id and when
    it was built, None while none serves), and whether a reload failed or the write path is degraded."""

    ready: bool
    generation: str | None = None
    built_at: str | None = None  # ISO 8601, the manifest's
    reload_failed: bool = False
    write_path_degraded: bool = False


class _StateGauges:
    """Monitor.watch_state's collector."""

    def __init__(self, read: Callable[[], ServingState]) -> None:
        self.read = read

    def collect(self):
        state = self.read()
        gauges = {"search_ready": ("1 where an index is loaded and serving (/ready 200), else 0", state.ready),
                  "search_reload_failed": ("1 while the last reload failed (the previous index serving)",
                                           state.reload_failed),
                  "search_write_path_degraded": ("1 while writes are refused or compaction fails",
                                                 state.write_path_degraded)}
        for name, (documentation, value) in gauges.items():
            yield GaugeMetricFamily(name, documentation, value=float(value))
        if state.generation is not None:
            info = GaugeMetricFamily("search_index_generation_info", "The generation served (always 1)",
                                     labels=["generation"])
            info.add_metric([state.generation], 1.0)
            yield info
            built = datetime.fromisoformat(state.built_at).timestamp()
            yield GaugeMetricFamily("search_index_built_timestamp_seconds",
                                    "When the generation served was built (or compacted), Unix seconds: a replica "
                                    "below another's serves an older generation", value=built)


class RequestCounter:
    """ASGI middleware: counts every response by route template and status, refused ones included; with `audit`
    (scoped keys), logs a line per request naming the key it carried (`key=-` for none known)."""

    def __init__(self, app, monitor: Monitor, paths: set[str], audit: bool = False) -> None:
        self.app, self.monitor, self.paths, self.audit = app, monitor, paths, audit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def watched_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        finally:
            route = scope.get("route")
            path = route.path if route is not None else scope["path"]
            self.monitor.observe_request(path if path in self.paths else "unmatched", status)
            if self.audit:
                key = scope.get("state", {}).get("key")
                audit_log.info('"%s %s" %d key=%s', scope["method"], path, status, key.name if key else "-")
