"""Approximate search through the service: an index that carries a candidate structure is answered
through it, says so, keeps exact scores, and a request (or the service's setting) can ask the full scan."""

from __future__ import annotations

import pytest

from index_builder.cli import main as cli_main
from retrieval.searcher import Searcher
from service.engine.search_engine import SearchEngine
from service.http.app import create_app
from tests.conftest import CPU
from tests.test_candidates import copy_of
from tests.test_service import call, one, settings_for


@pytest.fixture(scope="module")
def hnsw_index(tmp_path_factory, small_index):
    index = copy_of(small_index, tmp_path_factory.mktemp("served-hnsw"))
    assert cli_main(["ann", "--index", str(index), "--kind", "hnsw"]) == 0
    return index


@pytest.fixture(scope="module")
def hnsw_engine(hnsw_index, encoder) -> SearchEngine:
    return SearchEngine(Searcher(hnsw_index, encoder, load=CPU))


@pytest.fixture(scope="module")
def app(hnsw_index, hnsw_engine):
    return create_app(settings_for(hnsw_index), hnsw_engine)


def test_a_search_says_it_was_answered_through_the_structure_with_the_exact_scans_hits(app, engine, demo_queries):
    # engine: the same passages without a structure, as today's service answers them.
    query = demo_queries["q0001"]
    answer = one(app, "POST", "/search", {"query": query, "k": 10}).json()
    assert answer["search"] == "approximate:hnsw"
    exact = engine.search(query, 10)
    assert [(h["id"], h["score"]) for h in answer["results"]] == [(h.id, h.score) for h in exact.hits]


def test_exact_true_scans_every_vector_and_says_so(app, engine, demo_queries):
    query = demo_queries["q0002"]
    answer = one(app, "POST", "/search", {"query": query, "k": 10, "exact": True}).json()
    assert answer["search"] == "exact"
    assert [(h["id"], h["score"]) for h in answer["results"]] == [(h.id, h.score) for h in engine.search(query, 10).hits]


def test_a_batch_through_the_structure_carries_exact_scores(app, engine, demo_queries):
    queries = [demo_queries[f"q{n:04d}"] for n in range(1, 25)]  # past the size where FAISS's scan uses BLAS
    answer = one(app, "POST", "/search/batch", {"queries": queries, "k": 5}).json()
    assert answer["search"] == "approximate:hnsw"
    for item, exact in zip(answer["results"], engine.search_batch(queries, 5)):
        assert [h["id"] for h in item["results"]] == [h.id for h in exact.hits]
        assert [h["score"] for h in item["results"]] == pytest.approx([h.score for h in exact.hits], abs=1e-6)


def test_concurrent_searches_of_both_kinds_are_answered_each_as_it_asked(app, demo_queries):
    requests = [("POST", "/search", {"query": demo_queries[f"q{n:04d}"], "k": 3, "exact": n % 2 == 0})
                for n in range(1, 13)]
    answers = call(app, *requests)
    assert [a.json()["search"] for a in answers] == ["approximate:hnsw" if n % 2 else "exact" for n in range(1, 13)]


def test_the_service_setting_answers_every_search_exactly(hnsw_index, hnsw_engine, demo_queries):
    app = create_app(settings_for(hnsw_index, exact_search=True), hnsw_engine)
    assert one(app, "POST", "/search", {"query": demo_queries["q0003"]}).json()["search"] == "exact"


def test_candidates_per_request_are_bounded_with_a_422_naming_the_field(app, demo_queries):
    refused = one(app, "POST", "/search", {"query": demo_queries["q0003"], "candidates": 10_001})
    assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "candidates"]
    assert one(app, "POST", "/search", {"query": demo_queries["q0003"], "candidates": 500}).status_code == 200


def test_ready_and_stats_show_the_recall_card(app):
    for path in ("/ready", "/stats"):
        card, = one(app, "GET", path).json()["index"]["candidates"]
        assert card["kind"] == "hnsw" and 0.98 <= card["recall_at_10"] <= 1.0 and "recall_at_100" in card


def test_an_index_without_a_structure_answers_exact(small_index, engine, demo_queries):
    app = create_app(settings_for(small_index), engine)
    answer = one(app, "POST", "/search", {"query": demo_queries["q0004"]}).json()
    assert answer["search"] == "exact"
    assert one(app, "GET", "/ready").json()["index"]["candidates"] == []
