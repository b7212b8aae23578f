"""BM25 over the same passages as the dense index (bm25s; row i = FAISS row i), for exact-match
retrieval beside the dense one (paper 000 section 4.5).

Stored in DIR/bm25/: bm25s's sparse index plus the tokenizer's vocabulary and stopwords, so
queries are tokenized exactly as the passages were (lower-cased, English stopwords, Snowball
English stemming), and each passage's length in terms (`lengths.npy`), which scoring the collection
as writes change it reads (retrieval.bm25_changes).
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

# bm25s runs a JAX top-k at import when JAX is installed; on a host with jax[cuda] that starts
# JAX on the GPU, which takes 75% of its memory in every process, leaving too little for FAISS in a
# second one. BM25 here needs JAX on the CPU at most; an explicit JAX_PLATFORMS still wins.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import bm25s  # noqa: E402
import numpy as np  # noqa: E402
import Stemmer  # noqa: E402
from bm25s.tokenization import Tokenizer  # noqa: E402

from retrieval.index_format import Bm25Record

BM25_DIR = "bm25"
TOKENIZER_VOCAB, TOKENIZER_STOPWORDS = "vocab.tokenizer.json", "stopwords.tokenizer.json"  # bm25s's names
LENGTHS_FILE = "lengths.npy"  # each passage's terms counted (its length, which BM25 normalises by), int32
K1, B = 1.5, 0.75
STEMMER = "english"
log = logging.getLogger("retrieval")


def new_tokenizer() -> Tokenizer:
    return Tokenizer(stopwords="en", stemmer=Stemmer.Stemmer(STEMMER))


def stems(texts: Sequence[str]) -> list[list[str]]:
    """Each text's terms as the index holds them (tokenized as `build_bm25` tokenizes: a text with none holds the
    empty term ""), whatever vocabulary an index has."""
    return new_tokenizer().tokenize(list(texts), update_vocab=True, return_as="string", show_progress=False)


def bm25_record() -> Bm25Record:
    return Bm25Record(library=f"bm25s {bm25s.__version__}", k1=K1, b=B, stemmer=STEMMER, stopwords="en")


def build_bm25(texts: Iterable[str], count: int, out: Path) -> None:
    """Index `count` passage texts (streamed, in row order) into `out`."""
    tokenizer = new_tokenizer()
    tokens = tokenizer.tokenize(texts, length=count, return_as="tuple", show_progress=True)
    retriever = bm25s.BM25(k1=K1, b=B)
    with warnings.catch_warnings():
        if count == 0:  # an empty shard (--shards past the passages): numpy warns of a mean over nothing
            warnings.simplefilter("ignore", RuntimeWarning)
        retriever.index(tokens, show_progress=False)
    retriever.save(str(out), show_progress=False)
    tokenizer.save_vocab(str(out))
    tokenizer.save_stopwords(str(out))
    np.save(out / LENGTHS_FILE, np.array([len(ids) for ids in tokens.ids], dtype=np.int32))


class Bm25Index:
    """Reads DIR/bm25; `search` gives rows and scores of matching passages only (score > 0)."""

    def __init__(self, folder: Path) -> None:
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: no BM25 index (built with --no-bm25)")
        self.retriever = bm25s.BM25.load(str(folder), show_progress=False)
        self.tokenizer = Tokenizer(stopwords=[], stemmer=Stemmer.Stemmer(STEMMER))
        self.tokenizer.load_vocab(str(folder))
        self.tokenizer.load_stopwords(str(folder))
        self.count = int(self.retriever.scores["num_docs"])
        lengths = folder / LENGTHS_FILE
        self.lengths = np.load(lengths) if lengths.is_file() else None  # None: an index built before it was kept
        self._derived: dict[str, Any] = {}
        self._deriving = threading.RLock()  # a derived value may derive another

    def passage_lengths(self, texts: Callable[[], Iterable[str]]) -> np.ndarray:
        """Each passage's length in terms: as stored, or (an index built before lengths were kept) counted once from
        `texts()`, the passages' texts in row order."""
        if self.lengths is not None:
            return self.lengths

        def count() -> np.ndarray:
            log.info("counting the terms of %d passages (an index built before their lengths were kept)", self.count)
            tokens = new_tokenizer().tokenize(texts(), length=self.count, return_as="ids", show_progress=True)
            return np.array([len(ids) for ids in tokens], dtype=np.int32)

        return self.derived("lengths", count)

    def derived(self, name: str, make: Callable[[], Any]) -> Any:
        """`make()`'s result, made once for this index (what scoring it beside writes reads: retrieval.bm25_changes)."""
        with self._deriving:
            if name not in self._derived:
                self._derived[name] = make()
            return self._derived[name]

    def search(self, queries: Sequence[str], k: int) -> list[list[tuple[int, float]]]:
        """Best first (by score, then row), at most k (row, score) per query; no list ever holds a passage sharing
        no term."""
        return self.search_among(queries, k, None)

    def search_among(self, queries: Sequence[str], k: int, mask: np.ndarray | None) -> list[list[tuple[int, float]]]:
        """As `search`, among the rows `mask` keeps (retrieval.filtered_search; None: all): every passage's score
        computed as `search` computes it, the others' dropped, the first k by score and then row (so equal scores
        are ordered alike however many rows the mask keeps)."""
        return [list(zip(rows.tolist(), scores.tolist())) for rows, scores in self.search_arrays(queries, k, mask)]

    def search_arrays(self, queries: Sequence[str], k: int,
                      mask: np.ndarray | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """`search_among`'s answer as arrays: (rows, scores) per query."""
        tokens = self.tokenizer.tokenize(list(queries), update_vocab=False, return_as="ids", show_progress=False)
        known = self.retriever.unique_token_ids_set
        results = []
        for ids in tokens:
            ids = [token for token in ids if token in known]
            if not ids or k <= 0:
                results.append((np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)))
                continue
            scores = self.scores(ids)
            if mask is not None:
                scores = np.where(mask, scores, 0)
            rows = np.flatnonzero(scores > 0)
            if len(rows) > k:  # those scoring at least the k-th score (ties included), then ordered
                kth = np.partition(scores[rows], len(rows) - k)[len(rows) - k]
                rows = rows[scores[rows] >= kth]
            rows = rows[np.lexsort((rows, -scores[rows]))][:k]
            results.append((rows.astype(np.int64), scores[rows]))
        return results

    def scores(self, ids: list[int]) -> np.ndarray:
        """Every passage's score for a query's known token ids: bm25s's get_scores, summed token by token in its
        order and dtype, with a slice add where it calls np.add.at (a token's postings name a passage once, so
        the sums are the same bits)."""
        retriever = self.retriever
        if retriever.nonoccurrence_array is not None:  # variants that score absent terms: bm25s's own way
            return np.asarray(retriever.get_scores(ids))
        data, indices, indptr = (retriever.scores[name] for name in ("data", "indices", "indptr"))
        scores = np.zeros(self.count, dtype=np.dtype(retriever.dtype))
        for token in ids:
            start, end = indptr[token], indptr[token + 1]
            scores[indices[start:end]] += data[start:end]
        return scores
