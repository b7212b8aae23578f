"""The z-score hybrid's dense weight and pseudo-relevance feedback (retrieval.feedback): what a search runs,
checked against the stored vectors themselves; where they apply; the service's defaults and its 422s.
(tests/test_writes.py checks them over written passages and a filter against a full build.)"""

from __future__ import annotations

import faiss
import numpy as np
import pytest
from pydantic import ValidationError

from retrieval.feedback import Feedback
from service.settings import ServiceSettings
from training.first_stage import DEFAULT, Setting, adopted
from tests.test_service import one
from tests.test_training import serving


def stored_vectors(index) -> np.ndarray:
    flat = faiss.read_index(str(index / "index.faiss"))
    return flat.reconstruct_n(0, flat.ntotal)


def test_feedback_searches_again_from_the_even_hybrids_top_passages(searcher, small_index, demo_queries):
    vectors = stored_vectors(small_index)
    for query in list(demo_queries.values())[:6]:
        even = searcher.search(query, 3, mode="hybrid", fusion="zscore", exact=True)
        relevant = list(searcher.live_rows([hit.id for hit in even]).values())
        fed = searcher.encode([query])[0] + 2.0 * vectors[relevant].mean(axis=0)
        (expected,) = searcher.hits([[(row, 0.0) for row in np.argsort(-(vectors @ fed), kind="stable")[:10]]])
        # dense weight 1: the fused order is the fed-back dense list's (all 300 passages are in it)
        got = searcher.search(query, 10, mode="hybrid", fusion="zscore", exact=True, dense_weight=1.0,
                              feedback=Feedback(3, 2.0))
        assert [hit.id for hit in got] == [hit.id for hit in expected]
        assert got != searcher.search(query, 10, mode="hybrid", fusion="zscore", exact=True, dense_weight=1.0)


def test_the_even_weight_without_feedback_is_the_plain_hybrid_and_other_modes_ignore_both(searcher, demo_queries):
    query = demo_queries["q0007"]
    plain = searcher.search(query, 10, mode="hybrid", fusion="zscore")
    assert searcher.search(query, 10, mode="hybrid", fusion="zscore", dense_weight=0.5, feedback=False) == plain
    assert searcher.search(query, 10, mode="hybrid", fusion="zscore", feedback=Feedback(5, 0.0)) == plain
    assert searcher.search(query, 10, mode="hybrid", fusion="zscore", dense_weight=0.9) != plain
    for mode, fusion in (("dense", None), ("bm25", None), ("hybrid", "rrf"), ("hybrid", "interleave")):
        assert searcher.search(query, 10, mode=mode, fusion=fusion, dense_weight=0.9, feedback=Feedback(3, 2.0)) == \
            searcher.search(query, 10, mode=mode, fusion=fusion)


def test_out_of_range_weights_and_feedback_are_refused_where_they_are_made(searcher):
    with pytest.raises(ValueError, match="dense_weight must be between 0 and 1"):
        searcher.request(10, dense_weight=1.5)
    with pytest.raises(ValueError, match="feedback passages"):
        Feedback(0, 1.0)
    with pytest.raises(ValueError, match="feedback weight"):
        Feedback(3, -1.0)
    with pytest.raises(ValidationError, match="default_dense_weight"):
        ServiceSettings(index_dir=".", default_dense_weight=2)


@pytest.mark.parametrize("body,loc", [({"dense_weight": 1.5}, ["body", "dense_weight"]),
                                      ({"dense_weight": "0.7"}, ["body", "dense_weight"]),
                                      ({"feedback": {"passages": 101}}, ["body", "feedback", "passages"]),
                                      ({"feedback": {"weight": 2.0}}, ["body", "feedback", "passages"]),
                                      ({"feedback": {"passages": 3, "wieght": 2.0}}, ["body", "feedback", "wieght"])])
def test_a_bad_dense_weight_or_feedback_is_a_422_naming_the_field(app, body, loc):
    response = one(app, "POST", "/search", {"query": "join two paths", **body})
    assert response.status_code == 422 and loc in [error["loc"] for error in response.json()["detail"]]


def test_the_service_defaults_run_where_a_request_names_none_and_a_request_turns_them_off(app, small_index,
                                                                                       demo_queries):
    query = demo_queries["q0007"]
    named = one(app, "POST", "/search", {"query": query, "dense_weight": 0.8,
                                         "feedback": {"passages": 3, "weight": 2.0}}).json()
    weighted = one(app, "POST", "/search", {"query": query, "dense_weight": 0.8}).json()
    settings = ServiceSettings(index_dir=small_index, device="cpu", default_dense_weight=0.8,
                               default_feedback_passages=3, default_feedback_weight=2.0)
    with serving(settings) as client:
        default = client.post("/search", json={"query": query}).json()
        off = client.post("/search", json={"query": query, "feedback": {"passages": 0}}).json()
    # (The started service encodes queries its own way, on ONNX where it can: the same ids, scores to 1e-4.)
    ids = {name: [hit["id"] for hit in answer["results"]] for name, answer in
           (("default", default), ("named", named), ("weighted", weighted), ("off", off))}
    assert (default["mode"], default["score_kind"]) == ("hybrid", "zscore")
    assert ids["default"] == ids["named"] != ids["weighted"] and ids["off"] == ids["weighted"]
    assert [hit["score"] for hit in default["results"]] == pytest.approx([hit["score"] for hit in named["results"]],
                                                                           abs=1e-4)


@pytest.fixture(scope="module")
def app(small_index, engine):
    from service.http.app import create_app
    from tests.test_service import settings_for

    return create_app(settings_for(small_index), engine)


def test_a_tuned_setting_is_adopted_only_where_its_gain_is_real_on_the_queries_that_choose_it():
    queries = [f"q{i}" for i in range(40)]
    default = {q: 0.5 for q in queries}
    better = Setting(0.7, Feedback(3, 2.0))
    clearly = {q: 0.6 for q in queries}  # better on every query
    barely = {q: 0.5 + (0.2 if i % 2 else -0.19) for i, q in enumerate(queries)}  # a small mean gain, half worse
    assert adopted({DEFAULT: default, better: clearly}, queries)[0] == better
    kept, why = adopted({DEFAULT: default, better: barely}, queries)
    assert kept == DEFAULT and "not shown better" in why
    assert adopted({DEFAULT: default, better: barely}, queries, only_real=False)[0] == better
    assert adopted({DEFAULT: default, better: default}, queries)[0] == DEFAULT  # a tie keeps the default
    assert better.env() == {"SEARCH_DEFAULT_DENSE_WEIGHT": "0.7", "SEARCH_DEFAULT_FEEDBACK_PASSAGES": "3",
                            "SEARCH_DEFAULT_FEEDBACK_WEIGHT": "2"}
    assert ServiceSettings(index_dir=".", **{name.removeprefix("SEARCH_").lower(): value
                                             for name, value in better.env().items()}).defaults == better.defaults()
