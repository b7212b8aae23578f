"""The library-level Searcher over a real small index."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import BertConfig, BertModel, BertTokenizerFast

from models.encoder import BiEncoder, default_model_path
from retrieval.index_format import IndexFormatError
from retrieval.load_options import LoadOptions
from retrieval.passage_store import PassageStore
from retrieval.searcher import MAX_K, EncoderMismatch, Searcher
from tests.conftest import CPU


def test_search_finds_the_known_relevant_passage(searcher, demo_queries, demo_qrels):
    found = 0
    for qid in [f"q{n:04d}" for n in range(1, 21)]:
        top = [hit.id for hit in searcher.search(demo_queries[qid], k=10)]
        found += demo_qrels[qid] in top
    assert found >= 14  # measured 17 of 20 on the 300-passage head of the demo corpus


def test_search_returns_k_passages_sorted_by_score(searcher, demo_queries):
    hits = searcher.search(demo_queries["q0001"], k=25)
    assert len(hits) == 25
    assert [hit.rank for hit in hits] == list(range(1, 26))
    scores = [hit.score for hit in hits]
    assert scores == sorted(scores, reverse=True)
    assert all(hit.text and hit.id for hit in hits)


def test_flat_index_equals_numpy_brute_force(searcher, small_index, demo_queries):
    store = PassageStore(small_index / "passages.sqlite")
    ids_and_texts = store.get(range(searcher.count))
    passages = searcher.encoder.encode_passages([text for _, text in ids_and_texts])
    queries = [demo_queries[f"q{n:04d}"] for n in range(1, 11)]
    vectors = searcher.encoder.encode_queries(queries)
    scores = vectors @ passages.T
    for query_scores, hits in zip(scores, searcher.batch_search(queries, k=50, mode="dense")):
        order = np.argsort(-query_scores, kind="stable")[:50]
        np.testing.assert_allclose([h.score for h in hits], query_scores[order], atol=1e-5)
        # Equal scores may swap places; compare ids where the next score is clearly lower.
        distinct = np.diff(query_scores[order]) < -1e-5
        expected_ids = [ids_and_texts[i][0] for i in order]
        assert [h.id for h, d in zip(hits, distinct) if d] == [e for e, d in zip(expected_ids, distinct) if d]


def test_batch_search_equals_single_searches(searcher, demo_queries):
    queries = [demo_queries[q] for q in ("q0002", "q0003", "q0004")]
    batched = searcher.batch_search(queries, k=5)
    for query, hits in zip(queries, batched):
        single = searcher.search(query, k=5)
        assert [h.id for h in hits] == [h.id for h in single]
        np.testing.assert_allclose([h.score for h in hits], [h.score for h in single], atol=1e-5)


def test_queries_tokenized_by_an_encoder_no_longer_serving_are_tokenized_again(searcher, demo_queries):
    # An index reloaded with another model between a request's check and its run: the old ids are unusable.
    queries = list(demo_queries.values())[:3]
    other = BiEncoder(device="cpu", query_max_tokens=8)
    stale = [other.tokenize(query) for query in queries]
    fresh = [searcher.encoder.tokenize(query) for query in queries]
    expected = searcher.encoder.encode_queries(queries)
    np.testing.assert_array_equal(searcher.encode(queries, stale), expected)
    np.testing.assert_array_equal(searcher.encode(queries, fresh), expected)


def test_k_larger_than_the_collection_returns_every_passage(searcher):
    hits = searcher.search("hash tables", k=MAX_K)
    assert len(hits) == searcher.count == 300
    assert len({h.id for h in hits}) == 300


@pytest.mark.parametrize("k", [0, -1, MAX_K + 1])
def test_k_outside_1_to_1000_is_refused(searcher, k):
    with pytest.raises(ValueError, match="k must be between 1 and 1000"):
        searcher.search("anything", k=k)


def test_an_encoder_other_than_the_index_encoder_is_refused_naming_both(small_index, tmp_path):
    folder = tmp_path / "random-bert"
    config = BertConfig(hidden_size=384, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    BertModel(config).save_pretrained(folder)
    BertTokenizerFast.from_pretrained(default_model_path()).save_pretrained(folder)
    other = BiEncoder(folder, device="cpu")
    assert other.spec.similarity == "ip" and other.spec.passage_segment_id == 1  # a plain BERT: RepBERT defaults
    with pytest.raises(EncoderMismatch) as error:
        Searcher(small_index, other, load=CPU)
    message = str(error.value)
    assert "all-MiniLM-L6-v2" in message and "random-bert" in message
    assert "similarity: index 'cosine', encoder 'ip'" in message
    assert "weights_sha256" in message


def test_a_folder_without_manifest_is_not_an_index(tmp_path, encoder):
    with pytest.raises(IndexFormatError, match="no manifest.json"):
        Searcher(tmp_path, encoder)


def test_a_damaged_index_file_is_detected(small_index, tmp_path, encoder):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(small_index, copy)
    with (copy / "index.faiss").open("r+b") as handle:
        handle.seek(1000)
        handle.write(b"\x00\x01\x02\x03")
    with pytest.raises(IndexFormatError, match="sha256 differs"):
        Searcher(copy, encoder, load=LoadOptions())
