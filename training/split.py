"""Splits a judged query set once into train and dev parts by a seeded shuffle, so a model is never
scored on a query it trained on:

    python -m training.split --queries Q --qrels QRELS --out DIR [--dev-share 0.2] [--seed 13]

Only queries with a relevant judgement are split. Their ids are sorted, shuffled with numpy's
generator seeded by `--seed`, and the first `round(dev_share * n)` become dev. Writes
DIR/queries-{train,dev}.tsv (`qid<TAB>text`) and DIR/qrels-{train,dev}.txt (TREC `qid 0 docid rel`).

Queries are split, not passages: where several queries share a relevant passage (SciFact has several
claims per abstract), a dev query's passage may have been a training positive. DIR/queries-dev-unseen.tsv
and qrels-dev-unseen.txt hold the dev queries none of whose relevant passages is relevant to a training
query, so a model's gain can be read apart from what it learnt of the passages themselves.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from retrieval.readers import InputFileError, read_qrels, read_queries, relevant

PARTS = ("train", "dev")


def split_ids(query_ids: list[str], dev_share: float, seed: int) -> dict[str, list[str]]:
    """{"train": ids, "dev": ids}, each in sorted order; the same ids, share and seed give the same split."""
    ordered = sorted(query_ids)
    shuffled = [ordered[i] for i in np.random.default_rng(seed).permutation(len(ordered))]
    dev = set(shuffled[: round(dev_share * len(ordered))])
    return {"train": [q for q in ordered if q not in dev], "dev": [q for q in ordered if q in dev]}


def write_split(queries: Path, qrels: Path, out: Path, dev_share: float = 0.2, seed: int = 13) -> dict[str, int]:
    """Writes the split files into `out`; returns the number of queries in each part (train, dev, dev-unseen)."""
    if not 0 < dev_share < 1:
        raise InputFileError(f"--dev-share must be between 0 and 1, got {dev_share}")
    texts, judged = read_queries(queries), read_qrels(qrels)
    positives = relevant(judged)
    usable = [qid for qid in positives if qid in texts]
    if len(usable) < 2:
        raise InputFileError(f"{qrels}: fewer than 2 queries of {queries} have a relevant judgement")
    out.mkdir(parents=True, exist_ok=True)
    parts = split_ids(usable, dev_share, seed)
    trained = set().union(*(positives[q] for q in parts["train"]))
    parts["dev-unseen"] = [q for q in parts["dev"] if not positives[q] & trained]
    for part, ids in parts.items():
        (out / f"queries-{part}.tsv").write_text("".join(f"{q}\t{' '.join(texts[q].split())}\n" for q in ids))
        (out / f"qrels-{part}.txt").write_text(
            "".join(f"{q} 0 {docid} {rel}\n" for q in ids for docid, rel in sorted(judged[q].items())))
    return {part: len(ids) for part, ids in parts.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training.split", description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=Path, required=True, help="TSV qid<TAB>text or BEIR JSONL")
    parser.add_argument("--qrels", type=Path, required=True, help="TREC qrels or BEIR TSV")
    parser.add_argument("--out", type=Path, required=True, help="folder for the split files")
    parser.add_argument("--dev-share", type=float, default=0.2, help="share of the queries held out (default 0.2)")
    parser.add_argument("--seed", type=int, default=13, help="seed of the shuffle (default 13)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        counts = write_split(args.queries, args.qrels, args.out, args.dev_share, args.seed)
    except (InputFileError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"split {counts['train'] + counts['dev']} judged queries into {counts['train']} train and {counts['dev']} "
          f"dev (seed {args.seed}; {counts['dev-unseen']} dev queries share no relevant passage with a train query) "
          f"in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
