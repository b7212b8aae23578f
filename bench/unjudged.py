"""The packaged MiniLM adapted to a collection from its own text, no judgement read (issue 78), against the
packaged one on judged queries that no step reads:

    python bench/unjudged.py --collection scifact|cranfield|cisi [--source titles|both|crops|questions]
        [--questions 1000] [--steps 200] [--reranker-steps 300] [--save-every 100] [--tune-first-stage]
        [--work DIR] [--cisi DIR]

Runs the unjudged recipe (training.unjudged: pairs cut from the corpus, split by passage, the bi-encoder trained
`--steps` on one side, the checkpoint chosen, the packaged model among them, on the held-out side; then the
residual monoBERT trained `--reranker-steps` on the same side and chosen on the same held-out pairs) into
DIR/COLLECTION-SOURCE/recipe over the packaged index, built once into DIR; the recipe itself reports the chosen
model against the packaged one on the judged queries (hybrid z-score, the default retrieval, and dense, each with
a paired bootstrap 95% interval). Then each checkpoint's index of the corpus is built and measured on the judged
queries too, and so is every reranked pipeline the recipe compared, to show how the choice on held-out pairs
agrees with the choice the judgements would make.
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
from training.pipeline import Pipeline  # noqa: E402
from training.reranking import Part, reranked_values  # noqa: E402
from training.trainer import checkpoints  # noqa: E402
from training.served import served_settings  # noqa: E402
from service.engine.search_engine import SearchEngine  # noqa: E402
from service.http.routes.search import answer  # noqa: E402
from service.http.schemas import SearchRequest  # noqa: E402
from training.recipe import build_parser  # noqa: E402
from training.unjudged import (  # noqa: E402
    MODES, PACKAGED, PAIRS, QUESTION_PASSAGES, QUESTIONS, candidates, run_unjudged, searcher)

DEPTHS, WEIGHTS = build_parser().get_default("depths"), build_parser().get_default("weights")  # the recipe's own

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


def reranker_rows(summary: dict, recipe: Path, judged: dict, queries: dict[str, str]) -> None:
    """Each reranked pipeline the recipe compared on the held-out pairs, measured on the judged queries too: how the
    choice on pairs agrees with the one the judgements would make (never used to choose)."""
    stage = summary["reranker"]["first_stage"]
    setting = tuning.Setting.from_env(summary["first_stage"]["env"])
    part = Part(queries, judged, {stage: retrieve(searcher(Path(summary["index"]), "cpu", setting), queries,
                                                  max(max(DEPTHS), 10))})
    on_pairs = summary["reranker"]["held_out_ndcg@10"]
    on_judged = {Pipeline(first_stage=stage).name: part.scored(Pipeline(first_stage=stage), None)}
    on_judged |= {pipeline.name: values for pipeline, values in reranked_values(
        part, stage, checkpoints(recipe / "model"), DEPTHS, WEIGHTS, "cpu", "judged queries")}
    means = {name: statistics.fmean(values.values()) for name, values in on_judged.items()}
    best_pairs = max(on_pairs, key=lambda name: round(on_pairs[name], 10))
    best_judged = max(means, key=lambda name: round(means[name], 10))
    alone = Pipeline(first_stage=stage).name
    print(f"\nthe reranker ({summary['reranker']['why']}), nDCG@10 over the served first stage's lists:\n")
    print("| pipeline | held-out pairs (chooses) | judged | judged, against the first stage alone (95% interval) |")
    print("|---|---|---|---|")
    for name in dict.fromkeys((alone, best_pairs, best_judged)):
        role = " and ".join(role for role, who in (("best on the pairs", best_pairs), ("best judged", best_judged))
                            if who == name)
        difference = paired_bootstrap(on_judged[alone], on_judged[name], seed=13)
        print(f"| {name}{f' ({role})' if role else ''} | {on_pairs[name]:.4f} | {means[name]:.4f} | "
              f"{difference.mean:+.4f} ({difference.low:+.4f} to {difference.high:+.4f})"
              f"{' real' if difference.real else ''} |")
    order = sorted(on_pairs, key=lambda name: on_pairs[name])
    agreement = statistics.correlation([on_pairs[name] for name in order], [means[name] for name in order])
    print(f"\n{len(order)} pipelines: Pearson's r between their held-out pair and judged means {agreement:.3f}")


def served_ms(settings: dict[str, str], queries: dict[str, str], rerank: bool, count: int = 50) -> float:
    """p50 ms of one query at a time through the service's engine under `settings` (the first `count`)."""
    engine_settings = served_settings(settings, "cpu")
    engine = SearchEngine.served(engine_settings)
    timed = []
    for text in [*queries.values()][:count + 1]:
        started = time.perf_counter()
        answer(engine_settings, engine, SearchRequest.model_validate({"query": text, "k": 100, "rerank": rerank}))
        timed.append((time.perf_counter() - started) * 1000)
    return statistics.median(timed[1:])  # the first pays one-off costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collection", choices=["scifact", "cranfield", "cisi"], required=True)
    parser.add_argument("--source", choices=[*PAIRS, QUESTIONS], default="titles")
    parser.add_argument("--questions", type=int, default=QUESTION_PASSAGES, help="with --source questions: passages "
                        "drawn to get one")
    parser.add_argument("--steps", type=int, default=200, help="the bi-encoder's training steps (0: none)")
    parser.add_argument("--reranker-steps", type=int, default=300, help="the monoBERT's training steps (0: none)")
    parser.add_argument("--save-every", type=int, default=100, help="the monoBERT's steps between checkpoints")
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
        qrels=files["qrels"], tune_first_stage=args.tune_first_stage, steps=args.reranker_steps,
        save_every=args.save_every, max_tokens=256, depths=DEPTHS, weights=WEIGHTS, init_reranker=None))
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
        on_pairs = summary["held_out_ndcg@10"].get(label)  # none where no bi-encoder was trained
        print(f"| {label}{marks} | {'-' if on_pairs is None else f'{on_pairs:.4f}'} | "
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
    if args.reranker_steps:
        reranker_rows(summary, out / "recipe", judged, queries)
    if summary["reranker"]["checkpoint"]:
        alone = {**summary["serve"], "SEARCH_RERANKERS": "[]"}
        print(f"\nms a query (p50, one at a time, the service's engine, k 100): served "
              f"{served_ms(summary['serve'], queries, True):.1f}, its first stage alone "
              f"{served_ms(alone, queries, False):.1f}")
    print("\nserved (the chosen model, its tuned setting, its reranker) against the packaged default, as the recipe "
          "reports it:\n")
    print("| retrieval | packaged | served | difference (95% interval) | better / worse |\n|---|---|---|---|---|")
    for mode, row in summary["reported"].items():
        print(f"| {mode} | {row['packaged']:.4f} | {row['chosen']:.4f} | {row['difference']:+.4f} ({row['low']:+.4f} "
              f"to {row['high']:+.4f}){' real' if row['real'] else ''} | {row['better']} / {row['worse']} |")
    print(f"\nthe recipe took {recipe_minutes:.1f} min, the whole run {(time.monotonic() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
