"""A structure's recall card: the share of the exact search's top k its own answer holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import faiss
import numpy as np

from retrieval import dense_index
from retrieval.candidates.kind import SEED, Structure
from retrieval.candidates.structures import search

RECALL_SAMPLE = 1000
RECALL_THRESHOLD = 0.98
HELD_OUT = "held-out passages"


@dataclass
class RecallCard:
    recall_at_10: float
    recall_at_100: float
    queries: str  # HELD_OUT or the caller's name for its queries
    sample: int


def measure_recall(structure: Structure, flat: faiss.IndexFlat, query_vectors: np.ndarray | None = None, *,
                   queries: str = HELD_OUT, sample: int = RECALL_SAMPLE, seed: int = SEED) -> RecallCard:
    """Recall@10 and @100 of `search` at the structure's depth (at least k) against the exact flat search:
    the share of the exact top k the approximate top k holds, averaged over the queries. Queries: the
    `query_vectors` given, else `sample` stored vectors drawn with `seed`, each searched with itself
    excluded (its own row dropped from both lists), so a passage does not count as finding itself."""
    held_out = query_vectors is None
    if flat.ntotal == 0:  # an empty shard: nothing to miss
        return RecallCard(1.0, 1.0, queries, 0)
    if held_out:
        own = np.sort(np.random.default_rng(seed).choice(flat.ntotal, size=min(sample, flat.ntotal), replace=False))
        query_vectors = flat.reconstruct_batch(own)
    vectors = np.ascontiguousarray(query_vectors, dtype=np.float32)

    # One exact search, at the deeper list, serves both k: the scan of every row is the card's cost.
    deepest = min(100, flat.ntotal - held_out)
    exact_rows = dense_index.search(flat, vectors, deepest + held_out)[1] if deepest >= 1 and len(vectors) else None

    def recall(k: int) -> float:
        k = min(k, flat.ntotal - held_out)
        if k < 1 or len(vectors) == 0:
            return 1.0
        fetch = k + held_out
        exact = exact_rows[:, :fetch]
        found = search(structure, flat, vectors, fetch, max(structure.depth, fetch))[1]
        if held_out:
            exact, found = _without(exact, own, k), _without(found, own, k)
        return share_found(exact.tolist(), found.tolist(), k)

    return RecallCard(recall(10), recall(100), queries, len(vectors))


def share_found(exact: Sequence[Sequence], found: Sequence[Sequence], k: int) -> float:
    """Recall@k against the exact search: the mean, over the queries, of the share of the exact list's first
    k that the found list's first k holds (lists of row numbers or ids, one pair a query); a query whose
    exact list is empty is left out, and none left gives 1.0."""
    shares = [len(set(truth[:k]) & set(answer[:k])) / len(truth[:k]) for truth, answer in zip(exact, found)
              if len(truth[:k])]
    return float(np.mean(shares)) if shares else 1.0


def _without(rows: np.ndarray, own: np.ndarray, k: int) -> np.ndarray:
    """Each query's first k rows other than its own."""
    return np.array([[row for row in ranked if row != mine][:k] for ranked, mine in zip(rows.tolist(), own.tolist())])
