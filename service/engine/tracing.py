"""OpenTelemetry traces, only where SEARCH_OTLP_ENDPOINT asks for them: a server span per request
(FastAPI's own, from 0.143 on) with a child span per stage the request went through: queue, encode,
retrieve, rerank. Unset, nothing of OpenTelemetry's SDK or exporter is imported and no span is made.

The model runs on its own thread, for fused batches of requests, so the stage spans are not opened
around the work: they are made afterwards, from the times the engine measured (time.perf_counter()),
as children of the request's span, one set per request, a fused batch's shared stages in each."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Sequence
from urllib.parse import urlsplit

from service.engine.search_engine import SearchPlan, SearchResult
from service.settings import ServiceSettings

TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for traces, under a collector's base URL (port 4318)

# The most a stop waits for the last spans: well inside a 30 s termination grace period.
SHUTDOWN_TIMEOUT_S = 2.0
log = logging.getLogger("service")

CLOCK_STEP_NS = 50_000_000  # a change of the wall clock against perf_counter taken for a step, not for jitter

# (span name, start, end), the times in time.perf_counter() seconds
Stage = tuple[str, float, float]


def traces_url(endpoint: str) -> str:
    """`endpoint` as the exporter wants it: a bare collector URL (http://host:4318) gets /v1/traces."""
    return endpoint.rstrip("/") + TRACES_PATH if urlsplit(endpoint).path in ("", "/") else endpoint


class TracingUnavailable(RuntimeError):
    """SEARCH_OTLP_ENDPOINT is set but the tracing extra is not installed."""


def otlp_provider(endpoint: str, service_name: str) -> Any:
    """An SDK TracerProvider exporting in batches, off the request path, to `endpoint` over OTLP/HTTP
    (protobuf); OTEL_EXPORTER_OTLP_HEADERS and the like still apply to the exporter."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as error:
        raise TracingUnavailable(f"SEARCH_OTLP_ENDPOINT is set, but {error.name} is not installed: "
                           "pip install 'dense-search[tracing]'") from error
    # Not shut down at exit by the SDK: the app's lifespan does it, flushing the last spans.
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}), shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
    return provider


class Tracing:
    """Where the service's spans go: nowhere (`provider` None), or an OpenTelemetry TracerProvider
    (`owned`: made here, so shut down here)."""

    def __init__(self, provider: Any = None, *, owned: bool = False) -> None:
        self.provider, self._owned = provider, owned
        self._tracer = provider.get_tracer("dense-search") if provider is not None else None
        self._offset = time.time_ns() - time.perf_counter_ns()

    @classmethod
    def from_settings(cls, settings: ServiceSettings, provider: Any = None) -> "Tracing":
        """Spans to `provider` where one is given (tests: an SDK provider over an in-memory exporter),
        else to SEARCH_OTLP_ENDPOINT where it is set, else nowhere."""
        if provider is not None:
            return cls(provider)
        if settings.otlp_endpoint is None:
            return cls()
        return cls(otlp_provider(settings.otlp_endpoint, settings.service_name), owned=True)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def fastapi_config(self) -> dict:
        """FastAPI(telemetry=...): its server span per request ("POST /search", with http.route and
        http.response.status_code), outside every middleware, so a 429 or 408 gets one too, and
        continuing a caller's trace from its traceparent header. Nothing else of FastAPI's telemetry:
        no metrics (Prometheus has them), logs or spans of its own inside the request. Off without a
        provider. (FastAPI before 0.142 keeps unknown arguments in app.extra: no server span there.)"""
        if not self.enabled:
            return {"tracing": False, "metrics": False, "logs": False}
        return {"tracer_provider": self.provider, "metrics": False, "logs": False, "operation_spans": False,
                "auto_configure": False}

    def annotate(self, attributes: dict[str, Any]) -> None:
        """`attributes` on the current span (the request's), where tracing is on."""
        if self.enabled:
            from opentelemetry import trace  # only where tracing is on (see the module)

            trace.get_current_span().set_attributes(attributes)

    def stages(self, stages: Sequence[Stage], attributes: dict[str, Any]) -> None:
        """A child span of the current span (the request's) per stage, placed at its measured times,
        `attributes` on each and on the request's span too (to find its traces by them)."""
        if self._tracer is None:
            return
        from opentelemetry import trace

        trace.get_current_span().set_attributes(attributes)
        offset = self._epoch_offset()
        for name, start, end in stages:
            span = self._tracer.start_span(name, start_time=int(start * 1e9) + offset, attributes=attributes)
            span.end(end_time=int(end * 1e9) + offset)

    def _epoch_offset(self) -> int:
        """perf_counter -> the epoch nanoseconds spans carry. Kept from one request to the next, so the
        requests of one fused batch get the very same times for its stages (two clock reads straddle
        whatever preempts the thread between them: up to milliseconds under load); read anew only where
        the wall clock was stepped (NTP at boot, a VM resumed), by more than CLOCK_STEP_NS."""
        now = time.time_ns() - time.perf_counter_ns()
        if abs(now - self._offset) > CLOCK_STEP_NS:
            self._offset = now
        return self._offset

    def search(self, submitted: float, result: SearchResult, plan: SearchPlan) -> None:
        """The stages of a search run (one query's, or a client batch's): queue, from `submitted`
        (perf_counter) until the model thread began the run; then encode (not in bm25 mode), retrieve,
        and rerank when the plan reranks, as the engine timed them."""
        if self._tracer is None:
            return
        timings = result.timings
        started = timings.started_at
        encoded = started + timings.encode / 1000
        retrieved = encoded + timings.retrieve / 1000
        stages = [("queue", submitted, started)]
        if plan.mode != "bm25":
            stages.append(("encode", started, encoded))
        stages.append(("retrieve", encoded, retrieved))
        attributes = {"search.k": plan.k, "search.mode": plan.mode, "search.batch_size": result.batch_size}
        if plan.reranker is not None:
            stages.append(("rerank", retrieved, retrieved + timings.rerank / 1000))
            attributes["search.reranker"] = plan.reranker
        self.stages(stages, attributes)

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> bool:
        """Export what is left and stop, if the provider is this object's own, waiting at most
        `timeout_s`: whether it finished. Past it the export goes on in a daemon thread, which the
        process does not wait for at exit (a collector that never answers would otherwise hold the exit)."""
        if not self._owned:
            return True
        exporting = threading.Thread(target=self.provider.shutdown, name="trace-shutdown", daemon=True)
        exporting.start()
        exporting.join(timeout_s)
        if exporting.is_alive():
            log.warning("traces: the last spans were not exported within %g s; stopping without them", timeout_s)
        return not exporting.is_alive()
