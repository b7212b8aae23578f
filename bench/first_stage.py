"""The z-score hybrid's dense weight and pseudo-relevance feedback, chosen honestly on a collection's own queries:

    python bench/first_stage.py --index INDEX --queries Q --qrels R --folds 5
    python bench/first_stage.py --index INDEX --queries DEV_Q --qrels DEV_R \
        --choose-queries TRAIN_Q --choose-qrels TRAIN_R

Searches each query (exact) through the Searcher under every setting of the grid: the dense weight from 0 to 1 in
steps of 0.05 (`dense_weight`; the service's default 0.5 is the mean of the two lists), with no feedback or with
the even hybrid's top `--feedback-passages` taken as relevant at each `--feedback-weights` (`feedback`,
retrieval.feedback). A setting is chosen on queries that do not report: the other folds of `--queries`
(`--folds N`, seeded), or `--choose-queries` once. The best setting on them is adopted only where its gain over
the default is real on them (its paired bootstrap interval excludes zero); otherwise the default stays
(`--adopt best`: the best setting in any case). Prints each
choice and its held-out difference, the pooled difference from the default with a paired bootstrap 95% interval
over the reported queries, and the SEARCH_DEFAULT_* settings the same rule chooses on all of them (with
`--folds`) or on the choosing queries, to serve this collection with, with its ms per query beside the
default's (p50, one query at a time, encoding included).
"""
import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.encoder import BiEncoder  # noqa: E402
from retrieval.evaluation import paired_bootstrap  # noqa: E402
from retrieval.load_options import LoadOptions  # noqa: E402
from retrieval.readers import read_qrels, read_queries  # noqa: E402
from retrieval.searcher import Searcher  # noqa: E402
from training.first_stage import DEFAULT, FEEDBACK_PASSAGES, FEEDBACK_WEIGHTS, K, Setting, adopted, grid, values  # noqa: E402,E501


def ms_per_query(searcher: Searcher, queries: dict[str, str], setting: Setting) -> float:
    """p50 ms of one query at a time, encoding included, under `setting`."""
    request = searcher.request(K, mode="hybrid", fusion="zscore", exact=True, dense_weight=setting.dense_weight,
                               feedback=setting.feedback or False)
    searcher.run([next(iter(queries.values()))], request)  # warm
    times = []
    for text in queries.values():
        started = time.perf_counter()
        searcher.run([text], request)
        times.append((time.perf_counter() - started) * 1000)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", type=Path, required=True, help="an index built with BM25")
    parser.add_argument("--queries", type=Path, required=True, help="the queries that report")
    parser.add_argument("--qrels", type=Path, required=True)
    parser.add_argument("--folds", type=int, default=5, help="cross-validate over --queries (without --choose-*)")
    parser.add_argument("--choose-queries", type=Path, help="choose on these queries instead")
    parser.add_argument("--choose-qrels", type=Path)
    parser.add_argument("--feedback-passages", type=int, nargs="+", default=list(FEEDBACK_PASSAGES),
                        help="feedback passages to try; 0 alone: the dense weight only")
    parser.add_argument("--feedback-weights", type=float, nargs="+", default=list(FEEDBACK_WEIGHTS))
    parser.add_argument("--adopt", choices=("real", "best"), default="real",
                        help="real: the best setting only where its gain is real on the choosing queries; best: it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if (args.choose_queries is None) != (args.choose_qrels is None):
        parser.error("--choose-queries and --choose-qrels go together")
    for flag in ("index", "queries", "qrels", "choose_queries", "choose_qrels"):
        path = getattr(args, flag)
        if path is not None and not path.exists():
            parser.error(f"--{flag.replace('_', '-')} {path}: no such file or folder")
    if args.folds < 2:
        parser.error(f"--folds must be 2 or more, got {args.folds}")
    try:
        settings = grid(args.feedback_passages, args.feedback_weights)
    except ValueError as error:
        parser.error(str(error))
    only_real = args.adopt == "real"
    started = time.perf_counter()
    searcher = Searcher(args.index, BiEncoder(device=args.device), load=LoadOptions(device=args.device))
    if searcher.bm25 is None:
        parser.error(f"--index {args.index}: no BM25 index (built with --no-bm25)")
    qrels = read_qrels(args.qrels)
    queries = {q: text for q, text in read_queries(args.queries).items() if q in qrels}
    reported = values(searcher, qrels, queries, settings)
    result: dict[str, float] = {}
    if args.choose_queries:
        choose_qrels = read_qrels(args.choose_qrels)
        choosing = {q: text for q, text in read_queries(args.choose_queries).items() if q in choose_qrels}
        serve, why = adopted(values(searcher, choose_qrels, choosing, settings), list(choosing), only_real)
        result = reported[serve]
        print(f"chosen on {len(choosing)} queries of {args.choose_queries.name}: {why}")
    else:
        order = sorted(queries)
        random.Random(args.seed).shuffle(order)
        for fold in range(args.folds):
            held_out = order[fold::args.folds]
            setting, why = adopted(reported, sorted(set(order) - set(held_out)), only_real)
            result.update({q: reported[setting][q] for q in held_out})
            gain = np.mean([reported[setting][q] - reported[DEFAULT][q] for q in held_out])
            print(f"fold {fold + 1} of {args.folds}: {why}; held out {len(held_out)}: {gain:+.4f}")
        serve, why = adopted(reported, order, only_real)
        print(f"on all {len(order)} queries: {why}")
    difference = paired_bootstrap(reported[DEFAULT], result)
    serving = " ".join(f"{name}={value}" for name, value in serve.env().items())
    print(f"to serve: {serving}; ms/query (p50, one at a time): default "
          f"{ms_per_query(searcher, queries, DEFAULT):.1f}, this {ms_per_query(searcher, queries, serve):.1f}")
    print(f"first_stage: chosen settings against the default on {len(queries)} reported queries: "
          f"{difference.base:.4f} -> {difference.other:.4f}, difference {difference}, {len(settings)} settings "
          f"in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
