"""Reranking in the service: a cross-encoder rescoring the top `depth` retrieved passages."""

from __future__ import annotations

import pytest
from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

from models.cross_encoder import CrossEncoder
from models.encoder import default_model_path
from service.engine.search_engine import SearchEngine
from service.http.app import create_app
from service.settings import ServiceSettings
from tests.test_service import one


@pytest.fixture(scope="session")
def small_cross_encoder(tmp_path_factory) -> CrossEncoder:
    """A 2-layer BERT with a random head: real mechanics, meaningless but deterministic scores."""
    folder = tmp_path_factory.mktemp("models") / "tiny-monobert"
    config = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, num_labels=2)
    BertForSequenceClassification(config).save_pretrained(folder)
    BertTokenizerFast.from_pretrained(default_model_path()).save_pretrained(folder)
    return CrossEncoder(folder, device="cpu")


@pytest.fixture(scope="module")
def rerank_app(small_index, searcher, small_cross_encoder):
    settings = ServiceSettings(index_dir=small_index, device="cpu", rerankers=[small_cross_encoder.path],
                               rerank_depth=30, max_rerank_depth=50)
    return create_app(settings, SearchEngine(searcher, {"monobert": small_cross_encoder}))


def test_rerank_reorders_the_top_depth_by_cross_encoder_scores(rerank_app, searcher, small_cross_encoder, demo_queries):
    query = demo_queries["q0003"]
    response = one(rerank_app, "POST", "/search", {"query": query, "k": 5, "rerank": True, "depth": 20})
    assert response.status_code == 200
    body = response.json()
    retrieved = searcher.search(query, 20)
    expected_scores = small_cross_encoder.score(query, [hit.text for hit in retrieved])
    order = sorted(range(20), key=lambda i: -expected_scores[i])[:5]
    assert [r["id"] for r in body["results"]] == [retrieved[i].id for i in order]
    assert [r["score"] for r in body["results"]] == pytest.approx([float(expected_scores[i]) for i in order], abs=1e-5)
    assert [r["retrieval_score"] for r in body["results"]] == pytest.approx([retrieved[i].score for i in order], abs=1e-5)
    assert [r["rank"] for r in body["results"]] == [1, 2, 3, 4, 5]
    assert body["latency_ms"]["rerank"] > 0


def test_rerank_depth_defaults_to_the_setting_and_bounds_the_candidates(rerank_app, searcher, demo_queries):
    query = demo_queries["q0004"]
    hits = one(rerank_app, "POST", "/search", {"query": query, "k": 30, "rerank": True}).json()["results"]
    assert {h["id"] for h in hits} == {hit.id for hit in searcher.search(query, 30)}  # depth 30 = k: a reordering


def test_rerank_depth_past_the_limit_gives_422(rerank_app):
    over = one(rerank_app, "POST", "/search", {"query": "paths", "rerank": True, "depth": 60})
    assert over.status_code == 422 and over.json()["detail"][0]["loc"] == ["body", "depth"]
    assert "max_rerank_depth limit of 50 (SEARCH_MAX_RERANK_DEPTH)" in over.text


def test_a_depth_under_k_rescores_that_many_and_the_rest_follow_in_retrieval_order(
        rerank_app, searcher, small_cross_encoder, demo_queries):
    query = demo_queries["q0005"]
    body = one(rerank_app, "POST", "/search", {"query": query, "k": 10, "rerank": True, "depth": 4}).json()
    retrieved = searcher.search(query, 10)
    scores = small_cross_encoder.score(query, [hit.text for hit in retrieved[:4]])
    head = sorted(range(4), key=lambda i: -scores[i])
    assert [r["id"] for r in body["results"]] == [retrieved[i].id for i in head] + [hit.id for hit in retrieved[4:]]
    assert [r["rank"] for r in body["results"]] == list(range(1, 11))
    assert all(r["rerank_score"] is not None for r in body["results"][:4])
    tail = body["results"][4:]
    assert all(r["rerank_score"] is None for r in tail)
    assert [r["score"] for r in tail] == [r["retrieval_score"] for r in tail]
    assert [r["score"] for r in tail] == pytest.approx([hit.score for hit in retrieved[4:]], abs=1e-5)
    # With no depth sent, SEARCH_RERANK_DEPTH (30) is rescored, even under a larger k.
    wide = one(rerank_app, "POST", "/search", {"query": query, "k": 40, "rerank": True}).json()["results"]
    assert [r["rerank_score"] is None for r in wide] == [False] * 30 + [True] * 10


def test_a_default_rerank_depth_past_the_limit_is_cut_to_it(small_index, searcher, small_cross_encoder):
    # Else every rerank request without a depth would be refused for a depth its client never sent.
    settings = ServiceSettings(index_dir=small_index, device="cpu", rerankers=[small_cross_encoder.path],
                               rerank_depth=100, max_rerank_depth=8)
    app = create_app(settings, SearchEngine(searcher, {"monobert": small_cross_encoder}))
    response = one(app, "POST", "/search", {"query": "paths", "k": 3, "rerank": True})
    assert response.status_code == 200 and len(response.json()["results"]) == 3


def test_rerank_applies_after_hybrid_fusion_and_in_batches(rerank_app, engine, demo_queries):
    query = demo_queries["q0007"]
    fused = engine.search(query, 10, mode="hybrid").hits
    body = one(rerank_app, "POST", "/search/batch",
               {"queries": [query], "k": 10, "mode": "hybrid", "rerank": True, "depth": 10}).json()
    assert {r["id"] for r in body["results"][0]["results"]} == {h.id for h in fused}


def test_ready_stats_and_metrics_name_the_reranker(small_index, searcher, small_cross_encoder):
    app = create_app(ServiceSettings(index_dir=small_index, device="cpu"),
                     SearchEngine(searcher, {"monobert": small_cross_encoder}))
    assert one(app, "GET", "/ready").json()["index"]["rerankers"] == {"monobert": small_cross_encoder.name}
    one(app, "POST", "/search", {"query": "paths", "k": 3, "rerank": True, "depth": 5})
    one(app, "POST", "/search", {"query": "paths", "k": 3})
    stats = one(app, "GET", "/stats").json()
    assert stats["queries_served"] == 2 and list(stats["rerank_ms"]) == ["monobert"]
    assert stats["rerank_ms"]["monobert"]["p50"] > 0
    assert 'search_rerank_seconds_count{reranker="monobert"} 1.0' in one(app, "GET", "/metrics").text


def test_a_reranker_that_is_not_configured_is_a_400(rerank_app):
    response = one(rerank_app, "POST", "/search", {"query": "paths", "rerank": True, "reranker": "coattention"})
    assert response.status_code == 400 and "'coattention' is not configured here; configured: monobert" in response.text


def _z(values):
    mean = sum(values) / len(values)
    spread = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
    return [(v - mean) / spread for v in values]


def test_a_retrieval_weight_orders_by_the_blend_of_both_standardised_scores(rerank_app, searcher, small_cross_encoder,
                                                                             demo_queries):
    query = demo_queries["q0003"]
    retrieved = searcher.search(query, 20)
    reranker = [float(s) for s in small_cross_encoder.score(query, [hit.text for hit in retrieved])]
    blend = [r + 1.5 * f for r, f in zip(_z(reranker), _z([hit.score for hit in retrieved]))]
    order = sorted(range(20), key=lambda i: -blend[i])[:5]
    body = one(rerank_app, "POST", "/search",
               {"query": query, "k": 5, "rerank": True, "depth": 20, "retrieval_weight": 1.5}).json()
    assert body["score_kind"] == "blend"
    assert [r["id"] for r in body["results"]] == [retrieved[i].id for i in order]
    assert [r["score"] for r in body["results"]] == pytest.approx([blend[i] for i in order], abs=1e-4)
    assert [r["rerank_score"] for r in body["results"]] == pytest.approx([reranker[i] for i in order], abs=1e-5)
    assert [r["retrieval_score"] for r in body["results"]] == pytest.approx([retrieved[i].score for i in order],
                                                                            abs=1e-5)


def test_a_large_retrieval_weight_keeps_the_first_stage_order_and_zero_is_the_reranker_alone(rerank_app, searcher,
                                                                                            demo_queries):
    query = demo_queries["q0005"]
    first = [hit.id for hit in searcher.search(query, 10)]
    heavy = one(rerank_app, "POST", "/search",
                {"query": query, "k": 10, "rerank": True, "depth": 10, "retrieval_weight": 100}).json()
    assert [r["id"] for r in heavy["results"]] == first
    alone = one(rerank_app, "POST", "/search", {"query": query, "k": 10, "rerank": True, "depth": 10}).json()
    zero = one(rerank_app, "POST", "/search",
               {"query": query, "k": 10, "rerank": True, "depth": 10, "retrieval_weight": 0}).json()
    assert zero["results"] == alone["results"] and zero["score_kind"] == alone["score_kind"] == "probability"
    assert all(r["score"] == r["rerank_score"] for r in alone["results"])


def test_the_retrieval_weight_setting_is_the_default_a_request_overrides(small_index, searcher, small_cross_encoder):
    settings = ServiceSettings(index_dir=small_index, device="cpu", rerankers=[small_cross_encoder.path],
                               rerank_retrieval_weight=2.0)
    app = create_app(settings, SearchEngine(searcher, {"monobert": small_cross_encoder}))
    request = {"query": "paths", "k": 3, "rerank": True, "depth": 10}
    assert one(app, "POST", "/search", request).json()["score_kind"] == "blend"
    assert one(app, "POST", "/search", {**request, "retrieval_weight": 0}).json()["score_kind"] == "probability"
    batch = one(app, "POST", "/search/batch", {"queries": ["paths"], "k": 3, "rerank": True, "depth": 10}).json()
    assert batch["score_kind"] == "blend"
    assert one(app, "POST", "/search", {"query": "paths", "k": 3}).json()["score_kind"] == "zscore"  # not reranked: the default


def test_a_negative_retrieval_weight_is_a_422_naming_it(rerank_app):
    response = one(rerank_app, "POST", "/search", {"query": "paths", "rerank": True, "retrieval_weight": -1})
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "retrieval_weight"]
