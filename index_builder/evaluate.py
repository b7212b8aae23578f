"""Offline evaluation: query and qrels files in, a TREC run file and trec_eval metrics out.

Metrics are computed by ir-measures (pytrec_eval underneath), never by code of
our own; only the consistency factor of paper 000 (eq. 5), which no library
offers, is written here. The files are read by `retrieval.readers`.
"""

from __future__ import annotations

from typing import Mapping

import ir_measures
from ir_measures import AP, RR, R, nDCG
from tqdm import tqdm

from models.reranker import Reranker
from retrieval.readers import Qrels, Run
from retrieval.rerank import rerank
from retrieval.searcher import Hit, Searcher

MEASURES = {"MRR@10": RR @ 10, "nDCG@10": nDCG @ 10, "Recall@100": R @ 100, "Recall@1000": R @ 1000, "MAP": AP}
CONSISTENCY_DEPTHS = (10, 100, 1000)
# The retrieval set-ups `eval --modes` can compare; hybrid interleaving in both orders (paper 000 eq. 6).
EVAL_MODES = {
    "dense": {"mode": "dense"},
    "bm25": {"mode": "bm25"},
    "hybrid-interleave": {"mode": "hybrid", "fusion": "interleave", "lead": "dense"},
    "hybrid-interleave-bm25-first": {"mode": "hybrid", "fusion": "interleave", "lead": "bm25"},
    "hybrid-rrf": {"mode": "hybrid", "fusion": "rrf"},
}


def retrieve(searcher: Searcher, queries: Mapping[str, str], k: int, batch_size: int = 64,
             **retrieval) -> dict[str, list[Hit]]:
    """Each query's top k hits, with their texts; `retrieval`: the Searcher's mode, fusion and lead."""
    hits: dict[str, list[Hit]] = {}
    ids = list(queries)
    for start in range(0, len(ids), batch_size):
        part = ids[start : start + batch_size]
        hits.update(zip(part, searcher.batch_search([queries[q] for q in part], k, **retrieval)))
    return hits


def as_run(hits: Mapping[str, list[Hit]]) -> Run:
    return {qid: [(hit.id, hit.score) for hit in found] for qid, found in hits.items()}


def run_queries(searcher: Searcher, queries: Mapping[str, str], k: int, batch_size: int = 64, **retrieval) -> Run:
    """`retrieval`: the Searcher's mode, fusion and lead (see EVAL_MODES)."""
    return as_run(retrieve(searcher, queries, k, batch_size, **retrieval))


def rerank_run(reranker: Reranker, queries: Mapping[str, str], retrieved: Mapping[str, list[Hit]], depth: int,
               k: int, label: str = "reranking") -> Run:
    """Each retrieved list's top `depth` rescored by `reranker` and sorted by its score, as the service
    reranks; the rest of its top `k` follows in retrieval order, so a measure deeper than `depth` (Recall@100
    after reranking 20) sees the same passages as the retrieval row. A tail hit's score is put below every
    reranked score (the two kinds of score are not comparable, and a run is ordered by score)."""
    run = {}
    for qid, hits in tqdm(retrieved.items(), desc=label, unit=" queries", leave=False):
        head = [(hit.id, hit.score) for hit in rerank(reranker, queries[qid], hits[:depth], k)]
        floor = min((score for _, score in head), default=0.0)
        run[qid] = head + [(hit.id, floor - i) for i, hit in enumerate(hits[depth:k], start=1)]
    return run


def metrics(qrels: Qrels, run: Run) -> dict[str, float]:
    """The issue's measures, averaged over the run's queries that have judgements (trec_eval's
    convention); a query of the run with no hits counts 0. Judged queries the run does not hold are left
    out: ir-measures alone would count each as 0, so evaluating a subset of a qrels file's queries would
    read lower than it is."""
    qrels = {qid: judged for qid, judged in qrels.items() if qid in run}
    scored = [ir_measures.ScoredDoc(qid, docid, score) for qid, ranked in run.items() for docid, score in ranked]
    values = ir_measures.calc_aggregate(list(MEASURES.values()), qrels, scored)
    return {name: values[measure] for name, measure in MEASURES.items()}


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


def format_table(rows: Mapping[str, Mapping[str, float]]) -> str:
    """One line per system, one column per measure."""
    columns = list(next(iter(rows.values())))
    width = max(len(name) for name in rows) + 2
    lines = [" " * width + "  ".join(f"{c:>11}" for c in columns)]
    for name, values in rows.items():
        lines.append(f"{name:<{width}}" + "  ".join(
            f"{values[c]:>11.1f}" if c.startswith("ms") else f"{values[c]:>11.4f}" for c in columns))
    return "\n".join(lines)

