"""Tracing: with SEARCH_OTLP_ENDPOINT (or a tracer provider given to create_app), a server span per
request with a child span per stage (queue, encode, retrieve, rerank) carrying search.k, search.mode,
search.batch_size and search.reranker; without it, none of OpenTelemetry's SDK is loaded."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from fastapi.testclient import TestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from pydantic import ValidationError

from service.engine.search_engine import SearchEngine
from service.engine.tracing import traces_url
from service.http.app import create_app
from tests.conftest import ROOT
from tests.test_rerank_service import small_cross_encoder  # noqa: F401 - the session fixture
from tests.test_service import call, one, settings_for


def in_memory() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


@pytest.fixture(scope="module")
def traced(small_index, engine):
    provider, exporter = in_memory()
    return create_app(settings_for(small_index, microbatch_window_ms=20), engine, tracer_provider=provider), exporter


@pytest.fixture
def app(traced):
    app, exporter = traced
    exporter.clear()
    return app


@pytest.fixture
def spans(traced):
    return traced[1].get_finished_spans


def requests_and_stages(finished) -> list[tuple]:
    """(server span, its child spans by start time) per request."""
    children = defaultdict(list)
    for span in finished:
        if span.parent is not None:
            children[span.parent.span_id].append(span)
    servers = [span for span in finished if span.kind == SpanKind.SERVER]
    return [(server, sorted(children[server.context.span_id], key=lambda s: s.start_time)) for server in servers]


def test_a_search_is_one_server_span_with_queue_encode_retrieve_under_it(app, spans, demo_queries):
    response = one(app, "POST", "/search", {"query": demo_queries["q0001"], "k": 7})
    assert response.status_code == 200
    [(server, stages)] = requests_and_stages(spans())
    assert len(spans()) == 1 + len(stages)  # nothing else: no spans of FastAPI's own inside the request
    assert server.name == "POST /search" and server.parent is None
    assert server.attributes["http.route"] == "/search" and server.attributes["http.response.status_code"] == 200
    assert [s.name for s in stages] == ["queue", "encode", "retrieve"]
    for stage in stages:
        assert stage.context.trace_id == server.context.trace_id
        assert server.start_time <= stage.start_time <= stage.end_time <= server.end_time
        assert dict(stage.attributes) == {"search.k": 7, "search.mode": "hybrid", "search.batch_size": 1}  # the default
    assert server.attributes["search.k"] == 7  # the request's span carries them too, to find it by
    queue, encode, retrieve = stages
    assert queue.end_time == encode.start_time and encode.end_time == retrieve.start_time
    latency = response.json()["latency_ms"]  # the spans are the stages the engine timed
    for stage in (encode, retrieve):
        assert (stage.end_time - stage.start_time) / 1e6 == pytest.approx(latency[stage.name], abs=0.01)


def test_concurrent_searches_get_a_trace_each_with_their_micro_batch_size(app, spans, demo_queries):
    queries = [demo_queries[f"q{n:04d}"] for n in range(1, 9)]
    responses = call(app, *(("POST", "/search", {"query": q, "k": 3}) for q in queries))
    assert all(response.status_code == 200 for response in responses)
    traced = requests_and_stages(spans())
    assert len(traced) == 8 and len({server.context.trace_id for server, _ in traced}) == 8
    for server, stages in traced:
        assert [s.name for s in stages] == ["queue", "encode", "retrieve"]
        assert {s.context.trace_id for s in stages} == {server.context.trace_id}
    # The requests of one forward pass share its encode span's times exactly; the model runs one batch
    # at a time, so no two batches start at the same nanosecond.
    batches: dict[int, list] = {}
    for _, stages in traced:
        batches.setdefault(stages[1].start_time, []).append(stages[1])
    batches = list(batches.values())
    for batch in batches:
        assert [span.attributes["search.batch_size"] for span in batch] == [len(batch)] * len(batch)
    assert max(len(batch) for batch in batches) > 1  # some requests really shared a forward pass


def test_a_client_batch_is_one_run_with_its_size(app, spans, demo_queries):
    queries = [demo_queries[f"q{n:04d}"] for n in range(1, 6)]
    assert one(app, "POST", "/search/batch", {"queries": queries, "k": 4, "mode": "hybrid"}).status_code == 200
    [(server, stages)] = requests_and_stages(spans())
    assert server.name == "POST /search/batch"
    assert [s.name for s in stages] == ["queue", "encode", "retrieve"]
    assert all(dict(s.attributes) == {"search.k": 4, "search.mode": "hybrid", "search.batch_size": 5} for s in stages)


def test_embeddings_are_an_encode_span(app, spans):
    assert one(app, "POST", "/v1/embeddings", {"input": ["a query", "another"]}).status_code == 200
    [(server, stages)] = requests_and_stages(spans())
    assert server.attributes["http.route"] == "/v1/embeddings"
    assert [s.name for s in stages] == ["queue", "encode"]
    assert stages[1].attributes["search.batch_size"] == 2


def test_a_refused_request_has_its_server_span_and_no_stages(app, spans):
    assert one(app, "POST", "/search", {"query": "q", "k": 5000}).status_code == 422
    [(server, stages)] = requests_and_stages(spans())
    assert server.attributes["http.response.status_code"] == 422 and stages == []


def test_a_reranked_search_has_a_rerank_span_naming_its_reranker(small_index, searcher,
                                                                 small_cross_encoder):  # noqa: F811
    provider, exporter = in_memory()
    settings = settings_for(small_index, rerankers=[small_cross_encoder.path], rerank_depth=20)
    app = create_app(settings, SearchEngine(searcher, {"monobert": small_cross_encoder}), tracer_provider=provider)
    assert one(app, "POST", "/search", {"query": "flow over a wing", "k": 5, "rerank": True}).status_code == 200
    [(_, stages)] = requests_and_stages(exporter.get_finished_spans())
    assert [s.name for s in stages] == ["queue", "encode", "retrieve", "rerank"]
    assert stages[2].end_time == stages[3].start_time
    assert all(s.attributes["search.reranker"] == "monobert" for s in stages)
    exporter.clear()
    assert one(app, "POST", "/rerank", {"query": "wing", "texts": ["a wing", "a tail"]}).status_code == 200
    [(_, stages)] = requests_and_stages(exporter.get_finished_spans())
    assert [s.name for s in stages] == ["queue", "rerank"]
    assert dict(stages[1].attributes) == {"search.reranker": "monobert", "search.depth": 2}


class _Collector(BaseHTTPRequestHandler):
    received: list[tuple[str, str, bytes]] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, self.headers["Content-Type"], body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_spans_reach_an_otlp_collector_over_http(small_index, engine, demo_queries):
    collector = HTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{collector.server_port}"  # a bare collector URL: /v1/traces is added
        app = create_app(settings_for(small_index, otlp_endpoint=endpoint, service_name="search-eu"), engine)
        with TestClient(app) as client:
            assert client.post("/search", json={"query": demo_queries["q0002"], "k": 3}).status_code == 200
        # leaving the client ran the lifespan's end, which flushes the batched spans
    finally:
        collector.shutdown()
    assert {(path, kind) for path, kind, _ in _Collector.received} == {("/v1/traces", "application/x-protobuf")}
    names, services = [], set()
    for _, _, body in _Collector.received:
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            services |= {a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"}
            names += [span.name for scope in resource_spans.scope_spans for span in scope.spans]
    assert services == {"search-eu"}
    assert sorted(names) == sorted(["POST /search", "queue", "encode", "retrieve"])


def test_an_endpoint_that_is_not_an_http_url_is_refused():
    with pytest.raises(ValidationError, match="not an http"):
        settings_for(ROOT, otlp_endpoint="collector:4318")
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://otel.example/otlp/v1/traces") == "https://otel.example/otlp/v1/traces"


NOTHING_LOADED = """
import sys
import httpx, asyncio
import fastapi  # FastAPI (0.142 on) itself imports OpenTelemetry's API: that much is not ours
loaded = {name for name in sys.modules if name.startswith("opentelemetry")}
from service.http.app import create_app
from service.settings import ServiceSettings

app = create_app(ServiceSettings(index_dir=sys.argv[1], device="cpu"))

async def requests():
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        assert (await client.get("/health")).status_code == 200
        assert (await client.post("/search", json={"query": "q"})).status_code == 503  # still loading

asyncio.run(requests())
now = {name for name in sys.modules if name.startswith("opentelemetry")}
from opentelemetry import trace
assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider", "a tracer provider was set up"
print(sorted(now - loaded))
"""


def test_without_an_endpoint_nothing_of_opentelemetry_is_loaded_or_set_up(small_index):
    env = {name: value for name, value in os.environ.items() if name != "SEARCH_OTLP_ENDPOINT"}
    done = subprocess.run([sys.executable, "-c", NOTHING_LOADED, str(small_index)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"  # no module of the SDK, the exporter, or any more of the API
