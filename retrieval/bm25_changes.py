"""BM25 of a collection that writes have changed since its generation was built, without rebuilding anything.

The generation's BM25 (retrieval.bm25_index) stays as built. What writes change is tokenized as it is written
(retrieval.segment_terms): the written passages' terms, and the terms of the generation's passages they hide
(deleted or replaced). A query's statistics are combined at query time: the document count, each term's document
frequency and the average length are the generation's, less the hidden passages', plus the live written
ones'. Every score is therefore the exact BM25 of the live collection, as a full rebuild over its passages
scores it (bm25s's Lucene variant, k1 1.5, b 0.75), and a compaction changes no score. A write costs the
tokenizing of its own passages and the passages it hides; a query, the postings of its terms.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import bm25s
import numpy as np

from retrieval.bm25_index import K1, LENGTHS_FILE, TOKENIZER_STOPWORDS, TOKENIZER_VOCAB, B, Bm25Index, stems
from retrieval.segment import Segment

BLOCK = 1 << 23  # postings read at a time while deriving term frequencies


@dataclass(frozen=True)
class BaseTerms:
    """What scoring a changed collection reads of its generation's BM25: each term's postings with their term
    frequencies (as counts, not scores) and each passage's length."""

    vocab: Mapping[str, int]  # term -> its column of the postings
    indptr: np.ndarray  # column c's postings: [indptr[c], indptr[c + 1])
    indices: np.ndarray  # each posting's row
    frequencies: np.ndarray  # each posting's term frequency, float32 (whole numbers)
    lengths: np.ndarray  # each row's length in terms, float64
    total_length: float

    @property
    def count(self) -> int:
        return len(self.lengths)

    @classmethod
    def of(cls, index: Bm25Index, texts: Callable[[], Iterable[str]]) -> "BaseTerms":
        """`index`'s terms, derived once per loaded index: bm25s keeps each posting's score, idf x tf / (tf + norm),
        so its term frequency is that score solved for tf, with the idf bm25s stored (float32) and each row's norm
        from its length, rounded to the whole count it is (exact far past any passage's counts)."""
        return index.derived("base terms", lambda: cls._derive(index, texts))

    @classmethod
    def _derive(cls, index: Bm25Index, texts: Callable[[], Iterable[str]]) -> "BaseTerms":
        retriever = index.retriever
        if retriever.method != "lucene":
            raise ValueError(f"BM25 beside writes scores bm25s's lucene variant, not {retriever.method!r}")
        data, indices, indptr = (retriever.scores[name] for name in ("data", "indices", "indptr"))
        lengths = index.passage_lengths(texts).astype(np.float64)
        count = len(lengths)
        document_frequency = np.diff(indptr).astype(np.float64)
        idf = np.log(1 + (count - document_frequency + 0.5) / (document_frequency + 0.5)).astype(np.float32)
        average = lengths.mean() if count else 1.0
        frequencies = np.empty(len(data), dtype=np.float32)
        for start in range(0, len(data), BLOCK):
            end = min(start + BLOCK, len(data))
            columns = np.searchsorted(indptr, np.arange(start, end), side="right") - 1
            share = data[start:end].astype(np.float64) / idf[columns].astype(np.float64)  # tf / (tf + norm)
            norm = K1 * (1 - B + B * lengths[indices[start:end]] / average)
            frequencies[start:end] = np.rint(share * norm / (1 - share))
        return cls(dict(index.tokenizer.get_vocab_dict()), indptr, indices, frequencies, lengths, float(lengths.sum()))

    def postings(self, term: str) -> tuple[np.ndarray, np.ndarray]:
        """(rows, term frequencies) of the passages holding `term`."""
        column = self.vocab.get(term)
        if column is None:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        start, end = self.indptr[column], self.indptr[column + 1]
        return self.indices[start:end], self.frequencies[start:end]


def search(base: BaseTerms, segment: Segment, queries: Sequence[str], k: int, base_mask: np.ndarray | None,
           written: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each query's best `k` (rows, scores) of the collection `segment` makes of its generation: the generation's
    rows `base_mask` keeps (None: all; the hidden ones must be out of it) and the written passages `written` keeps
    (rows base_count + position), by exact BM25 over the live collection (the module), best first, equal scores by
    row; only passages sharing a term with the query."""
    terms, positions = segment.terms, len(segment.passages)
    written_lengths = np.asarray(terms.written_lengths[:positions], dtype=np.float64)
    count = base.count - segment.hidden_count + segment.written  # the live collection's statistics
    total = base.total_length - terms.hidden_length(segment.hidden_count) + float(written_lengths[segment.live].sum())
    norm_base, norm_slope = K1 * (1 - B), K1 * B / (total / count if count else 1.0)
    results = []
    for query in stems(queries):
        base_scores = np.zeros(base.count, dtype=np.float64)
        written_scores = np.zeros(positions, dtype=np.float64)
        for term, (rows, frequencies), (mine, mine_frequencies), frequency in _known(base, segment, query):
            idf = np.log(1 + (count - frequency + 0.5) / (frequency + 0.5))
            if len(rows):
                base_scores[rows] += idf * frequencies / (frequencies + norm_base + norm_slope * base.lengths[rows])
            if len(mine):
                written_scores[mine] += idf * mine_frequencies / (
                    mine_frequencies + norm_base + norm_slope * written_lengths[mine])
        if base_mask is not None:
            base_scores[~base_mask] = 0
        written_scores[~written] = 0
        hits, mine = np.flatnonzero(base_scores > 0), np.flatnonzero(written_scores > 0)
        rows = np.concatenate([hits, segment.base_count + mine]).astype(np.int64)
        scores = np.concatenate([base_scores[hits], written_scores[mine]])
        if len(rows) > k > 0:  # those scoring at least the k-th score (ties included), then ordered
            kept = scores >= np.partition(scores, len(scores) - k)[len(scores) - k]
            rows, scores = rows[kept], scores[kept]
        order = np.lexsort((rows, -scores))[:max(k, 0)]
        results.append((rows[order], scores[order]))
    return results


def _known(base: BaseTerms, segment: Segment, query: list[str]):
    """(term, its generation postings, its written postings among the live, its document frequency in the live
    collection) for each of the query's terms the live collection holds, in the query's order and as often as it
    names them; a query holding none of them reads the empty term, as bm25s's tokenizer makes it."""
    terms, positions, found = segment.terms, len(segment.passages), {}

    def read(term: str):
        if term not in found:
            rows, frequencies = base.postings(term)
            mine, mine_frequencies = terms.written_postings(term, positions)
            alive = segment.live[mine]
            mine, mine_frequencies = mine[alive], mine_frequencies[alive]
            frequency = len(rows) - terms.hidden_holding(term, segment.hidden_count) + len(mine)
            found[term] = (term, (rows, frequencies), (mine, mine_frequencies), frequency)
        return found[term]

    known = [read(term) for term in query if read(term)[3] > 0]
    if not known and read("")[3] > 0:
        known = [read("")]
    return known


def write_compacted(base: BaseTerms, segment: Segment, source: Path, out: Path) -> None:
    """The BM25 index of the collection `segment` makes of its generation (its live rows in order, then its live
    written passages: the collection retrieval.compaction writes) into `out`, as `build_bm25` writes one, from the
    terms already held (`source`: the generation's BM25 folder, whose vocabulary and stopwords it extends): no
    passage is tokenized again, and each score is the one a build over the live passages computes."""
    terms, positions = segment.terms, len(segment.passages)
    kept = np.ones(base.count, dtype=bool) if segment.hidden is None else ~segment.hidden
    new_row = np.cumsum(kept) - 1
    kept_count = int(kept.sum())
    alive = np.flatnonzero(segment.live)
    written_row = np.full(positions, -1, dtype=np.int64)
    written_row[alive] = kept_count + np.arange(len(alive))
    vocabulary = sorted(base.vocab, key=base.vocab.get)  # by column: the generation's terms, then the new ones
    columns = dict(base.vocab)
    for term in terms.terms():
        if term not in columns:
            columns[term] = len(vocabulary)
            vocabulary.append(term)
    width = len(vocabulary)
    posting_column = np.repeat(np.arange(len(base.indptr) - 1), np.diff(base.indptr))
    keep = kept[base.indices]
    before = np.concatenate([[0], np.cumsum(keep)])  # kept postings before each posting
    base_counts = np.zeros(width, dtype=np.int64)
    base_counts[:len(base.indptr) - 1] = before[base.indptr[1:]] - before[base.indptr[:-1]]
    written = {}
    for term in terms.terms():
        mine, frequencies = terms.written_postings(term, positions)
        live = segment.live[mine]
        if live.any():
            written[term] = (written_row[mine[live]], frequencies[live])
    counts = base_counts.copy()
    for term, (rows, _) in written.items():
        counts[columns[term]] += len(rows)
    starts = np.concatenate([[0], np.cumsum(counts)])
    total = int(starts[-1])
    indices, frequencies = np.empty(total, dtype=np.int32), np.empty(total, dtype=np.float64)
    column_of = np.empty(total, dtype=np.int64)
    kept_postings = np.flatnonzero(keep)
    kept_columns = posting_column[kept_postings]
    destination = starts[kept_columns] + (before[kept_postings] - before[base.indptr[kept_columns]])
    indices[destination] = new_row[base.indices[kept_postings]]
    frequencies[destination] = base.frequencies[kept_postings]
    column_of[destination] = kept_columns
    for term, (rows, term_frequencies) in written.items():
        column = columns[term]
        at = starts[column] + base_counts[column] + np.arange(len(rows))
        indices[at], frequencies[at], column_of[at] = rows, term_frequencies, column
    written_lengths = np.asarray(terms.written_lengths[:positions], dtype=np.float64)
    lengths = np.concatenate([base.lengths[kept], written_lengths[alive]])
    survive = (counts > 0) | (np.array(vocabulary, dtype=object) == "")  # the empty term stays, as a build keeps it
    renumber = np.cumsum(survive) - 1
    count = len(lengths)
    document_frequency = counts[survive].astype(np.float64)
    idf = np.log(1 + (count - document_frequency + 0.5) / (document_frequency + 0.5)).astype(np.float32)
    average = lengths.mean() if count else 1.0
    norm = K1 * ((1 - B) + B * lengths[indices] / average)
    data = (idf[renumber[column_of]].astype(np.float64) * (frequencies / (norm + frequencies))).astype(np.float32)
    indptr = np.concatenate([[0], np.cumsum(counts[survive])])
    stem_to_sid = {term: int(renumber[column]) for term, column in columns.items() if survive[column]}
    _save(out, source, data, indices, indptr, count, stem_to_sid, lengths)


def _save(out: Path, source: Path, data: np.ndarray, indices: np.ndarray, indptr: np.ndarray, count: int,
          stem_to_sid: dict[str, int], lengths: np.ndarray) -> None:
    """Writes a BM25 folder as `build_bm25` does: bm25s's arrays and parameters, the tokenizer's vocabulary (the
    generation's words kept where their term is, `source`'s stopwords) and the passages' lengths."""
    retriever = bm25s.BM25(k1=K1, b=B)
    retriever.scores = {"data": data, "indices": indices, "indptr": indptr.astype(np.int64), "num_docs": count}
    retriever.vocab_dict, retriever.nonoccurrence_array = stem_to_sid, None  # lucene scores no absent term
    retriever.save(str(out), show_progress=False)
    vocabulary = json.loads((source / TOKENIZER_VOCAB).read_text(encoding="utf-8"))
    word_to_stem = {w: s for w, s in vocabulary["word_to_stem"].items() if s in stem_to_sid}
    word_to_id = {w: stem_to_sid[word_to_stem[w]] for w in vocabulary["word_to_id"] if w in word_to_stem}
    (out / TOKENIZER_VOCAB).write_text(json.dumps({"word_to_stem": word_to_stem, "stem_to_sid": stem_to_sid,
                                                   "word_to_id": word_to_id}), encoding="utf-8")
    shutil.copyfile(source / TOKENIZER_STOPWORDS, out / TOKENIZER_STOPWORDS)
    np.save(out / LENGTHS_FILE, lengths.astype(np.int32))
