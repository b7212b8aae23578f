"""The HTTP service, driven with httpx against the real app over a real small index."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from bench.ports import unclaimed_ports
from index_builder.build import BuildOptions, build_index
from retrieval.searcher import Searcher
from service.engine.search_engine import SearchEngine
from service.http.app import create_app
from service.http.schemas import SearchHit
from service.settings import ServiceSettings
from tests.conftest import ROOT

KEY = "s3cret-key"


def settings_for(index_dir: Path, **overrides) -> ServiceSettings:
    return ServiceSettings(index_dir=index_dir, device="cpu", **overrides)


@contextmanager
def started(settings: ServiceSettings):
    """The real app, its index loaded in the background as in production; yields once loading has ended, in
    success or failure (/ready says which)."""
    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + 120
        while client.get("/ready").json()["status"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
        yield client


def call(app, *requests: tuple, headers: dict | None = None) -> list[httpx.Response]:
    """Send the (method, path, json) requests concurrently to the app in one event loop; a `bytes`
    body is sent as it is, as JSON."""

    def body_of(body) -> dict:
        return {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {
            "json": body}

    async def send_all():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=headers or {}) as client:
            return await asyncio.gather(*(client.request(m, p, **body_of(body)) for m, p, body in requests))

    return asyncio.run(send_all())


def one(app, method: str, path: str, body=None, **kwargs) -> httpx.Response:
    return call(app, (method, path, body), **kwargs)[0]


@pytest.fixture(scope="module")
def app(small_index, engine):
    return create_app(settings_for(small_index), engine)


def test_health_says_alive(app):
    response = one(app, "GET", "/health")
    assert response.status_code == 200 and response.json()["status"] == "alive"


def test_ready_reports_the_loaded_index(app):
    body = one(app, "GET", "/ready").json()
    assert body["status"] == "ready"
    assert body["index"]["count"] == 300 and body["index"]["model"] == "all-MiniLM-L6-v2"


def test_search_returns_k_passages_sorted_by_score_with_latency(app, demo_queries, demo_qrels):
    response = one(app, "POST", "/search", {"query": demo_queries["q0001"], "k": 7})
    assert response.status_code == 200
    body = response.json()
    scores = [r["score"] for r in body["results"]]
    assert len(scores) == 7 and scores == sorted(scores, reverse=True)
    assert [r["rank"] for r in body["results"]] == list(range(1, 8))
    # exactly the documented fields, but `fields`, there only when asked (tests/test_filters.py)
    assert all(set(r) == set(SearchHit.model_fields) - {"fields"} for r in body["results"])
    assert demo_qrels["q0001"] in [r["id"] for r in body["results"]]
    latency = body["latency_ms"]
    assert set(latency) == {"queue", "encode", "retrieve", "rerank", "total"}
    assert latency["encode"] > 0 and latency["retrieve"] > 0 and latency["rerank"] == 0
    assert latency["total"] >= latency["encode"] + latency["retrieve"] - 0.002  # each rounded to the microsecond


def test_search_equals_the_library_searcher(app, searcher, demo_queries):
    body = one(app, "POST", "/search", {"query": demo_queries["q0005"], "k": 10}).json()
    assert [r["id"] for r in body["results"]] == [h.id for h in searcher.search(demo_queries["q0005"], 10)]


def test_batch_endpoint_equals_single_calls(app, demo_queries):
    queries = [demo_queries[q] for q in ("q0002", "q0003", "q0004", "q0005")]
    batch = one(app, "POST", "/search/batch", {"queries": queries, "k": 5}).json()
    assert [item["query"] for item in batch["results"]] == queries
    for query, item in zip(queries, batch["results"]):
        single = one(app, "POST", "/search", {"query": query, "k": 5}).json()
        assert [r["id"] for r in item["results"]] == [r["id"] for r in single["results"]]
        assert [r["score"] for r in item["results"]] == pytest.approx([r["score"] for r in single["results"]], abs=1e-5)


def test_concurrent_searches_through_the_micro_batcher_equal_sequential_ones(small_index, engine, demo_queries):
    app = create_app(settings_for(small_index, microbatch_window_ms=20), engine)
    queries = [demo_queries[f"q{n:04d}"] for n in range(1, 25)]
    concurrent = call(app, *(("POST", "/search", {"query": q, "k": 3 + i % 5}) for i, q in enumerate(queries)))
    for i, (query, response) in enumerate(zip(queries, concurrent)):
        alone = engine.search(query, 3 + i % 5)
        assert [r["id"] for r in response.json()["results"]] == [h.id for h in alone.hits]
    metrics = one(app, "GET", "/metrics").text
    batches = next(float(l.split()[-1]) for l in metrics.splitlines() if l.startswith("search_batch_size_count"))
    assert batches < len(queries)  # some requests really shared a forward pass


LIMITS = [
    ({"query": ""}, "query", "must not be empty"),
    ({"query": " \t\n "}, "query", "must not be empty or only whitespace"),
    ({"query": "x" * 51}, "query", "max_query_chars limit of 50 (SEARCH_MAX_QUERY_CHARS)"),
    ({"query": "ok", "k": 0}, "k", "greater than or equal to 1"),
    ({"query": "ok", "k": 1001}, "k", "less than or equal to 1000"),
    ({"query": "ok", "k": 200}, "k", "max_k limit of 100 (SEARCH_MAX_K)"),
    ({"k": 3}, "query", "Field required"),
]


@pytest.fixture(scope="module")
def strict_app(small_index, engine):
    limits = {"max_query_chars": 50, "max_k": 100, "max_batch_queries": 2, "max_body_bytes": 300}
    return create_app(settings_for(small_index, **limits), engine)


@pytest.mark.parametrize("body,field,message", LIMITS)
def test_each_search_limit_gives_422_naming_field_and_limit(strict_app, body, field, message):
    response = one(strict_app, "POST", "/search", body)
    assert response.status_code == 422
    [error] = response.json()["detail"]
    assert error["loc"] == ["body", field] and message in error["msg"]


def test_batch_limits_give_422(strict_app):
    too_many = one(strict_app, "POST", "/search/batch", {"queries": ["a", "b", "c"]})
    assert too_many.status_code == 422
    assert "max_batch_queries limit of 2 (SEARCH_MAX_BATCH_QUERIES)" in too_many.json()["detail"][0]["msg"]
    blank = one(strict_app, "POST", "/search/batch", {"queries": ["fine", "  "]})
    assert blank.status_code == 422 and blank.json()["detail"][0]["loc"] == ["body", "queries", 1]
    empty = one(strict_app, "POST", "/search/batch", {"queries": []})
    assert empty.status_code == 422


def test_a_body_over_the_byte_limit_gives_422(strict_app):
    response = one(strict_app, "POST", "/search", {"query": "ok", "padding": "x" * 400})
    assert response.status_code == 422
    assert "max_body_bytes limit of 300 bytes (SEARCH_MAX_BODY_BYTES)" in response.json()["detail"][0]["msg"]


def test_rerank_without_a_reranker_is_refused_not_ignored(app):
    response = one(app, "POST", "/search", {"query": "paths", "rerank": True})
    assert response.status_code == 400 and "no reranker is configured" in response.json()["detail"]


def test_api_key_guards_every_route_but_health_and_ready(small_index, engine):
    app = create_app(settings_for(small_index, api_key=KEY), engine)
    for method, path, body in [("POST", "/search", {"query": "x"}), ("POST", "/search/batch", {"queries": ["x"]}),
                               ("GET", "/metrics", None), ("GET", "/stats", None),
                               ("POST", "/admin/reload", {"index": "small"}), ("POST", "/v1/embeddings", {"input": "x"}),
                               ("POST", "/rerank", {"query": "x", "texts": ["y"]})]:
        assert one(app, method, path, body).status_code == 401, path
        assert one(app, method, path, body, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
    assert one(app, "GET", "/health").status_code == 200
    assert one(app, "GET", "/ready").status_code == 200
    # The search page and its files hold no data: they load without the key, and ask the user for it.
    assert one(app, "GET", "/").status_code == 200 and one(app, "GET", "/static/search.js").status_code == 200
    good = one(app, "POST", "/search", {"query": "x"}, headers={"Authorization": f"Bearer {KEY}"})
    assert good.status_code == 200


def test_metrics_count_requests_by_route_and_status_and_time_each_stage(small_index, engine):
    app = create_app(settings_for(small_index), engine)
    call(app, ("POST", "/search", {"query": "paths"}), ("POST", "/search", {"query": ""}))
    text = one(app, "GET", "/metrics").text
    assert 'search_http_requests_total{route="/search",status="200"} 1.0' in text
    assert 'search_http_requests_total{route="/search",status="422"} 1.0' in text
    for stage in ("encode", "retrieve", "total"):
        assert f'search_stage_seconds_count{{stage="{stage}"}} 1.0' in text


def test_metrics_tell_what_ready_tells_for_alerts(small_index, engine):
    # Read at each scrape: an alert pages on a replica not ready, one behind the newest generation, a write path
    # degraded or a reload failed (docker/prometheus/alerts.yml).
    text = one(create_app(settings_for(small_index), engine), "GET", "/metrics").text
    manifest = engine.searcher.manifest
    assert "search_ready 1.0" in text
    assert f'search_index_generation_info{{generation="{engine.searcher.generation}"}} 1.0' in text
    built = datetime.fromisoformat(manifest.built_at).timestamp()
    assert float(re.search(r"^search_index_built_timestamp_seconds (\S+)$", text, re.M).group(1)) == built
    assert "search_reload_failed 0.0" in text and "search_write_path_degraded 0.0" in text


def test_stats_give_percentiles_per_stage_and_the_index(small_index, engine):
    app = create_app(settings_for(small_index), engine)
    call(app, *(("POST", "/search", {"query": f"query {n}"}) for n in range(5)))
    stats = one(app, "GET", "/stats").json()
    assert stats["queries_served"] == 5 and stats["index"]["count"] == 300
    for stage in ("encode", "retrieve", "total"):
        p = stats["latency_ms"][stage]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"]


@pytest.fixture()
def index_root(tmp_path, small_index, encoder) -> Path:
    shutil.copytree(small_index, tmp_path / "small")
    (tmp_path / "tiny.tsv").write_text("t1\tThe aircraft wing stalls at a high angle of attack.\nt2\tA hash table maps keys.\n")
    build_index(BuildOptions(tmp_path / "tiny.tsv", tmp_path / "tiny", bm25=False), encoder)
    shutil.copytree(small_index, tmp_path / "broken")
    (tmp_path / "broken" / "manifest.json").write_text("{not json")
    return tmp_path


def test_reload_switches_to_another_index_under_the_root(index_root, encoder):
    engine = SearchEngine(Searcher(index_root / "small", encoder))
    app = create_app(settings_for(index_root / "small"), engine)
    response = one(app, "POST", "/admin/reload", {"index": "tiny"})
    assert response.status_code == 200 and response.json()["count"] == 2
    hits = one(app, "POST", "/search", {"query": "wing stall", "k": 5}).json()["results"]
    assert [h["id"] for h in hits] == ["t1", "t2"]


def in_collected_generations(thing) -> bool:
    """Whether Python's cyclic garbage collector still walks `thing` (gc.freeze takes objects out)."""
    return any(any(o is thing for o in gc.get_objects(generation)) for generation in range(3))


@pytest.mark.parametrize("freeze", [True, False])
def test_the_loaded_index_is_frozen_out_of_gc_and_a_reload_frees_the_one_it_replaced(index_root, encoder, freeze):
    searcher = Searcher(index_root / "small", encoder)
    searcher.cycle = searcher  # freed only by a cyclic collection, which a frozen object never gets
    app = create_app(settings_for(index_root / "small", gc_freeze=freeze), SearchEngine(searcher))
    assert in_collected_generations(searcher) is not freeze
    replaced = weakref.ref(searcher)
    del searcher
    assert one(app, "POST", "/admin/reload", {"index": "tiny"}).status_code == 200
    if not freeze:
        gc.collect()  # the collector's own schedule would get to it
    assert replaced() is None  # collected, not kept frozen
    assert one(app, "GET", "/ready").json()["index"]["count"] == 2


def nice_of(thread_id: int) -> int:
    return int(Path(f"/proc/self/task/{thread_id}/stat").read_text().rpartition(")")[2].split()[16])


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_the_model_thread_yields_the_cores_to_the_event_loop(small_index, engine):
    app = create_app(settings_for(small_index, model_thread_nice=7), engine)
    runtime = app.state.runtime
    model_thread = runtime.executor.submit(threading.get_native_id).result()
    assert nice_of(model_thread) == min(19, os.nice(0) + 7)
    reload_thread = runtime.loader.submit(threading.get_native_id).result()  # a reload loads the new index here
    assert nice_of(reload_thread) == min(19, os.nice(0) + 7)
    assert nice_of(threading.get_native_id()) == os.nice(0)  # the caller's, as the event loop's, is untouched
    assert one(app, "POST", "/search", {"query": "paths", "k": 3}).status_code == 200


@pytest.mark.parametrize("name,message", [("broken", "not valid JSON"), ("empty", "no manifest.json"),
                                          ("../..", "inside the index root"), ("/etc", "inside the index root"),
                                          ("bad\x00name", "not a usable folder name"), ("missing", "no folder 'missing'")])
def test_a_failed_reload_keeps_the_old_index_serving(index_root, encoder, name, message):
    (index_root / "empty").mkdir(exist_ok=True)
    engine = SearchEngine(Searcher(index_root / "small", encoder))
    app = create_app(settings_for(index_root / "small"), engine)
    before = one(app, "POST", "/search", {"query": "paths", "k": 3}).json()["results"]
    response = one(app, "POST", "/admin/reload", {"index": name})
    if name == "missing":  # names nothing: 404
        assert response.status_code == 404 and message in response.json()["detail"]
    else:
        assert response.status_code == 422
        assert response.json()["detail"][0]["loc"] == ["body", "index"]
        assert message in response.json()["detail"][0]["msg"]
    assert one(app, "POST", "/search", {"query": "paths", "k": 3}).json()["results"] == before
    assert one(app, "GET", "/ready").json()["index"]["count"] == 300


def test_an_index_that_fails_to_load_leaves_health_up_and_ready_503(tmp_path):
    with started(settings_for(tmp_path / "nowhere")) as client:
        ready = client.get("/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "failed"
        assert "no manifest.json" in ready.json()["detail"]
        assert client.get("/health").status_code == 200
        assert client.post("/search", json={"query": "x"}).status_code == 503


def test_python_m_service_serves_on_localhost(small_index):
    port = unclaimed_ports(1)[0]
    env = {**os.environ, "SEARCH_INDEX_DIR": str(small_index), "SEARCH_PORT": str(port), "SEARCH_DEVICE": "cpu"}
    server = subprocess.Popen([sys.executable, "-m", "service"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        response = httpx.post(f"{base}/search", json={"query": "join two paths", "k": 2}, timeout=30)
        assert response.status_code == 200 and len(response.json()["results"]) == 2
    finally:
        server.terminate()
        output = server.communicate(timeout=30)[0]
    assert "settings: index_dir=" in output and "api_key=None" in output


def test_openapi_spec_lists_every_route(app):
    paths = one(app, "GET", "/openapi.json").json()["paths"]
    assert {"/search", "/search/batch", "/health", "/ready", "/metrics", "/stats", "/admin/reload"} <= set(paths)
    assert json.dumps(paths["/search"]).count("SearchRequest") >= 1
