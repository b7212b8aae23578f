"""Splits a judged query set once into train and dev parts so that training never sees a dev query's relevant
passage as relevant:

    python -m training.split --queries Q --qrels QRELS --out DIR [--split grouped|withheld] [--dev-share 0.2]
        [--seed 13] [--folds N --fold K]

Only queries with a relevant judgement are split, in one of two ways (`--split`):

- grouped (the default): queries that share a relevant passage (SciFact's claims citing one abstract),
  directly or through a chain of such queries, form one group; a group is never cut. The groups, each
  named by its smallest query id and listed in sorted order, are shuffled with numpy's generator seeded
  by `--seed`, and taken in that order into dev while they fit in `round(dev_share * n)` queries. No
  training query has a dev query's relevant passage among its own.
- withheld: `round(dev_share * n)` queries drawn at random (the same seeded generator over the sorted
  ids) go to dev, and every passage a dev query judges relevant is withheld from training: DIR/withheld.txt
  lists them, and the trainers' `--withhold` keeps them out of the training pairs, negatives and lists.
  For collections whose queries share relevant passages so widely that one group holds most of them
  (Cranfield: 161 of 225), where a grouped dev part could only come from the few queries outside it.

With `--folds N`, dev is fold K of a partition of the judged queries into N folds (cross-validation: each
query is dev in exactly one fold): fold 1 is the split at a dev share of 1/N, and each next fold the same
draw, at the share that leaves the remaining folds equal, from the queries (or groups) no earlier fold took;
the last takes all that are left. `--dev-share` is then unused.

Either way a reranker scored on dev is scored on passages it never saw as positives, and cannot pass by
remembering them.

Writes DIR/queries-{train,dev}.tsv (`qid<TAB>text`) and DIR/qrels-{train,dev}.txt (TREC `qid 0 docid rel`,
every judgement of the part's queries), and with withheld DIR/withheld.txt (a passage id a line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from retrieval.readers import InputFileError, lines, read_qrels, read_queries, relevant

PARTS = ("train", "dev")
SPLITS = ("grouped", "withheld")
WITHHELD_FILE = "withheld.txt"


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
    target = round(dev_share * sum(map(len, groups)))
    dev: set[str] = set()
    for index in np.random.default_rng(seed).permutation(len(groups)):
        if len(dev) + len(groups[index]) <= target:
            dev.update(groups[index])
    return _parts(groups, dev)


def split_fold(groups: list[list[str]], folds: int, fold: int, seed: int) -> dict[str, list[str]]:
    """{"train": ids, "dev": ids}: fold `fold` (1 to `folds`) of the groups' queries as dev. Fold 1 is
    split_groups(groups, 1 / folds, seed); fold k draws the same way from the groups folds 1 to k-1 left, at
    a share of 1 / (folds - k + 1)."""
    left = groups
    for k in range(1, fold + 1):
        dev = set(split_groups(left, 1 / (folds - k + 1), seed)["dev"])
        left = [group for group in left if group[0] not in dev]
    return _parts(groups, dev)


def _parts(groups: list[list[str]], dev: set[str]) -> dict[str, list[str]]:
    """{"train": ids, "dev": ids}, each in sorted order: the groups' queries in `dev` and the others."""
    ordered = sorted(qid for group in groups for qid in group)
    return {"train": [q for q in ordered if q not in dev], "dev": [q for q in ordered if q in dev]}


def read_withheld(path: Path) -> frozenset[str]:
    """The passage ids of a withheld.txt, one a line."""
    return frozenset(line.strip() for _, line in lines(path))


def write_split(queries: Path, qrels: Path, out: Path, dev_share: float = 0.2, seed: int = 13, split: str = "grouped",
                withheld: frozenset[str] = frozenset(), fold: tuple[int, int] | None = None) -> dict[str, int]:
    """Writes the split files into `out`; returns the number of queries in each part, of groups (the largest
    among them too) and, with the withheld split, of passages withheld (dev's relevant ones and `withheld`,
    an outer split's, which the training part here must not see either). `fold`: (k, n), dev is fold k of n
    (split_fold) instead of a `dev_share`."""
    if fold is not None and not (2 <= fold[1] <= 100 and 1 <= fold[0] <= fold[1]):
        raise InputFileError(f"--folds must be from 2 to 100 and --fold from 1 to --folds, got {fold[1]} and {fold[0]}")
    if fold is None and not 0 < dev_share < 1:
        raise InputFileError(f"--dev-share must be between 0 and 1, got {dev_share}")
    if split not in SPLITS:
        raise InputFileError(f"--split must be one of {', '.join(SPLITS)}, got {split}")
    texts, judged = read_queries(queries), read_qrels(qrels)
    positives = {qid: docids for qid, docids in relevant(judged).items() if qid in texts}
    if len(positives) < 2:
        raise InputFileError(f"{qrels}: fewer than 2 queries of {queries} have a relevant judgement")
    joined = groups_of(positives)
    groups = joined if split == "grouped" else [[qid] for qid in sorted(positives)]
    parts = split_groups(groups, dev_share, seed) if fold is None else split_fold(groups, fold[1], fold[0], seed)
    share = f"a share of {dev_share}" if fold is None else f"fold {fold[0]} of {fold[1]}"
    if (not parts["dev"] or not parts["train"]) and split == "withheld":
        raise InputFileError(f"{qrels}: {share} of {len(positives)} judged queries leaves a part empty")
    if not parts["dev"] or not parts["train"]:
        raise InputFileError(f"{qrels}: no grouped split holds out {share} of the queries: their relevant "
                             f"passages join them into groups too large (the largest has "
                             f"{max(map(len, joined))} of {len(positives)} queries; --split withheld holds out "
                             f"queries at random and withholds their relevant passages from training)")
    out.mkdir(parents=True, exist_ok=True)
    for part, ids in parts.items():
        (out / f"queries-{part}.tsv").write_text("".join(f"{q}\t{' '.join(texts[q].split())}\n" for q in ids))
        (out / f"qrels-{part}.txt").write_text(
            "".join(f"{q} 0 {docid} {rel}\n" for q in ids for docid, rel in sorted(judged[q].items())))
    counts = {**{part: len(ids) for part, ids in parts.items()}, "groups": len(joined),
              "largest group": max(map(len, joined))}
    if split == "withheld":
        passages = sorted(withheld.union(*(positives[q] for q in parts["dev"])))
        (out / WITHHELD_FILE).write_text("".join(f"{docid}\n" for docid in passages))
        counts["withheld"] = len(passages)
    return counts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training.split", description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=Path, required=True, help="TSV qid<TAB>text or BEIR JSONL")
    parser.add_argument("--qrels", type=Path, required=True, help="TREC qrels or BEIR TSV")
    parser.add_argument("--out", type=Path, required=True, help="folder for the split files")
    parser.add_argument("--split", choices=SPLITS, default="grouped",
                        help="grouped by relevant passage (default), or queries at random with their relevant "
                             "passages withheld from training")
    parser.add_argument("--dev-share", type=float, default=0.2, help="share of the queries held out (default 0.2)")
    parser.add_argument("--seed", type=int, default=13, help="seed of the shuffle (default 13)")
    parser.add_argument("--folds", type=int, help="cross-validation: split the queries into N folds ...")
    parser.add_argument("--fold", type=int, help="... and hold out fold K (1 to N)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if (args.fold is None) != (args.folds is None):
            raise InputFileError("--folds and --fold go together: --folds N --fold K holds out fold K of N")
        fold = None if args.folds is None else (args.fold, args.folds)
        counts = write_split(args.queries, args.qrels, args.out, args.dev_share, args.seed, args.split, fold=fold)
    except (InputFileError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    withheld = f", {counts['withheld']} passages withheld from training" if "withheld" in counts else ""
    fold = "" if args.folds is None else f", fold {args.fold} of {args.folds}"
    print(f"split {counts['train'] + counts['dev']} judged queries ({counts['groups']} groups sharing no relevant "
          f"passage) into {counts['train']} train and {counts['dev']} dev{withheld} ({args.split}, seed {args.seed}"
          f"{fold}) in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
