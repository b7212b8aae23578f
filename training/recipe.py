"""The reranking recipe on a user's own judged collection, from its files to a pipeline to serve:

    python -m training.recipe --corpus C --queries Q --qrels R --out DIR [--index INDEX]

(With no judgements, `--corpus C --out DIR` alone: training.unjudged adapts the bi-encoder from the corpus.)

1. Splits the judged queries (training.split: grouped by relevant passage, so that no held-out query has a
   relevant passage a training query has) into a held-out part (`--dev-share`), which reports once, and a
   training part, split again the same way into the queries the reranker trains on and a validation part
   (`--validation-share`), which chooses: DIR/split, DIR/split/validation. With `--split withheld` (for
   collections whose queries share relevant passages so widely that one group holds most of them) both
   parts are drawn at random instead, and their relevant passages are withheld from every training
   (DIR/split/validation/withheld.txt, the trainers' `--withhold`).
2. Takes each query's top max(`--depths`) by the index's default retrieval (hybrid with z-score fusion where
   the index has BM25): INDEX, or the packaged encoder's index of C built into DIR/index. Unless
   `--no-tune-first-stage`, also by the same retrieval tuned on the training queries (training.first_stage: its
   dense weight and pseudo-relevance feedback, adopted only where the gain is real on them). With
   `--biencoder-steps`, also by the packaged MiniLM fine-tuned on the training queries (DIR/biencoder) and its
   index of C (DIR/index-biencoder). The first stage reading best on validation is reranked.
3. Trains the residual monoBERT from the packaged MiniLM (or `--init-reranker`: a reranker trained on another
   collection, such as another recipe's checkpoint, which then competes untrained here too) on the training
   queries' lists (training.train_cross_encoder --objective residual: each logit plus 0.5 x the first stage's
   z-score; pairs cut to `--max-tokens`), a checkpoint every `--save-every` steps: DIR/model. A rerun resumes
   an interrupted training.
4. Chooses on validation by nDCG@10: each first stage alone, every checkpoint at every depth and retrieval
   weight on torch, then the best checkpoint on each other backend; ties go to the faster. Each pipeline's
   ms/query (first stage and rerank, one query at a time, p50) is measured on validation queries. The chosen
   pipeline is the best one (the default retrieval alone where no reranking beats it); the fast one the best
   within `--budget-ms`.
5. Reports once on held-out: the default retrieval, the tuned first stage (the default itself where the tuning
   kept the defaults), the fine-tuned first stage, the chosen pipeline with and without blending, and the fast
   one (and the best reranked one where none of these reranks), each difference from the default with a paired
   bootstrap 95% interval over queries. Each is measured on the service's answers: its engine under the
   pipeline's serve settings, each query a /search request with k 100 (training.served), as a user would
   serve it; the answers are kept in DIR/answers/LABEL.jsonl.
6. Writes DIR/serve.env and DIR/serve-fast.env (the service's settings for each pipeline: `set -a; .
   DIR/serve.env; set +a; python -m service`) and DIR/recipe.json (every figure above, and each held-out
   query's value under each reported pipeline).

With `--folds N` the recipe is cross-validated: it runs N times, in DIR/fold-1 to DIR/fold-N, each run holding
out a different Nth of the judged queries (training.split's folds; fold 1 is the run without `--folds` at a
`--dev-share` of 1/N) and choosing on its own validation part. Every judged query is then held out exactly once,
so each reported pipeline (each fold's own) reads on all of them: the differences from the default and their
paired bootstrap intervals are taken over every judged query (DIR/recipe.json). Each fold's serve.env serves
the pipeline that fold measured (fold 1's is the one a run without `--folds` writes). A rerun resumes.
`--fold K` runs fold K alone (folds can be spread over machines or sessions sharing DIR); a later run without
`--fold` skips the finished folds and pools.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

from models.backends import BACKENDS
from models.checkpoint import resolve_device
from models.reranker import Reranker, load_reranker
from retrieval.evaluation import Difference, as_run, mode_name, paired_bootstrap, per_query, retrieve
from retrieval.index_format import read_manifest
from retrieval.load_options import LoadOptions
from retrieval.readers import InputFileError, read_qrels, read_queries, write_run
from retrieval.searcher import Hit, Searcher, encoder_for
from training import first_stage as tuning
from training import train_biencoder
from training.data import TrainingDataError
from training.pipeline import (
    BIENCODER,
    BIENCODER_TRAINING,
    DEFAULT,
    FIRST_STAGES,
    MEASURE,
    K,
    Pipeline,
    TUNED,
    RecipeError,
    build_index,
    check_settings,
    env_file,
    write_json,
)
from training.reranking import Part, reranker_scores, train_reranker
from training.served import ANSWER_K, ranked_run, served_answers, write_answers
from training.split import SPLITS, WITHHELD_FILE, read_withheld, write_split
from training.trainer import checkpoints
from training.unjudged import QUESTION_PASSAGES, run_unjudged

SUMMARY_FILE = "recipe.json"


@dataclass
class Row:
    pipeline: Pipeline
    values: dict[str, float]  # per query
    ms: float  # p50 per query, first stage and rerank, on validation queries

    @property
    def mean(self) -> float:
        return sum(self.values.values()) / len(self.values)


class Reported(NamedTuple):
    """A pipeline chosen on validation, as it read on held-out queries."""

    row: Row
    difference: Difference  # from the default retrieval
    values: dict[str, float]  # per held-out query


def timed_ms(searchers: Mapping[str, Searcher], stage: str, rerankers: Mapping[str, Reranker], part: Part,
             depths: Sequence[int], queries: int) -> tuple[dict[str, float], dict[tuple[str, int], float]]:
    """p50 ms a query, one query at a time as a search arrives: each first stage alone, and `stage` with each
    backend's reranker at each depth (the first stage's time of a query plus its rerank's)."""
    sample = list(part.queries.items())[:queries]
    alone = {}
    for name, searcher in searchers.items():
        request = searcher.request(max(max(depths), K))
        searcher.run([sample[0][1]], request)  # warm: the first call pays one-off costs
        first, found = {}, {}
        for qid, text in sample:
            started = time.perf_counter()
            found[qid] = searcher.run([text], request)[0]
            first[qid] = (time.perf_counter() - started) * 1000
        alone[name] = statistics.median(first.values())
        if name == stage:
            lists, stage_ms = found, first
    times = {}
    for backend, reranker in rerankers.items():
        reranker.score(sample[0][1], [hit.text for hit in lists[sample[0][0]][:max(depths)]])
        for depth in depths:
            total = []
            for qid, text in sample:
                started = time.perf_counter()
                reranker.score(text, [hit.text for hit in lists[qid][:depth]])
                total.append(stage_ms[qid] + (time.perf_counter() - started) * 1000)
            times[(backend, depth)] = statistics.median(total)
    return alone, times


def chosen(rows: Sequence[Row], budget_ms: float | None = None) -> Row | None:
    """The best row by mean nDCG@10 (within `budget_ms` where given; None where none is); a tie goes to the
    faster, then to the earlier in `rows` (the default retrieval first, smaller depths and weights first)."""
    fitting = [row for row in rows if budget_ms is None or row.ms <= budget_ms]
    return max(fitting, key=lambda row: (round(row.mean, 10), -row.ms), default=None)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_recipe(args: argparse.Namespace) -> dict:
    """One run (`args.fold`: None, or fold k of `args.folds`, which a finished run there answers); its summary."""
    started = time.perf_counter()
    out, depths, weights = args.out, sorted(set(args.depths)), sorted(set(args.weights))
    _check_arguments(args, depths, weights)
    if args.fold is not None and (out / SUMMARY_FILE).is_file():  # written last: the fold finished
        print(f"fold {args.fold} of {args.folds}: finished in {out}", file=sys.stderr)
        return json.loads((out / SUMMARY_FILE).read_text())
    split, inner = out / "split", out / "split" / "validation"
    outer = write_split(args.queries, args.qrels, split, _dev_share(args), args.seed, args.split,
                        fold=None if args.fold is None else (args.fold, args.folds))
    withheld = read_withheld(split / WITHHELD_FILE) if args.split == "withheld" else frozenset()
    counts = write_split(split / "queries-train.tsv", split / "qrels-train.txt", inner, args.validation_share,
                         args.seed, args.split, withheld)
    how = {"grouped": "grouped by relevant passage",
           "withheld": f"at random, the {counts.get('withheld')} passages relevant to validation or held-out "
                       f"queries withheld from training"}[args.split]
    print(f"split {outer['train'] + outer['dev']} judged queries, {how}: {counts['train']} train, "
          f"{counts['dev']} validation, {outer['dev']} held out", file=sys.stderr)
    if args.split == "grouped" and outer["largest group"] > (outer["train"] + outer["dev"]) / 2:
        print(f"note: {outer['largest group']} of the {outer['train'] + outer['dev']} judged queries share relevant "
              f"passages in one group, which trains: the held-out queries are only the others, not a sample of "
              f"the collection (--split withheld draws them at random)", file=sys.stderr)

    index = args.index or out / "index"
    if args.index is None:
        build_index(args.corpus, index, args.device)
    searchers = {DEFAULT: Searcher(index, encoder_for(read_manifest(index), args.device),
                                   load=LoadOptions(device=args.device))}
    request = searchers[DEFAULT].request(max(max(depths), K))
    first_stage = mode_name(request.mode, request.fusion)
    print(f"first stage: {index}'s default retrieval ({first_stage}), top {request.k}", file=sys.stderr)

    def part(folder: Path, side: str) -> Part:
        queries = read_queries(folder / f"queries-{side}.tsv")
        return Part(queries, read_qrels(folder / f"qrels-{side}.txt"),
                    {DEFAULT: retrieve(searchers[DEFAULT], queries, request.k)})

    fit, validation, held_out = part(inner, "train"), part(inner, "dev"), part(split, "dev")
    indexes, stage, tuned = {DEFAULT: index}, DEFAULT, {}
    if args.tune_first_stage and searchers[DEFAULT].bm25 is not None:
        setting, why = tuning.adopted(tuning.values(searchers[DEFAULT], fit.qrels, fit.queries, tuning.grid()),
                                      list(fit.queries), only_real=args.tune_adopt == "real")
        print(f"first stage tuned on the {len(fit.queries)} training queries ({MEASURE}): {why}", file=sys.stderr)
        if setting != tuning.DEFAULT:
            searchers[TUNED] = copy.copy(searchers[DEFAULT])  # the same index loaded once, other defaults
            searchers[TUNED].defaults = setting.defaults()
            indexes[TUNED], tuned = index, setting.env()
            for each in (fit, validation, held_out):
                each.lists[TUNED] = retrieve(searchers[TUNED], each.queries, request.k)
    if args.biencoder_steps:
        indexes[BIENCODER] = _biencoder(args, fit, inner, searchers[DEFAULT], first_stage)
        searchers[BIENCODER] = Searcher(indexes[BIENCODER], encoder_for(read_manifest(indexes[BIENCODER]), args.device),
                                        load=LoadOptions(device=args.device))
        for each in (fit, validation, held_out):
            each.lists[BIENCODER] = retrieve(searchers[BIENCODER], each.queries, request.k)
    if len(searchers) > 1:
        means = {name: statistics.fmean(validation.scored(Pipeline(first_stage=name), None).values())
                 for name in searchers}
        stage = max(means, key=lambda name: round(means[name], 10))  # a tie keeps the earlier, the default first
        print(f"first stage reranked, chosen on validation ({MEASURE}): {FIRST_STAGES[stage]} ("
              + ", ".join(f"{FIRST_STAGES[name]} {mean:.4f}" for name, mean in means.items()) + ")", file=sys.stderr)
    saved = ([args.init_reranker] if args.init_reranker else []) + _train(args, fit, inner, first_stage, stage)
    rows = _validation_rows(args, searchers, stage, saved, validation, depths, weights)
    best, fast = chosen(rows), chosen(rows, args.budget_ms)
    # With and without blending: the chosen pipeline on the other side of weight 0, its best on validation.
    counterpart = chosen([row for row in rows if best.pipeline.checkpoint is not None and (
        row.pipeline.checkpoint, row.pipeline.backend, row.pipeline.depth) == (
        best.pipeline.checkpoint, best.pipeline.backend, best.pipeline.depth)
        and (row.pipeline.weight == 0) != (best.pipeline.weight == 0)])
    blending = "chosen, without blending" if best.pipeline.weight else "chosen, with blending"
    fine_tuned = [row for row in rows if row.pipeline == Pipeline(first_stage=BIENCODER)]
    # Where the tuning kept the defaults, the tuned first stage is the default retrieval itself.
    tuned_row = next((row for row in rows if row.pipeline == Pipeline(first_stage=TUNED)), rows[0])
    # Where no reranking was chosen, the best that was not: what reranking gives, reported beside the rest.
    reranked = chosen([row for row in rows if row.pipeline.checkpoint is not None])
    reported = {"default": rows[0], **({"tuned first stage": tuned_row} if args.tune_first_stage else {}),
                **({"fine-tuned first stage": fine_tuned[0]} if fine_tuned else {}),
                "chosen": best, **({blending: counterpart} if counterpart else {}), **({"fast": fast} if fast else {}),
                **({"best reranked": reranked} if best.pipeline.checkpoint is None and reranked else {})}
    report = _held_out(args, reported, held_out, max(depths), indexes, tuned)

    summary = _summary(args, first_stage, counts, outer, len(saved), rows, report, indexes, tuned)
    print(_table(report, len(held_out.queries), validation, first_stage))
    for label, row, file in (("serve", best, "serve.env"), ("serve fast", fast, "serve-fast.env")):
        (out / file).unlink(missing_ok=True)
        if row is None:
            print(f"{label}: no pipeline answered within {args.budget_ms:g} ms/query (p50) on this machine")
            continue
        env_file(out / file, row.pipeline, indexes, tuned, f"{label}: {row.pipeline.name}")
        settings = " ".join(f"{name}='{value}'" if name == "SEARCH_RERANKERS" else f"{name}={value}"
                            for name, value in row.pipeline.settings(indexes, tuned).items())
        print(f"{label}: {settings}  ({row.ms:.1f} ms/query p50 on validation; {out / file})")
    write_json(out / SUMMARY_FILE, summary)
    print(f"recipe: {len(saved)} checkpoints x {len(depths)} depths x {len(weights)} weights chosen on "
          f"{len(validation.queries)} validation queries, reported on {len(held_out.queries)} held-out queries in "
          f"{(time.perf_counter() - started) / 60:.1f} min")
    return summary


def run_folds(args: argparse.Namespace) -> dict:
    """The recipe cross-validated over `args.folds` folds (DIR/fold-K), then each reported pipeline pooled
    over every judged query; the summary."""
    started = time.perf_counter()
    _check_arguments(args, sorted(set(args.depths)), sorted(set(args.weights)))
    index = args.index or args.out / "index"
    if args.index is None:
        build_index(args.corpus, index, args.device)
    summaries = []
    for fold in [args.only_fold] if args.only_fold is not None else range(1, args.folds + 1):
        print(f"fold {fold} of {args.folds}", file=sys.stderr)
        summaries.append(run_recipe(argparse.Namespace(**{**vars(args), "out": args.out / f"fold-{fold}",
                                                          "index": index, "fold": fold})))
    if args.only_fold is not None:
        print(f"recipe: fold {args.only_fold} of {args.folds} in {args.out / f'fold-{args.only_fold}'}; a run "
              f"without --fold pools the folds once all have finished")
        return summaries[0]
    queries = sum(len(folded["held_out"]["default"]["per_query"]) for folded in summaries)
    pooled = {label: {"held_out": difference.other, "default": difference.base, "difference": difference.mean,
                      "interval": [difference.low, difference.high], "real": difference.real,
                      "better": difference.better, "worse": difference.worse,
                      "pipelines": [_described(folded["held_out"][label]) for folded in summaries],
                      "ms": [folded["held_out"][label]["ms"] for folded in summaries]}
              for label, difference in pool(summaries, args.seed).items()}
    print(_pooled_table(pooled, queries, summaries[0]["default_retrieval"]))
    summary = {"date": time.strftime("%Y-%m-%d"), "default_retrieval": summaries[0]["default_retrieval"],
               "split": args.split, "folds": args.folds, "queries": queries, "measure": MEASURE,
               "budget_ms": args.budget_ms, "fold_summaries": [str(args.out / f"fold-{k}" / SUMMARY_FILE)
                                                               for k in range(1, args.folds + 1)],
               "pooled": pooled}
    write_json(args.out / SUMMARY_FILE, summary)
    print(f"recipe: {args.folds} folds, each of {queries} judged queries held out once, in "
          f"{(time.perf_counter() - started) / 60:.1f} min")
    return summary


POOLED = ("default", "tuned first stage", "fine-tuned first stage", "chosen", "fast")  # the rows every fold reports


def pool(summaries: Sequence[dict], seed: int) -> dict[str, Difference]:
    """Each of POOLED's rows that every fold reports: its held-out queries' values gathered over the folds
    (each fold's own pipeline), against the default retrieval's, by a paired bootstrap over all of them."""
    def gathered(label: str) -> dict[str, float]:
        return {qid: value for summary in summaries for qid, value in summary["held_out"][label]["per_query"].items()}
    return {label: paired_bootstrap(gathered("default"), gathered(label), seed=seed) for label in POOLED
            if all(label in summary["held_out"] for summary in summaries)}


def _described(reported: dict) -> str:
    """The name of a pipeline a summary reports."""
    checkpoint = reported["checkpoint"]
    name = Pipeline(Path(checkpoint) if checkpoint else None, reported["backend"], reported["depth"],
                    reported["weight"], reported["first_stage"], reported["untrained"]).name
    settings = reported.get("settings", {})
    if reported["first_stage"] == TUNED:
        name += (f" (dense weight {settings['SEARCH_DEFAULT_DENSE_WEIGHT']}, feedback "
                 f"{settings['SEARCH_DEFAULT_FEEDBACK_PASSAGES']} x {settings['SEARCH_DEFAULT_FEEDBACK_WEIGHT']})")
    return name


def _pooled_table(pooled: Mapping[str, dict], queries: int, first_stage: str) -> str:
    """run_folds' table of its pooled rows (their JSON)."""
    differences = {label: Difference(row["default"], row["held_out"], row["difference"], *row["interval"],
                                     row["better"], row["worse"]) for label, row in pooled.items()}
    changes = {label: "" if label == "default" else f"{difference}  {'real' if difference.real else 'not shown'}"
               for label, difference in differences.items()}
    width = max(map(len, changes.values())) + 2
    folds = len(pooled["default"]["ms"])
    lines = [f"cross-validated: {queries} judged queries in {folds} folds, each held out once ({MEASURE}; "
             f"differences from the default retrieval, {first_stage}, with paired bootstrap 95% intervals over all "
             f"{queries}; each fold chose on its own validation queries)",
             f"{'':<26}{'held-out':>8}  {'difference':<{width}}ms/query over the folds"]
    for label, row in pooled.items():
        lines.append(f"{label:<26}{row['held_out']:>8.4f}  {changes[label]:<{width}}"
                     f"{min(row['ms']):.1f} to {max(row['ms']):.1f}")
    for label, row in pooled.items():
        if label != "default":
            lines += [f"{label}, fold {k}: {pipeline}" for k, pipeline in enumerate(row["pipelines"], 1)]
    return "\n".join(lines)


def _check_arguments(args: argparse.Namespace, depths: list[int], weights: list[float]) -> None:
    if not 1 <= args.folds <= 100:
        raise RecipeError(f"--folds must be from 1 to 100, got {args.folds}")
    if args.folds > 1 and args.dev_share is not None:
        raise RecipeError(f"--dev-share and --folds exclude each other: each of {args.folds} folds holds out "
                          f"1/{args.folds} of the queries")
    if args.only_fold is not None and args.folds < 2:
        raise RecipeError("--fold K needs --folds N, the folds it is one of")
    if args.only_fold is not None and not 1 <= args.only_fold <= args.folds:
        raise RecipeError(f"--fold {args.only_fold} is not one of --folds {args.folds} (1 to {args.folds})")
    if args.biencoder_steps < 0:
        raise RecipeError(f"--biencoder-steps must be >= 0, got {args.biencoder_steps}")
    if args.steps < 1 or args.save_every < 1:
        raise RecipeError(f"--steps and --save-every must be >= 1, got {args.steps} and {args.save_every}")
    if not 72 <= args.max_tokens <= 512:  # room for a query's 64 tokens, the separators and a passage
        raise RecipeError(f"--max-tokens must be from 72 to 512, got {args.max_tokens}")
    if any(depth < 1 or depth > 1000 for depth in depths):
        raise RecipeError(f"--depths must be from 1 to 1000, got {depths}")
    if any(not 0 <= weight <= 100 for weight in weights):
        raise RecipeError(f"--weights must be from 0 to 100, got {weights}")
    if args.init_reranker is not None and not (args.init_reranker / "config.json").is_file():
        raise RecipeError(f"--init-reranker {args.init_reranker}: no model folder (no config.json)")
    for flag in ("corpus", "queries", "qrels"):
        if not getattr(args, flag).is_file():
            raise RecipeError(f"--{flag} {getattr(args, flag)}: no such file")
    check_settings(args.out, {
        "corpus": str(args.corpus.resolve()), "queries_sha256": _sha256(args.queries),
        "qrels_sha256": _sha256(args.qrels), "index": str(args.index.resolve()) if args.index else None,
        "dev_share": _dev_share(args), "validation_share": args.validation_share, "seed": args.seed,
        **({"split": args.split} if args.split != "grouped" else {}),  # folders made before --split stay valid
        # fold 1 is the plain run at a dev share of 1/N: its folder is one
        **({"folds": args.folds} if args.fold is None and args.folds > 1 else {}),
        **({"fold": f"{args.fold}/{args.folds}"} if args.fold is not None and args.fold > 1 else {}),
        "steps": args.steps, "save_every": args.save_every, "max_depth": max(depths), "max_tokens": args.max_tokens,
        "biencoder_steps": args.biencoder_steps, "tune_first_stage": args.tune_first_stage,
        **({"tune_adopt": args.tune_adopt} if args.tune_adopt != "real" else {}),
        "init_reranker": str(args.init_reranker.resolve()) if args.init_reranker else None})


def _dev_share(args: argparse.Namespace) -> float:
    """The share of the judged queries held out: 1/N with --folds N."""
    if args.folds > 1:
        return 1 / args.folds
    return 0.2 if args.dev_share is None else args.dev_share


def _biencoder(args: argparse.Namespace, fit: Part, inner: Path, searcher: Searcher, first_stage: str) -> Path:
    """The packaged MiniLM fine-tuned on `fit`'s queries (in-batch and one mined negative from the default
    retrieval's top 100, softmax: scripts/scifact.sh's `biencoder`), its training resumed where interrupted, and
    the index of the corpus it encodes (DIR/index-biencoder, with BM25)."""
    (args.out / "runs").mkdir(exist_ok=True)
    negatives = args.out / "runs" / "negatives.run"
    write_run(negatives, as_run(retrieve(searcher, fit.queries, 100)), tag=first_stage)
    model = args.out / "biencoder"
    trained = train_biencoder.main([
        "--corpus", str(args.corpus), "--queries", str(inner / "queries-train.tsv"),
        "--qrels", str(inner / "qrels-train.txt"), "--negatives-run", str(negatives), *BIENCODER_TRAINING,
        "--max-steps", str(args.biencoder_steps), "--save-every", str(min(50, args.biencoder_steps)),
        "--seed", str(args.seed), "--device", args.device, "--resume", *_withhold(args, inner),
        "--output", str(model)])
    if trained:
        raise RecipeError(f"training the bi-encoder into {model} failed (exit {trained})")
    index = args.out / "index-biencoder"
    build_index(args.corpus, index, args.device, checkpoints(model)[-1])
    return index


def _withhold(args: argparse.Namespace, inner: Path) -> list[str]:
    """The trainers' flag keeping the validation and held-out queries' relevant passages out (--split withheld)."""
    return ["--withhold", str(inner / WITHHELD_FILE)] if args.split == "withheld" else []


def _train(args: argparse.Namespace, fit: Part, inner: Path, first_stage: str, stage: str) -> list[Path]:
    """The residual monoBERT trained on `fit`'s lists by `stage` (training.reranking), from `--init-reranker`
    where given; its checkpoints."""
    return train_reranker(args.corpus, inner / "queries-train.tsv", inner / "qrels-train.txt", fit.lists[stage],
                          args.out, tag=first_stage, steps=args.steps, save_every=args.save_every,
                          max_tokens=args.max_tokens, seed=args.seed, device=args.device, init=args.init_reranker,
                          withhold=_withhold(args, inner))


def _validation_rows(args: argparse.Namespace, searchers: Mapping[str, Searcher], stage: str, saved: Sequence[Path],
                     validation: Part, depths: list[int], weights: list[float]) -> list[Row]:
    """Each first stage's row (the default retrieval's first), then every checkpoint's over `stage` at every
    depth and weight on torch, then the best checkpoint's on each other backend, each with its ms/query."""
    rerankers: dict[str, Reranker] = {}
    candidates: list[tuple[Pipeline, dict[str, float]]] = [
        (Pipeline(first_stage=name), validation.scored(Pipeline(first_stage=name), None)) for name in searchers]
    best_checkpoint, best_mean = None, float("-inf")
    for checkpoint in saved:
        reranker = load_reranker(checkpoint, device=args.device, backend="torch")
        scores = reranker_scores(reranker, validation, stage, max(depths), f"validation, {checkpoint.name}")
        untrained = checkpoint == args.init_reranker
        for pipeline in (Pipeline(checkpoint, "torch", d, w, stage, untrained) for d in depths for w in weights):
            values = validation.scored(pipeline, scores)
            candidates.append((pipeline, values))
            mean = sum(values.values()) / len(values)
            if mean > best_mean:
                best_checkpoint, best_mean, rerankers["torch"] = checkpoint, mean, reranker
    backends = args.backends if resolve_device(args.device).type == "cpu" else ["torch"]  # ONNX runs on the CPU
    for backend in [b for b in backends if b != "torch"]:
        rerankers[backend] = load_reranker(best_checkpoint, device=args.device, backend=backend)
        scores = reranker_scores(rerankers[backend], validation, stage, max(depths), f"validation, {backend}")
        candidates += [(pipeline, validation.scored(pipeline, scores)) for pipeline in
                       (Pipeline(best_checkpoint, backend, d, w, stage, best_checkpoint == args.init_reranker)
                        for d in depths for w in weights)]
    if "torch" not in backends:  # torch chose the checkpoint; its rows do not compete
        candidates = [(p, v) for p, v in candidates if p.backend != "torch" or p.checkpoint is None]
        del rerankers["torch"]
    first_ms, times = timed_ms(searchers, stage, rerankers, validation, depths, args.timing_queries)
    return [Row(p, v, first_ms[p.first_stage] if p.checkpoint is None else times[(p.backend, p.depth)])
            for p, v in candidates]


def _held_out(args: argparse.Namespace, reported: Mapping[str, Row], held_out: Part, depth: int,
              indexes: Mapping[str, Path], tuned: Mapping[str, str]) -> dict[str, Reported]:
    """Each reported pipeline's answers to the held-out queries from the service's engine under its settings
    (training.served; written to DIR/answers/LABEL.jsonl), scored once against the default retrieval's. A
    pipeline reported under several labels (the chosen one is often the fast one too) is served once."""
    k = max(ANSWER_K, depth)
    served: dict[Pipeline, dict[str, list[Hit]]] = {}
    values: dict[str, dict[str, float]] = {}
    for label, row in reported.items():
        if row.pipeline not in served:
            try:
                served[row.pipeline] = served_answers(row.pipeline.settings(indexes, tuned), args.device,
                                                      held_out.queries, k, row.pipeline.checkpoint is not None,
                                                      f"held-out, {label}")
            except ValueError as error:
                raise RecipeError(f"held-out, {label}: {error}") from None
        answers = served[row.pipeline]
        write_answers(_answers_file(args.out, label), answers)
        values[label] = per_query(held_out.qrels, ranked_run(answers), MEASURE)
    return {label: Reported(row, paired_bootstrap(values["default"], values[label], seed=args.seed), values[label])
            for label, row in reported.items()}


def _answers_file(out: Path, label: str) -> Path:
    """Where a reported pipeline's held-out answers are kept: DIR/answers/LABEL.jsonl (spaces and commas as -)."""
    return out / "answers" / f"{'-'.join(label.replace(',', ' ').split())}.jsonl"


def _table(report: Mapping[str, Reported], queries: int, validation: Part, first_stage: str) -> str:
    changes = {label: "" if row.pipeline == Pipeline() else
               f"{difference}  {'real' if difference.real else 'not shown'}"
               for label, (row, difference, _) in report.items()}
    name_width = max(len(row.pipeline.name) for row, _, _ in report.values()) + 2
    change_width = max(map(len, changes.values())) + 2
    lines = [f"held-out: {queries} queries, reported once ({MEASURE}; differences from the default retrieval, "
             f"{first_stage}, with paired bootstrap 95% intervals; chosen on {len(validation.queries)} validation "
             f"queries)",
             f"{'':<26}{'pipeline':<{name_width}}{'validation':>10}{'held-out':>10}  {'difference':<{change_width}}"
             f"{'ms/query':>8}"]
    for label, (row, difference, _) in report.items():
        lines.append(f"{label:<26}{row.pipeline.name:<{name_width}}{row.mean:>10.4f}{difference.other:>10.4f}  "
                     f"{changes[label]:<{change_width}}{row.ms:>8.1f}")
    return "\n".join(lines)


def _summary(args, first_stage: str, counts: dict, outer: dict, checkpoints_seen: int, rows: Sequence[Row],
             report: Mapping[str, Reported], indexes: Mapping[str, Path], tuned: Mapping[str, str]) -> dict:
    return {
        "date": time.strftime("%Y-%m-%d"), "default_retrieval": first_stage, "index": str(indexes[DEFAULT]),
        "indexes": {name: str(index) for name, index in indexes.items()}, "tuned": dict(tuned),
        "split": args.split,
        "queries": {"train": counts["train"], "validation": counts["dev"], "held_out": outer["dev"]},
        **({"withheld_passages": counts["withheld"]} if "withheld" in counts else {}),
        "checkpoints": checkpoints_seen, "measure": MEASURE, "budget_ms": args.budget_ms,
        "validation": [{**row.pipeline.as_json(), "mean": row.mean, "ms": row.ms} for row in rows],
        "held_out": {label: {**row.pipeline.as_json(), "validation": row.mean, "ms": row.ms,
                             "held_out": difference.other, "default": difference.base, "difference": difference.mean,
                             "interval": [difference.low, difference.high], "real": difference.real,
                             "settings": row.pipeline.settings(indexes, tuned),
                             "answers": str(_answers_file(args.out, label)), "per_query": values}
                     for label, (row, difference, values) in report.items()},
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training.recipe", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, required=True, help="passages: TSV id<TAB>text or BEIR JSONL")
    parser.add_argument("--queries", type=Path,
                        help="TSV qid<TAB>text or BEIR JSONL (with --unjudged: report only)")
    parser.add_argument("--qrels", type=Path,
                        help="TREC qrels or BEIR TSV (--queries and --qrels both left out: --unjudged)")
    parser.add_argument("--unjudged", action="store_true", help="adapt the bi-encoder from the corpus alone "
                        "(training.unjudged); --queries and --qrels, where given, only report")
    parser.add_argument("--pairs", choices=("titles", "both", "crops", "questions"), default="titles",
                        help="with --unjudged: the training pairs made from the corpus (default titles, against their "
                             "text; both: crops too; crops: spans of the text alone; questions: written by the "
                             "packaged SmolLM2, about 1 s each, kept where the default retrieval finds their passage)")
    parser.add_argument("--questions", type=int, default=QUESTION_PASSAGES, metavar="N",
                        help=f"with --pairs questions: passages drawn to get a question (default {QUESTION_PASSAGES})")
    parser.add_argument("--out", type=Path, required=True, help="folder for the split, runs, model and results")
    parser.add_argument("--index", type=Path, help="an index of --corpus (default: build DIR/index with BM25)")
    parser.add_argument("--split", choices=SPLITS, default="grouped",
                        help="grouped by relevant passage (default), or queries at random with their relevant "
                             "passages withheld from training (training.split)")
    parser.add_argument("--dev-share", type=float, help="share of the queries held out (default 0.2)")
    parser.add_argument("--folds", type=int, default=1,
                        help="cross-validate: N runs, each holding out another 1/N of the queries (default 1: one)")
    parser.add_argument("--fold", type=int, metavar="K", dest="only_fold",
                        help="run fold K of --folds alone; a later run without --fold pools the finished folds")
    parser.add_argument("--validation-share", type=float, default=0.2,
                        help="share of the rest that chooses the pipeline (default 0.2)")
    parser.add_argument("--seed", type=int, default=13, help="seed of the splits, the training and the bootstrap")
    parser.add_argument("--steps", type=int, default=300,
                        help="the monoBERT's training steps of 4 queries (default 300; with --unjudged, 0: no "
                             "reranker)")
    parser.add_argument("--save-every", type=int, default=100, help="steps between the checkpoints compared (100)")
    parser.add_argument("--biencoder-steps", type=int, default=200,
                        help="steps of 16 queries fine-tuning the bi-encoder into a second first stage (default "
                             "200; 0: none)")
    parser.add_argument("--tune-first-stage", action=argparse.BooleanOptionalAction,
                        help="also try the default retrieval with its dense weight and feedback tuned on the "
                             "training queries (default on; with --unjudged, tuned on held-out pairs: default off)")
    parser.add_argument("--tune-adopt", choices=("real", "best"), default="real",
                        help="real: the tuned setting only where its gain is real on the training queries "
                             "(default); best: the best setting there in any case")
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="tokens of a (query, passage) pair, in training and serving (default 256)")
    parser.add_argument("--init-reranker", type=Path, metavar="DIR",
                        help="a reranker to start the monoBERT's training from (default: the packaged MiniLM), "
                             "such as another recipe's checkpoint; it also competes untrained")
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 10, 20], help="rerank depths compared")
    parser.add_argument("--weights", type=float, nargs="+", default=[0, 0.5, 1, 2, 3, 5],
                        help="first-stage weights in the blend compared (0: the reranker alone)")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=["torch", "onnx-int8"],
                        help="the reranker's backends compared (default torch onnx-int8; with --unjudged, torch "
                             "alone)")
    parser.add_argument("--budget-ms", type=float, default=150.0, help="ms/query of the fast pipeline (150)")
    parser.add_argument("--timing-queries", type=int, default=50, help="validation queries timed (default 50)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.fold = None  # the fold a run is (run_folds sets it); --fold asks for one of them alone
    try:
        unjudged = args.unjudged or (args.queries is None and args.qrels is None)
        if args.tune_first_stage is None:
            args.tune_first_stage = not unjudged
        if unjudged:
            run_unjudged(args)
        elif args.queries is None or args.qrels is None:
            raise RecipeError("--queries and --qrels go together (both left out: the recipe runs --unjudged)")
        else:
            (run_folds if args.folds > 1 else run_recipe)(args)
    except (RecipeError, InputFileError, TrainingDataError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
