"""Offline evaluation: the rows `eval` compares, reranked runs, and the measures no library offers: the
consistency factor of paper 000 (eq. 5) and an approximate row's recall against the exact row. The runs and
their ir-measures scores are retrieval.evaluation's; the files are read by `retrieval.readers`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
from tqdm import tqdm

from models.reranker import Reranker
from retrieval.candidates import recall
from retrieval.fusion import FUSION_RULES, standardised
from retrieval.readers import Run
from retrieval.rerank import reranked_list
from retrieval.searcher import Hit

CONSISTENCY_DEPTHS = (10, 100, 1000)


def _eval_modes() -> dict[str, dict]:
    """Each retriever alone, then a row per fusion rule (retrieval.fusion.FUSION_RULES), and one more with BM25
    first for a rule that `lead` changes: {row name: the Searcher's mode, fusion and lead}."""
    modes: dict[str, dict] = {"dense": {"mode": "dense"}, "bm25": {"mode": "bm25"}}
    for name, rule in FUSION_RULES.items():
        modes[f"hybrid-{name}"] = {"mode": "hybrid", "fusion": name, **({"lead": "dense"} if rule.led else {})}
        if rule.led:
            modes[f"hybrid-{name}-bm25-first"] = {"mode": "hybrid", "fusion": name, "lead": "bm25"}
    return modes


EVAL_MODES = _eval_modes()  # what `eval --modes` can compare; interleaving in both orders (paper 000 eq. 6)


APPROXIMATE = "@"  # MODE@KIND: the mode's row answered through the candidate structure KIND
RECALL_AGAINST_EXACT = "R@10 vs exact"  # the table's column: recall_against_exact at depth 10


@dataclass(frozen=True)
class EvalRow:
    """One retrieval row of `eval`'s table: a mode answered exactly (every vector scanned, even where the
    index carries candidate structures), named as the mode, or through one structure, named MODE@KIND."""

    mode: str
    structure: str | None = None

    @property
    def name(self) -> str:
        return self.mode if self.structure is None else f"{self.mode}{APPROXIMATE}{self.structure}"

    @property
    def retrieval(self) -> dict:
        """The Searcher's options for this row."""
        if self.structure is None:
            return {**EVAL_MODES[self.mode], "exact": True}
        return {**EVAL_MODES[self.mode], "structure": self.structure}


def eval_rows(modes: Sequence[str], structures: Sequence[str]) -> list[EvalRow]:
    """Each mode's exact row, followed, for a mode that reads the dense list (all but bm25), by a row per
    candidate structure."""
    return [row for mode in modes for row in [EvalRow(mode)] + [
        EvalRow(mode, kind) for kind in structures if EVAL_MODES[mode]["mode"] != "bm25"]]


def rerank_runs(reranker: Reranker, queries: Mapping[str, str], retrieved: Mapping[str, list[Hit]], depth: int,
                k: int, weights: Sequence[float] = (0.0,), label: str = "reranking") -> dict[float, Run]:
    """For each retrieval weight (retrieval.rerank.rescored; 0: the reranker's score alone), each retrieved
    list's top `depth` rescored by `reranker` and ordered as the service orders them; the reranker reads each
    list once for all the weights. The rest of its top `k` follows in retrieval order, so a measure deeper
    than `depth` (Recall@100 after reranking 20) sees the same passages as the retrieval row. A tail hit's
    score is put below every reranked score (the two kinds of score are not comparable, and a run is ordered
    by score)."""
    runs: dict[float, Run] = {weight: {} for weight in weights}
    for qid, hits in tqdm(retrieved.items(), desc=label, unit=" queries", leave=False):
        scores = reranker.score(queries[qid], [hit.text for hit in hits[:depth]])
        for weight, run in runs.items():
            run[qid] = reranked_list(hits, scores, k, weight)
    return runs


class Remembered:
    """A reranker that keeps its score of each list, so an ensemble row reads them without the model again."""

    def __init__(self, reranker: Reranker):
        self.reranker = reranker
        self.name, self.score_kind = reranker.name, reranker.score_kind
        self._kept: dict[tuple[str, tuple[str, ...]], np.ndarray] = {}

    def score(self, query: str, passages: Sequence[str]) -> np.ndarray:
        key = (query, tuple(passages))
        if key not in self._kept:
            self._kept[key] = self.reranker.score(query, passages)
        return self._kept[key]


class Ensemble:
    """`eval --ensemble`: several rerankers as one, a passage's score the mean of their standardised scores."""

    name = "ensemble"
    score_kind = "z_score"

    def __init__(self, members: Sequence[Remembered]):
        self.members = list(members)

    def score(self, query: str, passages: Sequence[str]) -> np.ndarray:
        return np.mean([standardised(np.asarray(member.score(query, passages), dtype=np.float64))
                        for member in self.members], axis=0).astype(np.float32)


def consistency_factor(run: Run, reference: Run, depth: int, reference_depth: int = 1000) -> float:
    """C(f, n), paper 000 eq. 5: the mean share of f's top-n that is also in the reference's top-1000."""
    shares = []
    for qid, ranked in run.items():
        top = [docid for docid, _ in ranked[:depth]]
        if not top:
            continue
        pool = {docid for docid, _ in reference.get(qid, [])[:reference_depth]}
        shares.append(sum(docid in pool for docid in top) / len(top))
    return sum(shares) / len(shares) if shares else 0.0


def recall_against_exact(run: Run, exact: Run, depth: int = 10) -> float:
    """A candidate structure's recall@depth on these queries and this row's lists (recall.share_found,
    the measure of its recall card); a query the exact run found nothing for is left out."""
    return recall.share_found([[docid for docid, _ in ranked] for ranked in exact.values()],
                              [[docid for docid, _ in run.get(qid, [])] for qid in exact], depth)


def format_table(rows: Mapping[str, Mapping[str, float | None]]) -> str:
    """One line per system, one column per measure; a measure a row does not have (None) is shown as -."""
    columns = list(next(iter(rows.values())))
    widths = [max(11, len(c)) for c in columns]
    width = max(len(name) for name in rows) + 2

    def cell(value: float | None, column: str, size: int) -> str:
        if value is None:
            return f"{'-':>{size}}"
        return f"{value:>{size}.1f}" if column.startswith("ms") else f"{value:>{size}.4f}"

    lines = [" " * width + "  ".join(f"{c:>{w}}" for c, w in zip(columns, widths))]
    for name, values in rows.items():
        lines.append(f"{name:<{width}}" + "  ".join(cell(values[c], c, w) for c, w in zip(columns, widths)))
    return "\n".join(lines)

