"""A paired bootstrap interval for the difference between two runs on the same queries:

    python bench/bootstrap.py --qrels QRELS --base BASE.run --runs OTHER.run [OTHER.run ...] [--measure nDCG@10]

Each run is scored per query (retrieval.evaluation's measures and convention: the queries of the base run
that have judgements, a query a run lacks counting 0); the queries are resampled with replacement
`--samples` times (seeded) and the mean difference OTHER - BASE taken each time: its 2.5th and 97.5th
percentiles are the 95% interval. An interval that holds 0 is no evidence of a difference. Write the runs
with `eval --runs-dir DIR` (one ROW.run per row).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retrieval.evaluation import MEASURES, paired_bootstrap, per_query  # noqa: E402
from retrieval.readers import read_qrels, read_run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qrels", type=Path, required=True)
    parser.add_argument("--base", type=Path, required=True, help="the run the others are compared with")
    parser.add_argument("--runs", type=Path, nargs="+", required=True)
    parser.add_argument("--measure", default="nDCG@10", choices=list(MEASURES))
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    qrels = read_qrels(args.qrels)
    base = per_query(qrels, read_run(args.base), args.measure)
    print(f"{args.measure} over {len(base)} judged queries of {args.base.name} "
          f"({sum(base.values()) / len(base):.4f}); paired bootstrap, {args.samples} samples")
    for path in args.runs:
        difference = paired_bootstrap(base, per_query(qrels, read_run(path), args.measure), args.samples, args.seed)
        print(f"{path.name}: {difference.other:.4f}, difference {difference}")


if __name__ == "__main__":
    main()
