"""Combining two rankings: the interleaving of paper 000 (eq. 6), reciprocal rank fusion, and the mean of
standardised scores.

The first two take ranked lists of hashable keys (passage rows or ids), best first, the third (key, score)
lists; each returns a fused list of (key, score), best first, truncated to `depth`. FUSION_RULES names each as a
hybrid search asks for it (`fusion`), over the dense and the BM25 (key, score) lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np

RRF_K = 60
Scored = Sequence[tuple[Hashable, float]]
RowScores = tuple[np.ndarray, np.ndarray]  # one ranked list as (rows, scores) arrays, best first


def interleave(first: Sequence[Hashable], second: Sequence[Hashable], depth: int) -> list[tuple[Hashable, float]]:
    """Eq. 6: alternate first[0], second[0], first[1], second[1], ...; keep each key at its first
    position; truncate. Order matters: `first` leads. The score is 1/position, only to sort by."""
    merged: list[Hashable] = []
    seen: set[Hashable] = set()
    for position in range(max(len(first), len(second))):
        for ranking in (first, second):
            if position < len(ranking) and ranking[position] not in seen:
                seen.add(ranking[position])
                merged.append(ranking[position])
    return [(key, 1.0 / position) for position, key in enumerate(merged[:depth], start=1)]


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[Hashable]], depth: int, rrf_k: int = RRF_K
) -> list[tuple[Hashable, float]]:
    """RRF (Cormack et al. 2009): score(d) = sum over rankings of 1 / (rrf_k + rank of d), rank from 1.
    Ties keep the order in which keys were first met, so the result is deterministic."""
    scores: dict[Hashable, float] = {}
    for ranking in rankings:
        for rank, key in enumerate(ranking, start=1):
            scores[key] = scores.get(key, 0.0) + 1.0 / (rrf_k + rank)
    return sorted(scores.items(), key=lambda item: -item[1])[:depth]


def standardised_score_fusion(
    scored: Sequence[Sequence[tuple[Hashable, float]]], depth: int, weights: Sequence[float] | None = None
) -> list[tuple[Hashable, float]]:
    """score(d) = the mean over lists of d's z-score in each (its score standardised over that list); a key a
    list lacks counts as that list's lowest. Unlike RRF it keeps how far apart the scores are, so a passage
    far ahead in one list stays ahead. Ties keep the order in which keys were first met. `weights`, one per
    list, make it their weighted sum instead (a hybrid search's `dense_weight`: retrieval.request)."""
    lists = []
    for ranking in scored:
        z = standardised(np.array([score for _, score in ranking], dtype=np.float64))
        lists.append((dict(zip((key for key, _ in ranking), z.tolist())), min(z, default=0.0)))
    keys = list(dict.fromkeys(key for ranking in scored for key, _ in ranking))
    if weights is None:
        fused = {key: sum(z.get(key, floor) for z, floor in lists) / len(scored) for key in keys}
    else:
        fused = {key: sum(w * z.get(key, floor) for w, (z, floor) in zip(weights, lists, strict=True)) for key in keys}
    return sorted(fused.items(), key=lambda item: -item[1])[:depth]


def as_pairs(ranking: RowScores) -> list[tuple[int, float]]:
    """One (rows, scores) list as (row, score) pairs, best first."""
    rows, scores = ranking
    return list(zip(rows.tolist(), scores.tolist()))


def standardised_row_fusion(dense: RowScores, lexical: RowScores, depth: int,
                            dense_weight: float = 0.5) -> list[tuple[int, float]]:
    """`standardised_score_fusion([dense, lexical], depth, (dense_weight, 1 - dense_weight))` over two lists of
    distinct rows given as (rows, scores) arrays, the same answer to the bit (at 0.5, the mean's: halving is
    exact), without a Python step per passage: the hybrid search's hot path, where a thousand (row, score) pairs
    a list cost more in Python than both searches."""
    (dense_rows, dense_scores), (lexical_rows, lexical_scores) = dense, lexical
    dense_z, lexical_z = (standardised(np.asarray(scores, dtype=np.float64)) for scores in (dense_scores, lexical_scores))
    dense_floor = dense_z.min() if len(dense_z) else 0.0
    lexical_floor = lexical_z.min() if len(lexical_z) else 0.0
    # Each dense row's lexical z-score (the floor where the lexical list lacks it), and the lexical rows not in
    # the dense list, in their order: the keys in the order first met, as the reference orders its ties.
    lexical_z_of_dense = np.full(len(dense_rows), lexical_floor)
    lexical_only = np.ones(len(lexical_rows), dtype=bool)
    if len(lexical_rows) and len(dense_rows):
        order = np.argsort(lexical_rows)
        at = np.minimum(np.searchsorted(lexical_rows[order], dense_rows), len(order) - 1)
        shared = lexical_rows[order[at]] == dense_rows
        lexical_z_of_dense[shared] = lexical_z[order[at[shared]]]
        lexical_only[order[at[shared]]] = False
    keys = np.concatenate([dense_rows, lexical_rows[lexical_only]])
    lexical_weight = 1.0 - dense_weight
    fused = np.concatenate([dense_weight * dense_z + lexical_weight * lexical_z_of_dense,
                            dense_weight * dense_floor + lexical_weight * lexical_z[lexical_only]])
    top = np.arange(len(fused))
    if len(fused) > depth:  # those scoring at least the depth-th score (ties included), then ordered
        kth = np.partition(fused, len(fused) - depth)[len(fused) - depth]
        top = np.flatnonzero(fused >= kth)
    top = top[np.argsort(-fused[top], kind="stable")][:depth]
    return list(zip(keys[top].tolist(), fused[top].tolist()))


def standardised(values: np.ndarray) -> np.ndarray:
    """z-scores; all zero where the values are all equal (one hit, or a reranker that cannot tell them apart)
    or there are none."""
    spread = values.std() if len(values) else 0.0
    return (values - values.mean()) / spread if spread > 0 else np.zeros_like(values)


@dataclass(frozen=True)
class FusionRule:
    """How a hybrid search fuses its dense and BM25 lists: `fuse(dense, lexical, depth, lead)`, and whether it
    reads each list deeper than the answer (`deep`: to the request's fusion_depth, since a passage low in one
    list may rise), where interleaving needs only the answer's depth of each; `led`: whether `lead` (which list
    goes first) changes its answer."""

    fuse: Callable[[Scored, Scored, int, str], list[tuple[Hashable, float]]]
    deep: bool
    led: bool = False


def _keys(ranking: Scored) -> list[Hashable]:
    return [key for key, _ in ranking]


FUSION_RULES: dict[str, FusionRule] = {
    "interleave": FusionRule(lambda dense, lexical, depth, lead: interleave(
        *((_keys(dense), _keys(lexical)) if lead == "dense" else (_keys(lexical), _keys(dense))), depth), deep=False,
        led=True),
    "rrf": FusionRule(lambda dense, lexical, depth, lead: reciprocal_rank_fusion([_keys(dense), _keys(lexical)], depth),
                      deep=True),
    "zscore": FusionRule(lambda dense, lexical, depth, lead: standardised_score_fusion([dense, lexical], depth),
                         deep=True),
}
