"""A query set searched and scored: each query's hits as a run, ir-measures' measures of a run (pytrec_eval
underneath, never code of our own), per query, and a paired bootstrap interval for the difference between two
runs. For `eval` (index_builder) and the training recipe alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import ir_measures
import numpy as np
from ir_measures import AP, RR, R, nDCG

from retrieval.readers import Qrels, Run
from retrieval.searcher import Hit, Searcher

MEASURES = {"MRR@10": RR @ 10, "nDCG@10": nDCG @ 10, "Recall@100": R @ 100, "Recall@1000": R @ 1000, "MAP": AP}


def mode_name(mode: str, fusion: str) -> str:
    """The name of `mode` fused by `fusion` as eval's table rows name them: dense, bm25, hybrid-FUSION."""
    return f"hybrid-{fusion}" if mode == "hybrid" else mode


def retrieve(searcher: Searcher, queries: Mapping[str, str], k: int, batch_size: int = 64,
             **retrieval) -> dict[str, list[Hit]]:
    """Each query's top k hits, with their texts; `retrieval`: the Searcher's mode, fusion and lead."""
    hits: dict[str, list[Hit]] = {}
    ids = list(queries)
    request = searcher.request(k, **retrieval)  # checked once, for every batch
    for start in range(0, len(ids), batch_size):
        part = ids[start : start + batch_size]
        hits.update(zip(part, searcher.run([queries[q] for q in part], request)))
    return hits


def as_run(hits: Mapping[str, list[Hit]]) -> Run:
    return {qid: [(hit.id, hit.score) for hit in found] for qid, found in hits.items()}


def run_queries(searcher: Searcher, queries: Mapping[str, str], k: int, batch_size: int = 64, **retrieval) -> Run:
    """`retrieve`'s hits as a run."""
    return as_run(retrieve(searcher, queries, k, batch_size, **retrieval))


def metrics(qrels: Qrels, run: Run) -> dict[str, float]:
    """The issue's measures, averaged over the run's queries that have judgements (trec_eval's
    convention); a query of the run with no hits counts 0. Judged queries the run does not hold are left
    out: ir-measures alone would count each as 0, so evaluating a subset of a qrels file's queries would
    read lower than it is. Each list is scored in its own order, not by its scores: trec_eval sorts by
    score and breaks exact ties by passage id, which would rank RRF's many ties otherwise than we answer."""
    qrels = {qid: judged for qid, judged in qrels.items() if qid in run}
    scored = [
        ir_measures.ScoredDoc(qid, docid, float(-rank))
        for qid, ranked in run.items()
        for rank, (docid, _) in enumerate(ranked)
    ]
    values = ir_measures.calc_aggregate(list(MEASURES.values()), qrels, scored)
    return {name: values[measure] for name, measure in MEASURES.items()}


def per_query(qrels: Qrels, run: Run, measure: str = "nDCG@10") -> dict[str, float]:
    """`measure` (a MEASURES name) of each query of `run` that has judgements, each list scored in its own
    order (as `metrics`); a judged query the run holds with no hits counts 0."""
    scored = [ir_measures.ScoredDoc(qid, docid, float(-rank)) for qid, ranked in run.items()
              for rank, (docid, _) in enumerate(ranked)]
    judged = {qid: judgements for qid, judgements in qrels.items() if qid in run}
    values = {row.query_id: row.value for row in ir_measures.iter_calc([MEASURES[measure]], judged, scored)}
    return {qid: values.get(qid, 0.0) for qid in judged}


@dataclass(frozen=True)
class Difference:
    """A paired bootstrap over queries of `other - base` (one measure's per-query values): the mean
    difference and its 95% interval; an interval that holds 0 is no evidence of a difference."""

    base: float
    other: float
    mean: float
    low: float
    high: float
    better: int  # queries where other scores higher
    worse: int

    @property
    def real(self) -> bool:
        return self.low > 0 or self.high < 0

    def __str__(self) -> str:
        return (f"{self.mean:+.4f} (95% interval {self.low:+.4f} to {self.high:+.4f}; better on {self.better} "
                f"queries, worse on {self.worse})")


def paired_bootstrap(base: Mapping[str, float], other: Mapping[str, float], samples: int = 10_000,
                     seed: int = 0) -> Difference:
    """`base`'s queries resampled with replacement `samples` times (seeded), the mean of other - base taken
    each time (a query `other` lacks counting 0): its 2.5th and 97.5th percentiles are the interval."""
    queries = sorted(base)
    differences = np.array([other.get(q, 0.0) - base[q] for q in queries])
    draws = np.random.default_rng(seed).integers(0, len(queries), size=(samples, len(queries)))
    low, high = np.percentile(differences[draws].mean(axis=1), [2.5, 97.5])
    return Difference(float(np.mean([base[q] for q in queries])), float(np.mean([other.get(q, 0.0) for q in queries])),
                      float(differences.mean()), float(low), float(high), int((differences > 0).sum()),
                      int((differences < 0).sum()))
