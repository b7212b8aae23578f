"""The rerank stage: a reranker rescores retrieved hits and the best k are kept. One implementation
for the service's engine and for offline evaluation, so both rank alike."""

from __future__ import annotations

from dataclasses import replace

from models.reranker import Reranker
from retrieval.searcher import Hit


def rerank(reranker: Reranker, query: str, hits: list[Hit], k: int) -> list[Hit]:
    """The best `k` of `hits` by `reranker`'s score (ties keep retrieval order); the reranker's score
    becomes `score` and the first-stage score is kept as `retrieval_score`."""
    scores = reranker.score(query, [hit.text for hit in hits])
    order = sorted(range(len(hits)), key=lambda i: (-scores[i], i))[:k]
    return [
        replace(hits[i], score=float(scores[i]), rank=rank, retrieval_score=hits[i].score)
        for rank, i in enumerate(order, start=1)
    ]
