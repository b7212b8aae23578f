"""A paired bootstrap interval for the difference between two runs on the same queries:

    python bench/bootstrap.py --qrels QRELS --base BASE.run --runs OTHER.run [OTHER.run ...] [--measure nDCG@10]

Each run is scored per query (index_builder.evaluate's measures and convention: the queries of the base run
that have judgements, a query a run lacks counting 0); the queries are resampled with replacement
`--samples` times (seeded) and the mean difference OTHER - BASE taken each time: its 2.5th and 97.5th
percentiles are the 95% interval. An interval that holds 0 is no evidence of a difference. Write the runs
with `eval --runs-dir DIR` (one ROW.run per row).
"""
import argparse
import sys
from pathlib import Path

import ir_measures
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from index_builder.evaluate import MEASURES  # noqa: E402
from retrieval.readers import read_qrels, read_run  # noqa: E402


def per_query(qrels: dict, run: dict, measure) -> dict[str, float]:
    """`measure` of each judged query of `run`, each list scored in its own order (as evaluate.metrics does)."""
    scored = [ir_measures.ScoredDoc(qid, docid, float(-rank)) for qid, ranked in run.items()
              for rank, (docid, _) in enumerate(ranked)]
    return {row.query_id: row.value for row in ir_measures.iter_calc([measure], qrels, scored)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qrels", type=Path, required=True)
    parser.add_argument("--base", type=Path, required=True, help="the run the others are compared with")
    parser.add_argument("--runs", type=Path, nargs="+", required=True)
    parser.add_argument("--measure", default="nDCG@10", choices=list(MEASURES))
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    base_run = read_run(args.base)
    qrels = {qid: judged for qid, judged in read_qrels(args.qrels).items() if qid in base_run}
    queries = sorted(qrels)
    base = per_query(qrels, base_run, MEASURES[args.measure])
    draws = np.random.default_rng(args.seed).integers(0, len(queries), size=(args.samples, len(queries)))
    print(f"{args.measure} over {len(queries)} judged queries of {args.base.name} "
          f"({np.mean([base.get(q, 0.0) for q in queries]):.4f}); paired bootstrap, {args.samples} samples")
    for path in args.runs:
        other = per_query(qrels, read_run(path), MEASURES[args.measure])
        differences = np.array([other.get(q, 0.0) - base.get(q, 0.0) for q in queries])
        means = differences[draws].mean(axis=1)
        low, high = np.percentile(means, [2.5, 97.5])
        print(f"{path.name}: {np.mean([other.get(q, 0.0) for q in queries]):.4f}, difference "
              f"{differences.mean():+.4f} (95% interval {low:+.4f} to {high:+.4f}; better on "
              f"{int((differences > 0).sum())} queries, worse on {int((differences < 0).sum())})")


if __name__ == "__main__":
    main()
