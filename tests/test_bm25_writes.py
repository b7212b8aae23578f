"""BM25 beside writes (retrieval.bm25_changes): after any upserts and deletes, every BM25 score is the exact BM25 of
the live collection (its document count, document frequencies and average length), computed here from the
passages' terms; every hybrid fusion fuses that list; a filter keeps its passages only; a compaction changes no
score; and a write that was not applied leaves nothing behind."""

from __future__ import annotations

import math
import random
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from retrieval.bm25_changes import BaseTerms
from retrieval.bm25_index import BM25_DIR, K1, LENGTHS_FILE, B, Bm25Index, stems
from retrieval.compaction import compact
from retrieval.fusion import FUSION_RULES, as_pairs, standardised_row_fusion
from retrieval.index_format import PASSAGES_FILE
from retrieval.passage_store import PassageStore
from retrieval.request import MAX_K
from retrieval.searcher import Searcher
from retrieval.write_log import Record
from tests.test_writes import BASE, QUERIES, collection, demo_texts, record
from tests.test_writes import base_corpus, base_index, writes  # noqa: F401 - the fixtures: a writer over a base index

FUSIONS = ["interleave", "rrf", "zscore"]
EVEN = {"tags": "even"}


@pytest.fixture
def changed(writes):
    """The writes after random upserts (new passages, and old ids with new texts) and deletes."""
    chooser, texts = random.Random(11), demo_texts()
    fresh = iter(range(BASE, len(texts)))
    for _ in range(5):
        batch = {}
        for _ in range(chooser.randint(1, 4)):
            number = next(fresh) if chooser.random() < 0.5 else chooser.randrange(BASE)
            batch[texts[number][0]] = record(texts[number][0], texts[next(fresh)][1] + " revised", number)
        writes.upsert(list(batch.values()))
        writes.delete(ids=[texts[chooser.randrange(BASE)][0]])
        if chooser.random() < 0.5:  # a written passage written again, then deleted
            writes.delete(ids=[next(iter(batch))])
    return writes


def exact_bm25(passages: list[dict], query: str) -> dict[str, float]:
    """BM25 (bm25s's Lucene variant) over `passages`, from their terms, in float64: each passage sharing a term
    with `query`, by id."""
    counted = [Counter(terms) for terms in stems([p["text"] for p in passages])]
    count, average = len(passages), sum(sum(c.values()) for c in counted) / len(passages)
    frequency = Counter(term for counts in counted for term in counts)
    terms = [term for term in stems([query])[0] if frequency[term]] or [""]
    scores = {}
    for passage, counts in zip(passages, counted):
        norm = K1 * (1 - B + B * sum(counts.values()) / average)
        score = sum(math.log(1 + (count - frequency[t] + 0.5) / (frequency[t] + 0.5)) * counts[t] / (counts[t] + norm)
                    for t in terms if counts[t])
        if score > 0:
            scores[passage["id"]] = score
    return scores


def filtered(passages: list[dict], filter: dict | None) -> list[dict]:
    return [p for p in passages if filter is None or "even" in p["tags"]]


def assert_exact(searcher: Searcher, passages: list[dict], filter: dict | None) -> None:
    for query in QUERIES:
        expected = exact_bm25(passages, query)
        kept = {pid: score for pid, score in expected.items() if pid in {p["id"] for p in filtered(passages, filter)}}
        hits = searcher.search(query, MAX_K, mode="bm25", filter=filter)
        assert {hit.id for hit in hits} == set(kept), query
        for hit in hits:
            assert hit.score == pytest.approx(kept[hit.id], rel=1e-6, abs=1e-9), (query, hit.id)
        assert [hit.score for hit in hits] == sorted((hit.score for hit in hits), reverse=True)


def test_each_posting_s_term_frequency_derived_from_the_stored_scores_is_its_count(base_index, tmp_path):
    texts = [p["text"] for p in collection_of(base_index)]
    counted = [Counter(terms) for terms in stems(texts)]
    stored = Bm25Index(base_index / BM25_DIR)
    without_lengths = Path(shutil.copytree(base_index / BM25_DIR, tmp_path / BM25_DIR))
    (without_lengths / LENGTHS_FILE).unlink()  # an index built before lengths were kept counts them from its texts
    for index in (stored, Bm25Index(without_lengths)):
        terms = BaseTerms.of(index, lambda: iter(texts))
        assert terms.lengths.tolist() == [sum(c.values()) for c in counted]
        for term in terms.vocab:
            rows, frequencies = terms.postings(term)
            assert {int(r): int(f) for r, f in zip(rows, frequencies)} == \
                {row: c[term] for row, c in enumerate(counted) if c[term]}, term


def collection_of(index: Path) -> list[dict]:
    store = PassageStore(index / PASSAGES_FILE)
    count, _, _ = store.row_range()
    return [{"id": pid, "text": text} for pid, text in store.get(list(range(count)))]


@pytest.mark.parametrize("filter", [None, EVEN], ids=["all", "filtered"])
def test_after_upserts_and_deletes_every_bm25_score_is_the_live_collection_s_exact_bm25(changed, filter):
    searcher = changed.searcher
    assert searcher.segment.changes and searcher.segment.hidden_count > 0
    assert_exact(searcher, collection(changed), filter)


@pytest.mark.parametrize("filter", [None, EVEN], ids=["all", "filtered"])
@pytest.mark.parametrize("fusion", FUSIONS)
def test_every_hybrid_fusion_fuses_the_exact_bm25_list(changed, fusion, filter):
    searcher, passages = changed.searcher, collection(changed)
    rule, k = FUSION_RULES[fusion], 10
    depth = MAX_K if rule.deep else k
    for query in QUERIES:
        dense = searcher.search(query, depth, mode="dense", exact=True, filter=filter)
        rows = searcher.live_rows([p["id"] for p in passages])
        kept = {p["id"] for p in filtered(passages, filter)}
        lexical = sorted(((rows[pid], score) for pid, score in exact_bm25(passages, query).items() if pid in kept),
                         key=lambda row_score: (-row_score[1], row_score[0]))[:depth]
        dense_rows = (np.array([rows[h.id] for h in dense]), np.array([h.score for h in dense]))
        lexical_rows = (np.array([r for r, _ in lexical], dtype=np.int64), np.array([s for _, s in lexical]))
        if fusion == "zscore":
            expected = standardised_row_fusion(dense_rows, lexical_rows, k, searcher.defaults.dense_weight)
        else:
            expected = rule.fuse(as_pairs(dense_rows), as_pairs(lexical_rows), k, "dense")
        hits = searcher.search(query, k, mode="hybrid", fusion=fusion, exact=True, filter=filter, feedback=False)
        by_row = {row: pid for pid, row in rows.items()}
        assert [hit.id for hit in hits] == [by_row[row] for row, _ in expected], (query, fusion)
        np.testing.assert_allclose([hit.score for hit in hits], [score for _, score in expected], rtol=1e-6, atol=1e-6)


def test_a_compaction_changes_no_score(changed):
    before = {(query, mode): changed.searcher.search(query, 20, mode=mode, exact=True, feedback=False)
              for query in QUERIES for mode in ("bm25", "hybrid")}
    assert compact(changed) is not None
    after = changed.searcher
    assert not after.segment.changes
    for (query, mode), hits in before.items():
        now = after.search(query, 20, mode=mode, exact=True, feedback=False)
        assert [hit.id for hit in now] == [hit.id for hit in hits], (query, mode)
        np.testing.assert_allclose([hit.score for hit in now], [hit.score for hit in hits], rtol=1e-6, atol=1e-6)
    assert_exact(after, collection(changed), None)
    texts = demo_texts()  # and again from the compacted generation's BM25, written from terms
    changed.upsert([record(texts[n][0], texts[n][1], n) for n in range(BASE + 30, BASE + 34)])
    changed.delete(ids=[texts[2][0], texts[BASE + 30][0]])
    assert compact(changed) is not None
    assert_exact(changed.searcher, collection(changed), EVEN)


def test_a_write_not_applied_leaves_no_term_behind(writes):
    """A write whose next segment was made but never served (its log append failed) is cut off by the next one."""
    searcher = writes.searcher
    vector = searcher.encoder.encode_passages(["x"])

    def upsert(seq: int, pid: str, text: str) -> Record:
        return Record(seq, upsert=({"id": pid, "text": text, "fields": {}},), vectors=vector)

    taken = searcher.with_writes([upsert(1, "a", "zeppelin airship")])
    taken.with_writes([upsert(2, "b", "quokka marsupial")])  # made, never served
    live = taken.with_writes([upsert(2, "c", "wombat burrow")])
    assert [hit.id for hit in live.search("quokka wombat zeppelin", 10, mode="bm25")] in (["a", "c"], ["c", "a"])
    assert live.search("quokka", 10, mode="bm25") == []

