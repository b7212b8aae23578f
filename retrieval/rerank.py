"""The rerank stage: a reranker rescores retrieved hits and the best k are kept. One implementation
for the service's engine and for offline evaluation, so both rank alike."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from models.reranker import Reranker
from retrieval.fusion import standardised
from retrieval.searcher import Hit

BLEND = "blend"  # the score kind of a blended order


def rerank(reranker: Reranker, query: str, hits: list[Hit], k: int, retrieval_weight: float = 0.0,
           depth: int | None = None) -> list[Hit]:
    """The best `k` of `hits`' top `depth` (default: all of them) by `reranker`'s score, or by its blend with
    the first stage's (`rescored`)."""
    head = hits[:depth]
    return rescored(hits, reranker.score(query, [hit.text for hit in head]), k, retrieval_weight)


def rescored(hits: list[Hit], scores: Sequence[float], k: int, retrieval_weight: float = 0.0) -> list[Hit]:
    """`hits`' first len(`scores`), which a reranker scored, ordered by `reordered`; with fewer than `k` of
    them, the next hits follow in retrieval order: `score` and `retrieval_score` the first stage's, no
    `rerank_score`."""
    top = reordered(hits[:len(scores)], scores, k, retrieval_weight)
    tail = hits[len(scores):k]
    return top + [replace(hit, rank=rank, retrieval_score=hit.score) for rank, hit in enumerate(tail, len(top) + 1)]


def reordered(hits: list[Hit], scores: Sequence[float], k: int, retrieval_weight: float = 0.0) -> list[Hit]:
    """The best `k` of `hits` given their reranker `scores` (ties keep retrieval order). With a
    `retrieval_weight` w > 0 the order is by z(reranker) + w * z(first stage), each score standardised over
    these hits (their mean subtracted, divided by their standard deviation): the two kinds of score are on
    unrelated scales, and a first stage that agrees with the reranker is evidence too. `score` is what the
    order is by; the reranker's own is `rerank_score`, the first stage's `retrieval_score`."""
    scores = np.asarray(scores, dtype=np.float64)
    if retrieval_weight:
        first = np.array([hit.score for hit in hits], dtype=np.float64)
        value = standardised(scores) + retrieval_weight * standardised(first)
    else:
        value = scores
    order = sorted(range(len(hits)), key=lambda i: (-value[i], i))[:k]
    return [
        replace(hits[i], score=float(value[i]), rank=rank, retrieval_score=hits[i].score,
                rerank_score=float(scores[i]))
        for rank, i in enumerate(order, start=1)
    ]


def reranked_list(hits: list[Hit], scores: Sequence[float], k: int, weight: float) -> list[tuple[str, float]]:
    """One list of a reranked run: `hits`' first len(`scores`) ordered as the service orders them
    (`rescored`), the rest of the top `k` after them in retrieval order, each tail hit's
    score put below every reranked score."""
    ranked = rescored(hits, scores, k, weight)
    scored = min(len(scores), k)
    top = [(hit.id, hit.score) for hit in ranked[:scored]]
    floor = min((score for _, score in top), default=0.0)
    return top + [(hit.id, floor - i) for i, hit in enumerate(ranked[scored:], start=1)]
