"""How much the z-score hybrid would gain from weighting its two lists, chosen honestly:

    python bench/fusion_weight.py --index INDEX --queries Q --qrels R --folds 5
    python bench/fusion_weight.py --index INDEX --queries DEV_Q --qrels DEV_R \
        --choose-queries TRAIN_Q --choose-qrels TRAIN_R

The hybrid's z-score fusion is the mean of each passage's standardised dense and BM25 scores, a dense weight
of 0.5; this fuses `w * dense + (1 - w) * bm25` instead (a list lacking a passage counts its lowest, as the
service does) for w in 0, 0.05, ..., 1. Each query's dense and BM25 top 1000 are searched once (exact), and
the weight 0.5 is checked to give the service's hybrid-zscore top 10 for every query. The weight is chosen on
queries that do not report: on the other folds of `--queries` (`--folds N`, seeded), or on
`--choose-queries` once, reported on `--queries`. Prints each choice, its held-out nDCG@10 against 0.5's, and
the pooled difference with a paired bootstrap 95% interval over the reported queries.
"""
import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.encoder import BiEncoder  # noqa: E402
from retrieval.evaluation import paired_bootstrap, per_query  # noqa: E402
from retrieval.fusion import standardised_score_fusion  # noqa: E402
from retrieval.load_options import LoadOptions  # noqa: E402
from retrieval.readers import read_qrels, read_queries  # noqa: E402
from retrieval.searcher import Searcher  # noqa: E402

DEPTH = 1000
WEIGHTS = [round(w, 2) for w in np.linspace(0, 1, 21)]
SERVICE_WEIGHT = 0.5


def weighted_fusion(dense: list[tuple[str, float]], bm25: list[tuple[str, float]], weight: float,
                    k: int = 10) -> list[tuple[str, float]]:
    """The service's z-score fusion with the dense list weighted `weight` and BM25 `1 - weight`."""
    return standardised_score_fusion([dense, bm25], k, (weight, 1.0 - weight))


def lists(searcher: Searcher, queries: dict[str, str], batch: int = 32) -> dict[str, tuple[list, list]]:
    """Each query's exact dense and BM25 top DEPTH, checking that weight 0.5 is the service's hybrid."""
    ids, out = list(queries), {}
    for start in tqdm(range(0, len(ids), batch), desc="search", unit="batch", total=-(-len(ids) // batch)):
        chunk = ids[start:start + batch]
        texts = [queries[q] for q in chunk]
        dense = searcher.batch_search(texts, DEPTH, mode="dense", exact=True)
        bm25 = searcher.batch_search(texts, DEPTH, mode="bm25")
        hybrid = searcher.batch_search(texts, 10, mode="hybrid", fusion="zscore", exact=True)
        for q, d, b, h in zip(chunk, dense, bm25, hybrid):
            pairs = [(hit.id, hit.score) for hit in d], [(hit.id, hit.score) for hit in b]
            if [docid for docid, _ in weighted_fusion(*pairs, SERVICE_WEIGHT)] != [hit.id for hit in h]:
                sys.exit(f"error: query {q}: weight 0.5 is not the service's hybrid-zscore; the fusion changed")
            out[q] = pairs
    return out


def values(qrels, found: dict[str, tuple[list, list]]) -> dict[float, dict[str, float]]:
    """nDCG@10 of each query under each weight."""
    return {w: per_query(qrels, {q: weighted_fusion(d, b, w) for q, (d, b) in found.items()}) for w in WEIGHTS}


def best(by_weight: dict[float, dict[str, float]], queries: list[str]) -> float:
    """The weight with the highest mean over `queries` (the nearest to 0.5 among ties)."""
    return max(WEIGHTS, key=lambda w: (np.mean([by_weight[w][q] for q in queries]), -abs(w - SERVICE_WEIGHT)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", type=Path, required=True, help="an index built with BM25")
    parser.add_argument("--queries", type=Path, required=True, help="the queries that report")
    parser.add_argument("--qrels", type=Path, required=True)
    parser.add_argument("--folds", type=int, default=5, help="cross-validate over --queries (without --choose-*)")
    parser.add_argument("--choose-queries", type=Path, help="choose the weight on these queries instead")
    parser.add_argument("--choose-qrels", type=Path)
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
    started = time.perf_counter()
    searcher = Searcher(args.index, BiEncoder(device=args.device), load=LoadOptions(device=args.device))
    qrels = read_qrels(args.qrels)
    queries = {q: text for q, text in read_queries(args.queries).items() if q in qrels}
    reported = values(qrels, lists(searcher, queries))
    chosen: dict[str, float] = {}
    if args.choose_queries:
        choose_qrels = read_qrels(args.choose_qrels)
        choosing = {q: text for q, text in read_queries(args.choose_queries).items() if q in choose_qrels}
        weight = best(values(choose_qrels, lists(searcher, choosing)), list(choosing))
        chosen = {q: reported[weight][q] for q in queries}
        print(f"chosen on {len(choosing)} queries of {args.choose_queries.name}: dense weight {weight}")
    else:
        order = sorted(queries)
        random.Random(args.seed).shuffle(order)
        for fold in range(args.folds):
            held_out = order[fold::args.folds]
            rest = sorted(set(order) - set(held_out))
            weight = best(reported, rest)
            chosen.update({q: reported[weight][q] for q in held_out})
            gain = np.mean([reported[weight][q] - reported[SERVICE_WEIGHT][q] for q in held_out])
            print(f"fold {fold + 1} of {args.folds}: dense weight {weight} chosen on {len(rest)} queries, "
                  f"held out {len(held_out)}: {gain:+.4f}")
    means = " ".join(f"{w}:{np.mean(list(reported[w].values())):.4f}" for w in WEIGHTS)
    print(f"nDCG@10 by dense weight on the reported queries (for reading, not choosing): {means}")
    difference = paired_bootstrap(reported[SERVICE_WEIGHT], chosen)
    print(f"fusion_weight: chosen weights against the service's 0.5 on {len(queries)} reported queries: "
          f"{difference.base:.4f} -> {difference.other:.4f}, difference {difference} "
          f"in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
