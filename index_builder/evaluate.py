"""Offline evaluation: query and qrels files in, a TREC run file and trec_eval metrics out.

Metrics are computed by ir-measures (pytrec_eval underneath), never by code of
our own; only the consistency factor of paper 000 (eq. 5), which no library
offers, is written here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

import ir_measures
from ir_measures import AP, RR, R, nDCG

from retrieval.searcher import Searcher

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
Run = dict[str, list[tuple[str, float]]]  # query id -> [(passage id, score)] best first


class EvalInputError(Exception):
    """A query, qrels or run file that cannot be read; the CLI exits 2 with this message."""


def read_queries(path: Path) -> dict[str, str]:
    """TSV `qid<TAB>query` or BEIR JSONL `{"_id", "text"}`, in file order."""
    queries: dict[str, str] = {}
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                record = json.loads(line)
                qid, text = record.get("_id", record.get("id")), record.get("text")
            else:
                qid, _, text = line.rstrip("\r\n").partition("\t")
            if qid is None or not str(qid).strip() or not text or not str(text).strip():
                raise EvalInputError(f"{path}: line {number}: expected a query id and a non-empty query")
            queries[str(qid).strip()] = str(text).strip()
    if not queries:
        raise EvalInputError(f"{path}: no queries")
    return queries


def read_qrels(path: Path) -> list[ir_measures.Qrel]:
    """TREC qrels `qid 0 docid rel`, or BEIR TSV `query-id corpus-id score` (header optional)."""
    qrels = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            fields = line.split()
            if not fields or (number == 1 and fields[0] == "query-id"):
                continue
            if len(fields) == 4:
                qid, _, docid, rel = fields
            elif len(fields) == 3:
                qid, docid, rel = fields
            else:
                raise EvalInputError(f"{path}: line {number}: expected 'qid 0 docid rel' or 'qid docid rel'")
            try:
                qrels.append(ir_measures.Qrel(qid, docid, int(rel)))
            except ValueError:
                raise EvalInputError(f"{path}: line {number}: relevance {rel!r} is not an integer") from None
    return qrels


def run_queries(searcher: Searcher, queries: Mapping[str, str], k: int, batch_size: int = 64, **retrieval) -> Run:
    """`retrieval`: the Searcher's mode, fusion and lead (see EVAL_MODES)."""
    run: Run = {}
    ids = list(queries)
    for start in range(0, len(ids), batch_size):
        part = ids[start : start + batch_size]
        for qid, hits in zip(part, searcher.batch_search([queries[q] for q in part], k, **retrieval)):
            run[qid] = [(hit.id, hit.score) for hit in hits]
    return run


def write_run(path: Path, run: Run, tag: str) -> None:
    """TREC run format: `qid Q0 docid rank score tag`."""
    with path.open("w", encoding="utf-8") as handle:
        for qid, ranked in run.items():
            for rank, (docid, score) in enumerate(ranked, start=1):
                handle.write(f"{qid} Q0 {docid} {rank} {score:.6f} {tag}\n")


def read_run(path: Path) -> Run:
    run: Run = {}
    for doc in ir_measures.read_trec_run(str(path)):
        run.setdefault(doc.query_id, []).append((doc.doc_id, doc.score))
    for ranked in run.values():
        ranked.sort(key=lambda pair: -pair[1])
    return run


def metrics(qrels: Sequence[ir_measures.Qrel], run: Run) -> dict[str, float]:
    """The issue's measures, averaged over the queries that have judgements (trec_eval's convention)."""
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

