"""Splits a judged query set once into train and dev parts, grouped by relevant passage, so that no dev
query has a relevant passage that a training query has:

    python -m training.split --queries Q --qrels QRELS --out DIR [--dev-share 0.2] [--seed 13]

Only queries with a relevant judgement are split. Queries that share a relevant passage (SciFact's
claims citing one abstract), directly or through a chain of such queries, form one group; a group is
never cut. The groups, each named by its smallest query id and listed in sorted order, are shuffled
with numpy's generator seeded by `--seed`, and taken in that order into dev while they fit in
`round(dev_share * n)` queries. A reranker scored on dev is thus scored on passages it never saw as
positives, and cannot pass by remembering them.

Writes DIR/queries-{train,dev}.tsv (`qid<TAB>text`) and DIR/qrels-{train,dev}.txt (TREC `qid 0 docid rel`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from retrieval.readers import InputFileError, read_qrels, read_queries, relevant

PARTS = ("train", "dev")


def groups_of(positives: dict[str, set[str]]) -> list[list[str]]:
    """The queries joined by shared relevant passages, each group sorted, the groups by their first id."""
    parent: dict[str, str] = {}

    def root(node: str) -> str:
        while parent.setdefault(node, node) != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for qid, docids in positives.items():
        for docid in docids:
            parent[root(f"query {qid}")] = root(f"passage {docid}")
    members: dict[str, list[str]] = {}
    for qid in sorted(positives):
        members.setdefault(root(f"query {qid}"), []).append(qid)
    return sorted(members.values())


def split_ids(positives: dict[str, set[str]], dev_share: float, seed: int) -> dict[str, list[str]]:
    """{"train": ids, "dev": ids}, each in sorted order; the same judgements, share and seed give the same split."""
    return split_groups(groups_of(positives), dev_share, seed)


def split_groups(groups: list[list[str]], dev_share: float, seed: int) -> dict[str, list[str]]:
    """split_ids over groups_of's groups."""
    ordered = sorted(qid for group in groups for qid in group)
    target = round(dev_share * len(ordered))
    dev: set[str] = set()
    for index in np.random.default_rng(seed).permutation(len(groups)):
        if len(dev) + len(groups[index]) <= target:
            dev.update(groups[index])
    return {"train": [q for q in ordered if q not in dev], "dev": [q for q in ordered if q in dev]}


def write_split(queries: Path, qrels: Path, out: Path, dev_share: float = 0.2, seed: int = 13) -> dict[str, int]:
    """Writes the split files into `out`; returns the number of queries in each part and of groups."""
    if not 0 < dev_share < 1:
        raise InputFileError(f"--dev-share must be between 0 and 1, got {dev_share}")
    texts, judged = read_queries(queries), read_qrels(qrels)
    positives = {qid: docids for qid, docids in relevant(judged).items() if qid in texts}
    if len(positives) < 2:
        raise InputFileError(f"{qrels}: fewer than 2 queries of {queries} have a relevant judgement")
    groups = groups_of(positives)
    parts = split_groups(groups, dev_share, seed)
    if not parts["dev"] or not parts["train"]:
        raise InputFileError(f"{qrels}: no grouped split holds out {dev_share} of the queries: their relevant "
                             f"passages join them into groups too large (the largest has "
                             f"{max(map(len, groups))} of {len(positives)} queries)")
    out.mkdir(parents=True, exist_ok=True)
    for part, ids in parts.items():
        (out / f"queries-{part}.tsv").write_text("".join(f"{q}\t{' '.join(texts[q].split())}\n" for q in ids))
        (out / f"qrels-{part}.txt").write_text(
            "".join(f"{q} 0 {docid} {rel}\n" for q in ids for docid, rel in sorted(judged[q].items())))
    return {**{part: len(ids) for part, ids in parts.items()}, "groups": len(groups)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training.split", description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=Path, required=True, help="TSV qid<TAB>text or BEIR JSONL")
    parser.add_argument("--qrels", type=Path, required=True, help="TREC qrels or BEIR TSV")
    parser.add_argument("--out", type=Path, required=True, help="folder for the split files")
    parser.add_argument("--dev-share", type=float, default=0.2, help="share of the queries held out (default 0.2)")
    parser.add_argument("--seed", type=int, default=13, help="seed of the shuffle of the groups (default 13)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        counts = write_split(args.queries, args.qrels, args.out, args.dev_share, args.seed)
    except (InputFileError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"split {counts['train'] + counts['dev']} judged queries ({counts['groups']} groups sharing no relevant "
          f"passage) into {counts['train']} train and {counts['dev']} dev (seed {args.seed}) in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
