"""The packaged MiniLM adapted to a collection from its own text, no judgement read (issue 78), against the
packaged one on judged queries that no step reads:

    python bench/unjudged.py --collection scifact|cranfield|cisi [--source titles|both|crops|questions]
        [--questions 1000] [--steps 200] [--tune-first-stage] [--work DIR] [--cisi DIR]

Runs the unjudged recipe (training.unjudged: pairs cut from the corpus, split by passage, the bi-encoder trained
`--steps` on one side, the checkpoint chosen, the packaged model among them, on the held-out side) into
DIR/COLLECTION-SOURCE/recipe over the packaged index, built once into DIR; the recipe itself reports the chosen
model against the packaged one on the judged queries (hybrid z-score, the default retrieval, and dense, each with
a paired bootstrap 95% interval). Then each checkpoint's index of the corpus is built and measured on the judged
queries too, to show how the choice on held-out pairs agrees with the choice the judgements would make.
SciFact: its corpus, reported on the dev claims of the recipe's grouped split (training.split, seed 13, a share
of 0.2: the judged recipe's held-out claims); Cranfield: its 1,400 abstracts (no titles: `--source titles`
needs SciFact or CISI), reported on all 225 queries; CISI: its 1,460 library and information science abstracts with
their titles (CISI.ALL, CISI.QRY and CISI.REL in `--cisi`), reported on its 76 judged questions. Data from
../shared/data; a collection that is not there is skipped.
"""
import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from index_builder.convert_cranfield import convert_cisi, convert_cranfield  # noqa: E402
from retrieval.evaluation import as_run, paired_bootstrap, per_query, retrieve  # noqa: E402
from retrieval.readers import read_qrels, read_queries  # noqa: E402
from training.split import write_split  # noqa: E402
from training import first_stage as tuning  # noqa: E402
from training.unjudged import (  # noqa: E402
    MODES, PACKAGED, PAIRS, QUESTION_PASSAGES, QUESTIONS, candidates, run_unjudged, searcher)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"


def run(*args) -> float:
    """Seconds `python ARGS` took; exits on a failure."""
    started = time.monotonic()
    if subprocess.run([sys.executable, *map(str, args)], cwd=ROOT).returncode:
        sys.exit(f"failed: {' '.join(map(str, args))}")
    return time.monotonic() - started


def build(corpus: Path, index: Path, model: Path | None = None) -> float:
    return run("-m", "index_builder", "build", "--corpus", corpus, "--out", index, "--if-missing", "--device", "cpu",
               *(["--model", model] if model else []))


def collection(name: str, work: Path, cisi: Path) -> dict[str, Path] | None:
    """The corpus, the judged queries and the qrels that report; None where the data is absent."""
    if name == "cisi":
        if not (cisi / "CISI.REL").is_file():
            return None
        converted = work / "cisi-converted"
        if not (converted / "qrels.txt").exists():
            convert_cisi(cisi, converted)
        return {"corpus": converted / "corpus.jsonl", "queries": converted / "queries.tsv",
                "qrels": converted / "qrels.txt"}
    if name == "scifact":
        folder = DATA / "scifact-train"
        if not folder.is_dir():
            return None
        split = work / "scifact-split"
        if not (split / "qrels-dev.txt").exists():
            write_split(folder / "queries-train.jsonl", folder / "qrels-train.tsv", split)
        return {"corpus": folder / "corpus.jsonl", "queries": split / "queries-dev.tsv",
                "qrels": split / "qrels-dev.txt"}
    folder = DATA / "cranfield"
    if not folder.is_dir():
        return None
    converted = work / "cranfield-converted"
    if not (converted / "qrels.txt").exists():
        convert_cranfield(folder, converted)
    return {"corpus": converted / "corpus.tsv", "queries": converted / "queries.tsv", "qrels": converted / "qrels.txt"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collection", choices=["scifact", "cranfield", "cisi"], required=True)
    parser.add_argument("--source", choices=[*PAIRS, QUESTIONS], default="titles")
    parser.add_argument("--questions", type=int, default=QUESTION_PASSAGES, help="with --source questions: passages "
                        "drawn to get one")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tune-first-stage", action="store_true", help="tune the first stage on held-out pairs")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "unjudged")
    parser.add_argument("--cisi", type=Path, default=DATA / "cisi", help="the folder of CISI.ALL, CISI.QRY, CISI.REL")
    args = parser.parse_args()
    files = collection(args.collection, args.work, args.cisi)
    if files is None:
        print(f"skipped: no {args.collection} data in {args.cisi if args.collection == 'cisi' else DATA}")
        return
    out = args.work / f"{args.collection}-{args.source}"
    started = time.monotonic()
    default_index = args.work / f"{args.collection}-index"
    build(files["corpus"], default_index)
    summary = run_unjudged(argparse.Namespace(
        corpus=files["corpus"], out=out / "recipe", pairs=args.source, index=default_index, seed=13,
        biencoder_steps=args.steps, device="cpu", questions=args.questions, queries=files["queries"],
        qrels=files["qrels"], tune_first_stage=args.tune_first_stage))
    recipe_minutes = (time.monotonic() - started) / 60
    judged, queries = read_qrels(files["qrels"]), read_queries(files["queries"])
    rows = {}
    for label, path in candidates(out / "recipe" / "biencoder").items():
        if path is None:
            index = default_index
        elif label == summary["chosen"]:
            index = Path(summary["index"])  # the recipe built it
        else:
            index = out / f"index-{label}"
            build(files["corpus"], index, path)
        loaded = searcher(index, "cpu")
        rows[label] = {mode: per_query(judged, as_run(retrieve(loaded, queries, 100, **options)))
                       for mode, options in MODES.items()}
    chosen = summary["chosen"]
    best = max(rows, key=lambda label: round(statistics.fmean(rows[label]["hybrid (default)"].values()), 10))
    pairs = summary["pairs"]
    print(f"\n{args.collection}, the packaged MiniLM adapted on {args.source} pairs ({args.steps} steps; "
          f"{pairs['train']} training pairs, {pairs['held_out']} held out, searched among "
          f"{pairs['choice_passages']} passages), nDCG@10:\n")
    print("| model | held-out pairs, dense (chooses) | judged, " + " | judged, ".join(MODES) + " |")
    print("|---" * (2 + len(MODES)) + "|")
    for label, row in rows.items():
        marks = "".join(mark for mark, who in ((" (chosen)", chosen), (" (best judged)", best)) if who == label)
        print(f"| {label}{marks} | {summary['held_out_ndcg@10'][label]:.4f} | "
              + " | ".join(f"{statistics.fmean(row[mode].values()):.4f}" for mode in MODES) + " |")
    print(f"\ndifferences from the packaged on {len(queries)} judged queries no step read "
          "(paired bootstrap 95% interval, better / worse):\n")
    print("| model | retrieval | difference (95% interval) | better / worse |\n|---|---|---|---|")
    for label in dict.fromkeys((chosen, best)):
        for mode in MODES:
            difference = paired_bootstrap(rows[PACKAGED][mode], rows[label][mode], seed=13)
            role = " and ".join(role for role, who in (("chosen", chosen), ("best judged", best)) if who == label)
            print(f"| {label} ({role}) | {mode} | {difference.mean:+.4f} ({difference.low:+.4f} to "
                  f"{difference.high:+.4f}){' real' if difference.real else ''} | "
                  f"{difference.better} / {difference.worse} |")
    tuned = summary["first_stage"]
    by_setting = tuning.values(searcher(Path(summary["index"]), "cpu"), judged, queries, tuning.grid())
    oracle = max(by_setting, key=lambda setting: statistics.fmean(by_setting[setting].values()))
    print(f"\nthe first stage over the chosen index, tuned on the held-out pairs: {tuned['why']}; the best setting "
          f"on the judged queries themselves (an oracle, never used): {oracle.name}, hybrid nDCG@10 "
          f"{statistics.fmean(by_setting[oracle].values()):.4f} against "
          f"{statistics.fmean(by_setting[tuning.DEFAULT].values()):.4f} at the defaults")
    print("\nserved (the chosen model, its tuned setting) against the packaged default, as the recipe reports it:\n")
    print("| retrieval | packaged | served | difference (95% interval) | better / worse |\n|---|---|---|---|---|")
    for mode, row in summary["reported"].items():
        print(f"| {mode} | {row['packaged']:.4f} | {row['chosen']:.4f} | {row['difference']:+.4f} ({row['low']:+.4f} "
              f"to {row['high']:+.4f}){' real' if row['real'] else ''} | {row['better']} / {row['worse']} |")
    print(f"\nthe recipe took {recipe_minutes:.1f} min, the whole run {(time.monotonic() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
