"""Whether held-out pairs choose as judgements would (issue 78). For a finished unjudged recipe
(`python -m training.recipe --corpus C --out DIR`), its candidates (the packaged model and each checkpoint kept,
each with DIR/choice's index) are ranked three ways by dense nDCG@10 over the choice corpus:
- by the recipe's own held-out pairs (its unjudged.json),
- by questions SmolLM2 writes for the same held-out passages (training.questions, after its two examples), kept
  where BM25 over the corpus ranks their passage in its top 100 (the round-trip filter),
- by the judged queries given, where the choice corpus is the whole corpus (else not: a judged query's passages
  may be missing from it).

    python bench/unjudged_choice.py --recipe DIR --corpus C [--queries Q --qrels R] [--passages 300] [--seed 13]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import bm25s
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.generated_queries import ranks  # noqa: E402
from retrieval.evaluation import as_run, per_query, retrieve  # noqa: E402
from retrieval.readers import read_passages, read_qrels, read_queries  # noqa: E402
from training.questions import Writer  # noqa: E402
from training.unjudged import SUMMARY_FILE, searcher  # noqa: E402

K = 10


def dense_ndcg(index: Path, queries: dict[str, str], qrels: dict) -> float:
    return statistics.fmean(per_query(qrels, as_run(retrieve(searcher(index, "cpu"), queries, K, mode="dense")))
                            .values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, required=True)
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--queries", type=Path)
    parser.add_argument("--qrels", type=Path)
    parser.add_argument("--passages", type=int, default=300, help="held-out passages given a question, at most")
    parser.add_argument("--seed", type=int, default=13)
    args = parser.parse_args()
    summary = json.loads((args.recipe / SUMMARY_FILE).read_text())
    pairs = read_qrels(args.recipe / "split" / "qrels-dev.txt")
    held_out = sorted({pid for judged in pairs.values() for pid in judged})
    drawn = sorted(np.random.default_rng(args.seed).choice(held_out, size=min(args.passages, len(held_out)),
                                                           replace=False).tolist())
    passages = read_passages(args.corpus)
    ids = sorted(passages)
    started = time.perf_counter()
    questions = Writer().questions([passages[pid] for pid in drawn])
    seconds = time.perf_counter() - started
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize([passages[pid] for pid in ids], stopwords="en", show_progress=False),
                    show_progress=False)
    found = ranks(retriever, questions, [ids.index(pid) for pid in drawn])
    kept = [i for i, rank in enumerate(found) if rank <= 100]
    queries = {f"gen-{drawn[i]}": questions[i] for i in kept}
    qrels = {f"gen-{drawn[i]}": {drawn[i]: 1} for i in kept}
    choice = args.recipe / "choice"
    whole = len((choice / "corpus.tsv").read_text(encoding="utf-8").splitlines()) == len(passages)
    judged = (read_queries(args.queries), read_qrels(args.qrels)) if args.qrels and whole else None
    rows = {}
    for label, pairs in summary["held_out_ndcg@10"].items():
        index = choice / f"index-{label}"
        rows[label] = (pairs, dense_ndcg(index, queries, qrels), dense_ndcg(index, *judged) if judged else None)
    print(f"\n{args.recipe}: {len(drawn)} held-out passages given a question ({seconds / len(drawn):.2f} s each), "
          f"{len(queries)} kept by the round trip; dense nDCG@10 over the choice corpus "
          f"({'the whole corpus' if whole else 'not the whole corpus: judged not measured'}):\n")
    print("| candidate | held-out pairs (the recipe's) | SmolLM2 questions | judged queries |")
    print("|---|---:|---:|---:|")
    for label, (pairs, asked, truth) in rows.items():
        print(f"| {label} | {pairs:.4f} | {asked:.4f} | {'-' if truth is None else f'{truth:.4f}'} |")
    chosen = [max(rows, key=lambda label: round(rows[label][column], 10)) for column in (0, 1)]
    line = f"\nchosen by the held-out pairs: {chosen[0]}; by the questions: {chosen[1]}"
    if judged:
        line += f"; by the judgements: {max(rows, key=lambda label: round(rows[label][2], 10))}"
    print(line)


if __name__ == "__main__":
    main()
