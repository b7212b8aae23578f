"""One search's retrieval as a typed value: made and checked once where a search enters (Searcher.request, for
the Python API, eval and the service's plan), then read unchanged by every layer below, so an option is
either one of these fields or refused where it is written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from retrieval.feedback import Feedback
from retrieval.filters import Filter
from retrieval.fusion import FUSION_RULES

MAX_K = 1000
EVEN_WEIGHT = 0.5  # z-score fusion's dense weight when nothing names one: the mean of the two lists
Mode = Literal["dense", "bm25", "hybrid"]
Fusion = Literal[tuple(FUSION_RULES)]  # "interleave", "rrf", "zscore"
Lead = Literal["dense", "bm25"]
MODES: tuple[str, ...] = get_args(Mode)
FUSIONS: tuple[str, ...] = get_args(Fusion)
LEADS: tuple[str, ...] = get_args(Lead)


@dataclass(frozen=True)
class Defaults:
    """What a search that names no `mode` or `fusion` runs: `mode` (None: the index's own, hybrid where it has
    BM25 and dense otherwise), its lists fused by `fusion`. Hybrid z-score leads on every collection measured
    (docs/evaluation.md). `dense_weight` and `feedback`: a z-score hybrid's where the search names none (see
    Retrieval)."""

    mode: Mode | None = None
    fusion: Fusion = "zscore"
    dense_weight: float = EVEN_WEIGHT
    feedback: Feedback | None = None

    def resolve(self, mode: Mode | None, fusion: Fusion | None, has_bm25: bool) -> tuple[Mode, Fusion]:
        """The mode and fusion a search runs that names `mode` and `fusion` (None: this default) on an index
        with (or without) BM25."""
        return mode or self.mode or ("hybrid" if has_bm25 else "dense"), fusion or self.fusion


@dataclass(frozen=True)
class Retrieval:
    """`k` passages by `mode` ("dense", "bm25" or "hybrid", its lists combined by `fusion`: "interleave", paper
    000 eq. 6, `lead` going first; "rrf" or "zscore" over each list's top `fusion_depth`). The dense list: the
    exact scan where `exact` or no candidate structure is loaded, else `structure`'s (None: the first loaded)
    `candidates` rows per query (None: its recorded depth) scored exactly. Hybrid z-score only: the dense list
    weighs `dense_weight` in the fusion and BM25's `1 - dense_weight`; with `feedback` (retrieval.feedback), the
    dense list is searched again from the even fusion's top passages and fused anew. `filter`: only the
    passages it matches, parsed against the index. `fields`: the metadata fields each hit carries (None: none).
    Frozen and hashable: equal retrievals may share one search (the micro-batcher fuses them)."""

    k: int
    mode: Mode = "dense"
    fusion: Fusion = "interleave"
    lead: Lead = "dense"
    exact: bool = False
    candidates: int | None = None
    structure: str | None = None
    filter: Filter | None = None
    fields: tuple[str, ...] | None = None
    fusion_depth: int = MAX_K
    dense_weight: float = EVEN_WEIGHT
    feedback: Feedback | None = None
    defaulted: bool = False  # `mode` is the searcher's default, not named: another generation resolves it afresh

    @property
    def reads_dense(self) -> bool:
        """Whether it encodes its queries: every mode but bm25."""
        return self.mode != "bm25"

    @property
    def weighs(self) -> bool:
        """Whether `dense_weight` and `feedback` apply: a hybrid z-score search."""
        return self.mode == "hybrid" and self.fusion == "zscore"
