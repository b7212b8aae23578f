"""The default retrieval's dense weight and feedback tuned on SmolLM2's questions, no judgement read (issue 78):
on every question the round trip kept, and on those whose passage BM25 alone does not rank first (questions that
do not copy their passage's words), each adopted setting then measured on the judged queries:

    python bench/unjudged_tuning.py --collection cranfield|scifact [--work DIR]

Reads the questions a finished `bench/unjudged.py --source questions` run kept (DIR/COLLECTION-questions/recipe/
pairs) and the packaged index it built (DIR/COLLECTION-index). The packaged first stage was never trained on the
questions, so all of them can tune it. training.first_stage's grid and rule: a setting is adopted only where its
gain over the defaults is real on the questions that tune it.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retrieval.evaluation import as_run, paired_bootstrap, retrieve  # noqa: E402
from retrieval.readers import read_qrels, read_queries  # noqa: E402
from training import first_stage as tuning  # noqa: E402
from training.unjudged import searcher  # noqa: E402
from unjudged import collection  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collection", choices=["scifact", "cranfield"], required=True)
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "unjudged")
    args = parser.parse_args()
    started = time.monotonic()
    pairs = args.work / f"{args.collection}-questions" / "recipe" / "pairs"
    files = collection(args.collection, args.work, args.work / "cisi")
    if files is None or not (pairs / "qrels.txt").is_file():
        print(f"skipped: no {args.collection} data, or no questions in {pairs} (run bench/unjudged.py first)")
        return
    loaded = searcher(args.work / f"{args.collection}-index", "cpu")
    asked, relevant = read_queries(pairs / "queries.tsv"), read_qrels(pairs / "qrels.txt")
    first = as_run(retrieve(loaded, asked, 1, mode="bm25"))
    hard = [qid for qid in asked if not ({docid for docid, _ in first.get(qid, [])} & relevant[qid].keys())]
    judged, queries = read_qrels(files["qrels"]), read_queries(files["queries"])
    on_judged = tuning.values(loaded, judged, queries, tuning.grid())
    print(f"\n{args.collection}: {len(asked)} questions kept by the round trip, {len(hard)} of them with their "
          f"passage not first by BM25; each setting adopted on them, then read on {len(queries)} judged queries "
          "(nDCG@10; differences from the defaults, paired bootstrap 95% interval):\n")
    print("| tuned on | questions | adopted (gain on them) | judged, defaults -> adopted | difference (95% interval) |")
    print("|---|---|---|---|---|")
    for name, chosen in (("every kept question", sorted(asked)), ("passage not first by BM25", sorted(hard))):
        by_setting = tuning.values(loaded, {q: relevant[q] for q in chosen}, {q: asked[q] for q in chosen},
                                   tuning.grid())
        setting, why = tuning.adopted(by_setting, chosen)
        difference = paired_bootstrap(on_judged[tuning.DEFAULT], on_judged[setting], seed=13)
        print(f"| {name} | {len(chosen)} | {why} | {difference.base:.4f} -> {difference.other:.4f} | "
              f"{difference.mean:+.4f} ({difference.low:+.4f} to {difference.high:+.4f})"
              f"{' real' if difference.real else ''} |")
    oracle = max(on_judged, key=lambda setting: statistics.fmean(on_judged[setting].values()))
    print(f"\nthe best on the judged queries themselves (an oracle, never used): {oracle.name}, "
          f"{statistics.fmean(on_judged[oracle].values()):.4f}; {(time.monotonic() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
