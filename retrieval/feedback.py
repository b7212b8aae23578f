"""Pseudo-relevance feedback on the dense list (Rocchio's, on vectors): the even hybrid z-score fusion (the mean of
the two lists) is taken once, its top `passages` as relevant, and the dense list searched again for the query
vector plus `weight` times their mean vector, then fused with the same BM25 list by the search's own weight. It pays where a query has many relevant passages that
resemble each other (Cranfield), not where it has one (SciFact): docs/evaluation.md#feedback."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

MAX_PASSAGES = 100
MAX_WEIGHT = 100.0


@dataclass(frozen=True)
class Feedback:
    """Take the first search's top `passages` (1 to MAX_PASSAGES) as relevant, and add `weight` (0 to MAX_WEIGHT)
    times their mean vector to the query's."""

    passages: int
    weight: float

    def __post_init__(self) -> None:
        if not 1 <= self.passages <= MAX_PASSAGES:
            raise ValueError(f"feedback passages must be between 1 and {MAX_PASSAGES}, got {self.passages}")
        if not 0 <= self.weight <= MAX_WEIGHT:
            raise ValueError(f"feedback weight must be between 0 and {MAX_WEIGHT:g}, got {self.weight}")


def fed_back(vectors: np.ndarray, relevant: Sequence[np.ndarray], weight: float) -> np.ndarray:
    """Each query vector plus `weight` times the mean of its `relevant` passages' vectors (a (count, dimension)
    array each; none: the query's vector unchanged). Not normalised: the fusion standardises the dense scores,
    and a positive scale changes no ranking."""
    out = np.array(vectors, dtype=np.float32, copy=True)
    for position, found in enumerate(relevant):
        if len(found):
            out[position] += np.float32(weight) * np.asarray(found, dtype=np.float32).mean(axis=0)
    return out
