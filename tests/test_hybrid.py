"""BM25 beside the dense index, and its fusions with the dense list: the two of paper 000 section 4.5,
interleaving (eq. 6) and reciprocal rank fusion, and the mean of standardised scores."""

from __future__ import annotations

import warnings

import bm25s
import numpy as np
import pytest

from index_builder.build import BuildOptions, build_index
from retrieval.bm25_index import Bm25Index, build_bm25, new_tokenizer
from retrieval.fusion import interleave, reciprocal_rank_fusion, standardised_row_fusion, standardised_score_fusion
from retrieval.index_format import read_manifest
from retrieval.passage_store import PassageStore
from retrieval.searcher import Searcher
from service.engine.search_engine import SearchEngine
from service.errors import NotServable
from service.http.app import create_app
from service.settings import ServiceSettings
from tests.conftest import CPU
from tests.test_service import one, started


def test_interleave_gives_the_paper_example():
    fused = interleave(["a", "c", "d"], ["b", "a", "c"], depth=1000)
    assert [key for key, _ in fused] == ["a", "b", "c", "d"]


def test_interleave_order_matters_and_truncates():
    assert [k for k, _ in interleave(["b", "a", "c"], ["a", "c", "d"], depth=1000)] == ["b", "a", "c", "d"]
    assert [k for k, _ in interleave(["a", "c", "d"], ["b", "a", "c"], depth=3)] == ["a", "b", "c"]
    assert [k for k, _ in interleave(["x"], ["y", "z", "w"], depth=10)] == ["x", "y", "z", "w"]
    scores = [s for _, s in interleave(["a", "c"], ["b"], depth=10)]
    assert scores == sorted(scores, reverse=True)


def test_rrf_matches_a_hand_computed_list():
    fused = reciprocal_rank_fusion([["a", "b", "c"], ["c", "a", "d"]], depth=10, rrf_k=60)
    expected = {
        "a": 1 / 61 + 1 / 62,
        "c": 1 / 63 + 1 / 61,
        "b": 1 / 62,
        "d": 1 / 63,
    }
    assert [key for key, _ in fused] == ["a", "c", "b", "d"]
    assert dict(fused) == pytest.approx(expected)
    assert len(reciprocal_rank_fusion([["a", "b", "c"], ["c", "a", "d"]], depth=2)) == 2


def test_bm25_survives_save_and_load_with_equal_results(small_index):
    store = PassageStore(small_index / "passages.sqlite")
    texts = [text for _, text in store.get(range(read_manifest(small_index).count))]
    tokenizer = new_tokenizer()
    fresh = bm25s.BM25(k1=1.5, b=0.75)
    fresh.index(tokenizer.tokenize(texts, return_as="tuple", show_progress=False), show_progress=False)
    loaded = Bm25Index(small_index / "bm25")
    queries = ["join two paths", "Return the absolute version of a path.", "parse an expression node"]
    query_tokens = tokenizer.tokenize(queries, update_vocab=False, return_as="ids", show_progress=False)
    for ids, found in zip(query_tokens, loaded.search(queries, 20)):
        scores = fresh.get_scores([token for token in ids if token in fresh.unique_token_ids_set])
        # bm25s's own scores of every passage, best first, equal scores by row
        expected = sorted((-float(score), row) for row, score in enumerate(scores) if score > 0)[:20]
        assert [r for r, _ in found] == [row for _, row in expected]
        assert [s for _, s in found] == [-negative for negative, _ in expected]  # the same bits


def test_bm25_only_returns_passages_sharing_a_term(searcher):
    hits = searcher.search("zzzunknownword", k=10, mode="bm25")
    assert hits == []
    hits = searcher.search("socket", k=10, mode="bm25")
    assert hits and all("socket" in hit.text.lower() for hit in hits)


def test_an_empty_shards_bm25_builds_quietly_and_finds_nothing(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # `--shards N` past the passage count: numpy warned of an empty mean
        build_bm25([], 0, tmp_path)
    assert Bm25Index(tmp_path).search(["any word"], 10) == [[]]


def test_zscore_fusion_is_the_mean_of_standardised_scores_a_missing_key_at_its_lists_lowest():
    dense = [("a", 0.90), ("c", 0.89), ("b", 0.10)]  # a and c all but tied
    lexical = [("d", 31.0), ("c", 30.0), ("a", 5.0)]  # c far ahead of a
    fused = standardised_score_fusion([dense, lexical], depth=10)

    def z(values):
        mean = sum(values) / len(values)
        spread = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
        return [(v - mean) / spread for v in values]

    (za, zc, zb), (zd, zc2, za2) = z([0.90, 0.89, 0.10]), z([31.0, 30.0, 5.0])
    expected = {"a": (za + za2) / 2, "c": (zc + zc2) / 2, "b": (zb + za2) / 2, "d": (zb + zd) / 2}
    assert dict(fused) == pytest.approx(expected)
    assert [key for key, _ in fused] == ["c", "d", "a", "b"]
    # RRF of the same lists puts a first: ranks 1 and 3 beat ranks 2 and 2, however far apart the scores.
    assert reciprocal_rank_fusion([["a", "c", "b"], ["d", "c", "a"]], 10)[0][0] == "a"
    assert len(standardised_score_fusion([dense, lexical], depth=2)) == 2
    assert standardised_score_fusion([[("a", 1.0)], []], depth=5) == [("a", 0.0)]


@pytest.mark.parametrize("seed", range(10))
def test_zscore_fusion_weighted_evenly_is_its_mean_and_weighted_on_one_list_is_that_lists_order(seed):
    # A search's dense_weight weighs the same fusion: 0.5 each must be the mean the service answered before it.
    rng = np.random.default_rng(seed)
    dense = [(f"p{row}", float(score)) for row, score in zip(rng.permutation(50)[:30], np.sort(rng.random(30))[::-1])]
    lexical = [(f"p{row}", float(score)) for row, score in zip(rng.permutation(50)[:20], np.sort(rng.random(20) * 30)[::-1])]
    weighted = standardised_score_fusion([dense, lexical], 10, (0.5, 0.5))
    service = standardised_score_fusion([dense, lexical], 10)
    assert [key for key, _ in weighted] == [key for key, _ in service]
    assert [score for _, score in weighted] == pytest.approx([score for _, score in service])
    assert [key for key, _ in standardised_score_fusion([dense, lexical], 10, (1.0, 0.0))] == [key for key, _ in dense[:10]]
    assert [key for key, _ in standardised_score_fusion([dense, lexical], 10, (0.0, 1.0))] == [key for key, _ in lexical[:10]]


@pytest.mark.parametrize("seed", range(40))
def test_zscore_fusion_over_row_arrays_gives_the_reference_answer_to_the_bit(seed):
    rng = np.random.default_rng(seed)
    rows = rng.permutation(60)
    sizes = rng.integers(0, 40, size=2) if seed % 10 else (0, rng.integers(1, 40))
    dense_rows, lexical_rows = rows[:sizes[0]], rng.permutation(rows[20:20 + sizes[1]])  # overlapping, or not
    # float32 scores as FAISS and bm25s give them, some tied (the first-met key first among equals)
    dense_scores = np.sort(rng.choice([0.5, 0.25, *rng.random(5)], size=len(dense_rows)).astype(np.float32))[::-1]
    lexical_scores = np.sort(rng.integers(1, 6, size=len(lexical_rows)).astype(np.float32))[::-1]
    depth = int(rng.integers(1, 80)) if seed % 3 else 1000  # cutting among the fused, or keeping them all
    reference = standardised_score_fusion(
        [list(zip(dense_rows.tolist(), dense_scores.tolist())), list(zip(lexical_rows.tolist(), lexical_scores.tolist()))],
        depth)
    assert standardised_row_fusion((dense_rows, dense_scores), (lexical_rows, lexical_scores), depth) == reference
    weight = float(rng.random())  # a weighted hybrid (SEARCH_DEFAULT_DENSE_WEIGHT, `dense_weight`) too
    weighted = standardised_score_fusion(
        [list(zip(dense_rows.tolist(), dense_scores.tolist())), list(zip(lexical_rows.tolist(), lexical_scores.tolist()))],
        depth, (weight, 1.0 - weight))
    assert standardised_row_fusion((dense_rows, dense_scores), (lexical_rows, lexical_scores), depth, weight) == weighted


@pytest.mark.parametrize("fusion,lead", [("interleave", "dense"), ("interleave", "bm25"), ("rrf", "dense"),
                                         ("zscore", "dense")])
def test_hybrid_fuses_the_dense_and_bm25_lists(searcher, demo_queries, fusion, lead):
    query = demo_queries["q0007"]
    dense = [h.id for h in searcher.search(query, 1000, mode="dense")]
    exact = [h.id for h in searcher.search(query, 1000, mode="bm25")]
    hybrid = [h.id for h in searcher.search(query, 10, mode="hybrid", fusion=fusion, lead=lead)]
    if fusion == "rrf":
        expected = [key for key, _ in reciprocal_rank_fusion([dense, exact], 10)]
    elif fusion == "zscore":
        scored = [[(h.id, h.score) for h in searcher.search(query, 1000, mode=mode)] for mode in ("dense", "bm25")]
        expected = [key for key, _ in standardised_score_fusion(scored, 10)]
    else:
        first, second = (dense, exact) if lead == "dense" else (exact, dense)
        expected = [key for key, _ in interleave(first, second, 10)]
    assert hybrid == expected


def test_hybrid_and_bm25_are_served_over_http(small_index, engine, demo_queries):
    app = create_app(ServiceSettings(index_dir=small_index, device="cpu"), engine)
    query = demo_queries["q0007"]
    for body, mode, kind in (({"mode": "dense"}, "dense", "cosine"), ({"mode": "bm25"}, "bm25", "bm25"),
                             ({"mode": "hybrid", "fusion": "interleave"}, "hybrid", "interleave"),
                             ({"mode": "hybrid", "fusion": "rrf"}, "hybrid", "rrf"),
                             ({"mode": "hybrid"}, "hybrid", "zscore"),  # the default fusion
                             ({}, "hybrid", "zscore")):  # the default: the index has BM25
        response = one(app, "POST", "/search", {"query": query, "k": 5, **body})
        assert response.status_code == 200, response.text
        expected = engine.searcher.search(query, 5, **{"mode": mode, "fusion": kind if mode == "hybrid" else None})
        assert [r["id"] for r in response.json()["results"]] == [h.id for h in expected]
        # The response says which retrieval ran and what its scores are (MiniLM normalises: dense scores are cosines).
        assert (response.json()["mode"], response.json()["score_kind"]) == (mode, kind)
    batch = one(app, "POST", "/search/batch", {"queries": [query, "socket"], "k": 3})
    assert batch.status_code == 200 and len(batch.json()["results"]) == 2
    assert (batch.json()["mode"], batch.json()["score_kind"]) == ("hybrid", "zscore")
    bad = one(app, "POST", "/search", {"query": query, "mode": "sparse"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "mode"]


def test_a_search_naming_no_mode_runs_hybrid_zscore_in_the_python_api_too(searcher, demo_queries):
    query = demo_queries["q0007"]
    default, named = searcher.request(5), searcher.request(5, mode="hybrid", fusion="zscore")
    assert (default.mode, default.fusion) == (named.mode, named.fusion) == ("hybrid", "zscore")
    assert default.defaulted and not named.defaulted  # only the default is resolved afresh by another generation
    assert [h.id for h in searcher.search(query, 5)] == [h.id for h in searcher.search(query, 5, mode="hybrid",
                                                                                         fusion="zscore")]
    assert [h.id for h in searcher.search(query, 5)] != [h.id for h in searcher.search(query, 5, mode="dense")]


def test_search_default_mode_and_fusion_change_what_a_request_naming_none_runs(small_index, demo_queries):
    from tests.test_training import serving

    query = demo_queries["q0007"]
    for overrides, mode, kind in (({"default_mode": "dense"}, "dense", "cosine"),
                                  ({"default_fusion": "rrf"}, "hybrid", "rrf"),
                                  ({"default_mode": "bm25"}, "bm25", "bm25")):
        with serving(ServiceSettings(index_dir=small_index, device="cpu", **overrides)) as client:
            answer = client.post("/search", json={"query": query, "k": 5}).json()
            named = client.post("/search", json={"query": query, "k": 5, "mode": "dense"}).json()
        assert (answer["mode"], answer["score_kind"]) == (mode, kind)
        assert (named["mode"], named["score_kind"]) == ("dense", "cosine")  # a request's own mode wins


def test_an_index_built_with_no_bm25_answers_dense_by_default_and_bm25_with_a_clear_400(tmp_path, encoder):
    (tmp_path / "c.tsv").write_text("a\tone passage\nb\tanother passage\n")
    build_index(BuildOptions(tmp_path / "c.tsv", tmp_path / "dense-only", bm25=False), encoder)
    app = create_app(ServiceSettings(index_dir=tmp_path / "dense-only", device="cpu"),
                     SearchEngine(Searcher(tmp_path / "dense-only", encoder)))
    response = one(app, "POST", "/search", {"query": "passage", "mode": "hybrid"})
    assert response.status_code == 400 and "built with --no-bm25" in response.json()["detail"]
    default = one(app, "POST", "/search", {"query": "passage"})
    assert default.status_code == 200 and (default.json()["mode"], default.json()["score_kind"]) == ("dense", "cosine")


def test_a_search_naming_no_mode_runs_the_default_of_the_generation_that_answers_it(small_index, tmp_path, encoder):
    # A plan is made against the served index; a reload may swap in another before it runs.
    (tmp_path / "c.tsv").write_text("a\tone passage\nb\tanother passage\n")
    build_index(BuildOptions(tmp_path / "c.tsv", tmp_path / "dense-only", bm25=False), encoder)
    with_bm25, dense_only = Searcher(small_index, encoder, load=CPU), Searcher(tmp_path / "dense-only", encoder, load=CPU)
    engine = SearchEngine(with_bm25)
    defaulted, named = engine.plan(2), engine.plan(2, mode="hybrid")
    engine.serve(dense_only)
    answer = engine.run(["passage"], defaulted)[0]
    assert (answer.mode, [hit.id for hit in answer.hits]) == ("dense", [h.id for h in dense_only.search("passage", 2)])
    with pytest.raises(NotServable, match="built with --no-bm25"):
        engine.run(["passage"], named)  # a mode the request named is not changed under it
    back = engine.plan(2)
    engine.serve(with_bm25)
    assert engine.run(["passage"], back)[0].mode == "hybrid"


def test_build_writes_bm25_unless_no_bm25(tmp_path):
    from index_builder.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["build", "--corpus", "c", "--out", "o"]).bm25 is True
    assert parse(["build", "--corpus", "c", "--out", "o", "--no-bm25"]).bm25 is False
    assert parse(["update", "--index", "o", "--no-bm25"]).bm25 is False
    assert parse(["merge", "--shards", "a", "b", "--out", "o"]).bm25 is True


def test_a_default_mode_the_index_cannot_serve_keeps_it_from_loading_and_ready_says_why(tmp_path, encoder):
    (tmp_path / "c.tsv").write_text("a\tone passage\nb\tanother passage\n")
    build_index(BuildOptions(tmp_path / "c.tsv", tmp_path / "dense-only", bm25=False), encoder)
    settings = ServiceSettings(index_dir=tmp_path / "dense-only", device="cpu", default_mode="hybrid")
    with started(settings) as client:
        ready = client.get("/ready")
    assert ready.status_code == 503 and "needs a BM25 index" in ready.json()["detail"]
