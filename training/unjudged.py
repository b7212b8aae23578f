"""The recipe for a collection nobody has judged: the packaged MiniLM adapted to the corpus from its own text
(`python -m training.recipe --corpus C --out DIR`, no --qrels, or `--unjudged`):

1. Pairs from the corpus alone (training.pseudo_queries): each passage's title against its text (`--pairs
   titles`, the default), with spans cropped from the text too (`both`: Contriever's independent cropping, 2 a
   passage), or the spans alone (`crops`): DIR/pairs, whose corpus.tsv holds the passages without their titles.
   Or (`questions`) a question written for each of `--questions` passages drawn by the packaged SmolLM2
   (training.questions, into DIR/questions), kept where the default retrieval of INDEX finds its passage in its
   top ROUND_TRIP_K (the round trip): DIR/pairs, whose corpus.tsv holds the whole passages.
2. The pairs split by passage (training.split, grouped, HELD_OUT_SHARE held out, seeded): no passage of a
   held-out pair is trained on (DIR/split).
3. Hard negatives from the default retrieval of INDEX (or the packaged encoder's index of C, built into
   DIR/index), and the bi-encoder fine-tuned on the training pairs as the judged recipe fine-tunes it
   (`--biencoder-steps`, a checkpoint every 50; 0: none, and the packaged model serves): DIR/biencoder.
4. The packaged model and each checkpoint searched for the held-out pairs, dense, among their passages and
   others drawn up to CHOICE_PASSAGES (DIR/choice): the one with the best nDCG@10 is chosen where its gain over
   the packaged model is real on them (a paired bootstrap 95% interval above zero); otherwise the packaged one
   is kept. No judgement is read to choose.
5. The chosen model's index of C (DIR/index-biencoder, unless the packaged one is kept), and its hybrid's dense
   weight and feedback, with `--tune-first-stage`, tuned on the held-out pairs (training.first_stage, up to
   TUNING_PAIRS of them drawn; a setting adopted only where its gain over the defaults is real on them).
6. The residual monoBERT trained as the judged recipe trains it (training.reranking; `--steps`, a checkpoint every
   `--save-every`) on that first stage's lists of the training pairs: DIR/model. Every checkpoint at every depth
   and weight reranks the first stage's lists of the held-out pairs (torch), and the best is served where its gain
   over the first stage alone is real on them; otherwise nothing is reranked. `--steps 0` trains none.
7. DIR/serve.env serving it, and DIR/unjudged.json (every figure).

With --queries and --qrels (judged queries a user has), the packaged index and the served one are measured on
them (hybrid, the default retrieval, and dense; and, where a reranker is served, the service's own answers,
training.served), each difference with a paired bootstrap 95% interval: they report, and are never trained on or
used to choose.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from retrieval.evaluation import Difference, as_run, paired_bootstrap, per_query, retrieve
from retrieval.index_format import read_manifest
from retrieval.load_options import LoadOptions
from retrieval.readers import Qrels, read_qrels, read_queries, write_run
from retrieval.searcher import Searcher, encoder_for
from training import first_stage as tuning
from training import pseudo_queries, questions, train_biencoder
from training.pipeline import (
    BIENCODER,
    BIENCODER_TRAINING,
    DEFAULT,
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
from training.reranking import Part, reranked_values, train_reranker
from training.served import ANSWER_K, ranked_run, served_answers
from training.split import write_split
from training.trainer import STATE_FILE, checkpoints

PAIRS = {"both": ["--crops", "2", "--with-titles"], "crops": ["--crops", "2"], "titles": []}
QUESTIONS = "questions"  # SmolLM2's (training.questions), round-trip filtered
ROUND_TRIP_K = 20
QUESTION_PASSAGES = 1000  # passages drawn to get a question, by default: about 1 s each on a 2-core CPU
HELD_OUT_SHARE = 0.2
# The held-out pairs are searched among their own passages and others up to this many: the choice costs one
# small index a checkpoint, not the corpus's.
CHOICE_PASSAGES = 2000
TUNING_PAIRS = 1000  # held-out pairs the first stage is tuned on, drawn (seeded) where there are more
PACKAGED = "packaged"
SUMMARY_FILE = "unjudged.json"
DEFAULT_MODE = "hybrid (default)"
MODES = {DEFAULT_MODE: {}, "dense": {"mode": "dense"}}
RERANKED = "served, reranked"  # the report's row of a served reranker


def searcher(index: Path, device: str, setting: tuning.Setting = tuning.DEFAULT) -> Searcher:
    """`index`'s Searcher, answering with `setting`'s dense weight and feedback."""
    return Searcher(index, encoder_for(read_manifest(index), device), load=LoadOptions(device=device),
                    defaults=setting.defaults())


def tuned_setting(index: Path, held_out: Qrels, queries: dict[str, str], device: str,
                  seed: int) -> tuple[tuning.Setting, str]:
    """The first stage's setting tuned on (up to TUNING_PAIRS of) the held-out pairs over `index`, and why."""
    served = searcher(index, device)
    if served.bm25 is None:
        return tuning.DEFAULT, "no BM25 in the index: the defaults kept"
    drawn = sorted(queries)
    if len(drawn) > TUNING_PAIRS:
        drawn = sorted(random.Random(seed).sample(drawn, TUNING_PAIRS))
    return tuning.adopted(tuning.values(served, held_out, {q: queries[q] for q in drawn}, tuning.grid()), drawn)


def make_pairs(corpus: Path, out: Path, pairs: str, seed: int) -> None:
    """DIR/pairs cut from the corpus (kept where a run made them already)."""
    if (out / "qrels.txt").is_file():
        return
    if pseudo_queries.main(["--corpus", str(corpus), "--out", str(out), "--seed", str(seed), *PAIRS[pairs]]):
        raise RecipeError(f"no {pairs} pairs could be made from {corpus} (the line above says why)"
                          + ("; --pairs crops cuts them from the text alone" if pairs == "titles" else ""))


def make_questions(corpus: Path, out: Path, index: Path, passages: int, seed: int, device: str) -> None:
    """DIR/pairs of SmolLM2's questions (training.questions, written into DIR/questions) kept where the default
    retrieval of `index` finds their passage in its top ROUND_TRIP_K (the round trip); kept where made already."""
    if (out / "pairs" / "qrels.txt").is_file():
        return
    written = out / "questions"
    if not (written / "qrels.txt").is_file():
        questions.write_questions(corpus, written, passages, seed=seed)
    asked, relevant = read_queries(written / "queries.tsv"), read_qrels(written / "qrels.txt")
    found = as_run(retrieve(searcher(index, device), asked, ROUND_TRIP_K))
    kept = sorted(qid for qid in asked if relevant[qid].keys() & {docid for docid, _ in found.get(qid, [])})
    if not kept:
        raise RecipeError(f"no question written for {corpus} found its passage in the top {ROUND_TRIP_K}")
    print(f"round trip: {len(kept)} of {len(asked)} questions found their passage in the top {ROUND_TRIP_K}",
          file=sys.stderr)
    pseudo_queries.write_files(out / "pairs", {
        "queries.tsv": [f"{qid}\t{asked[qid]}\n" for qid in kept],
        "qrels.txt": [f"{qid} 0 {pid} 1\n" for qid in kept for pid in relevant[qid]],
        "corpus.tsv": (written / "corpus.tsv").read_text(encoding="utf-8").splitlines(keepends=True)})


def choice_corpus(passages: Path, held_out: Qrels, out: Path, seed: int) -> Path:
    """The passages the held-out pairs are searched among: theirs, and others drawn (seeded) up to
    CHOICE_PASSAGES; `passages`: the pairs' corpus.tsv."""
    if not out.is_file():
        lines = passages.read_text(encoding="utf-8").splitlines()
        wanted = {docid for judgements in held_out.values() for docid in judgements}
        theirs = [line for line in lines if line.split("\t", 1)[0] in wanted]
        others = [line for line in lines if line.split("\t", 1)[0] not in wanted]
        drawn = random.Random(seed).sample(others, max(0, min(len(others), CHOICE_PASSAGES - len(theirs))))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(line + "\n" for line in theirs + drawn), encoding="utf-8")
    return out


def candidates(model: Path) -> dict[str, Path | None]:
    """The packaged model (None) first, then each checkpoint of `model` by its step."""
    return {PACKAGED: None, **{f"step-{json.loads((path / STATE_FILE).read_text())['step']}": path
                               for path in checkpoints(model)}}


def held_out_values(choice: Path, out: Path, model: Path, held_out: Qrels, queries: dict[str, str],
                    device: str) -> dict[str, dict[str, float]]:
    """Each candidate's dense nDCG@10 of each held-out pair among the choice corpus (an index of it each)."""
    values = {}
    for label, path in candidates(model).items():
        index = out / f"index-{label}"
        build_index(choice, index, device, path, bm25=False)
        values[label] = per_query(held_out, as_run(retrieve(searcher(index, device), queries, K)))
    return values


def chosen_model(values: dict[str, dict[str, float]], seed: int) -> tuple[str, str]:
    """The candidate with the best mean, where its gain over the packaged model is real on the held-out pairs
    (paired bootstrap 95% interval above zero); otherwise the packaged one. And why."""
    best = max(values, key=lambda label: round(statistics.fmean(values[label].values()), 10))  # a tie: packaged
    if best == PACKAGED:
        return PACKAGED, "no checkpoint beats the packaged model"
    gain = paired_bootstrap(values[PACKAGED], values[best], seed=seed)
    if not gain.real:
        return PACKAGED, f"{best}'s gain, {gain.mean:+.4f} ({gain.low:+.4f} to {gain.high:+.4f}), is not real"
    return best, f"{best}'s gain is real: {gain.mean:+.4f} ({gain.low:+.4f} to {gain.high:+.4f})"


def chosen_reranker(held_out: Part, stage: str, saved: list[Path], depths: list[int], weights: list[float],
                    device: str, seed: int) -> tuple[Pipeline, str, dict[str, float]]:
    """Every checkpoint in `saved` at every depth and weight over `stage`'s lists of the held-out pairs (torch):
    the best, where its gain over `stage` alone is real on them (paired bootstrap 95% interval above zero);
    otherwise `stage` alone. And why, and each pipeline's mean on them. A tie keeps the earlier: smaller depths
    and weights first."""
    alone = held_out.scored(Pipeline(first_stage=stage), None)
    best, best_values = Pipeline(first_stage=stage), alone
    means = {best.name: statistics.fmean(alone.values())}
    for pipeline, values in reranked_values(held_out, stage, saved, depths, weights, device, "held-out pairs"):
        means[pipeline.name] = statistics.fmean(values.values())
        if round(means[pipeline.name], 10) > round(statistics.fmean(best_values.values()), 10):
            best, best_values = pipeline, values
    if best.checkpoint is None:
        return best, "no reranked pipeline beats the first stage alone", means
    gain = paired_bootstrap(alone, best_values, seed=seed)
    if not gain.real:
        return Pipeline(first_stage=stage), f"{best.name}'s gain, {gain}, is not real", means
    return best, f"{best.name}'s gain is real: {gain}", means


def run_unjudged(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    out = args.out
    if (args.queries is None) != (args.qrels is None):
        raise RecipeError("--queries and --qrels go together (with --unjudged, they report and never choose)")
    if args.biencoder_steps < 0 or args.steps < 0 or args.save_every < 1:
        raise RecipeError(f"--biencoder-steps and --steps must be >= 0 and --save-every >= 1, got "
                          f"{args.biencoder_steps}, {args.steps} and {args.save_every}")
    if args.biencoder_steps == 0 and args.steps == 0:
        raise RecipeError("--biencoder-steps 0 and --steps 0 leave nothing to adapt: give either steps")
    depths, weights = sorted(set(args.depths)), sorted(set(args.weights))
    if any(depth < 1 or depth > 1000 for depth in depths):
        raise RecipeError(f"--depths must be from 1 to 1000, got {depths}")
    if any(not 0 <= weight <= 100 for weight in weights):
        raise RecipeError(f"--weights must be from 0 to 100, got {weights}")
    if args.pairs == QUESTIONS and args.questions < 1:
        raise RecipeError(f"--questions must be at least 1 (passages drawn to get a question), got {args.questions}")
    for flag in ("corpus", "queries", "qrels"):
        if getattr(args, flag) is not None and not getattr(args, flag).is_file():
            raise RecipeError(f"--{flag} {getattr(args, flag)}: no such file")
    check_settings(out, {"unjudged": True, "corpus": str(args.corpus.resolve()), "pairs": args.pairs,
                          "index": str(args.index.resolve()) if args.index else None, "seed": args.seed,
                          "biencoder_steps": args.biencoder_steps,
                          "questions": args.questions if args.pairs == QUESTIONS else None,
                          "steps": args.steps, "save_every": args.save_every, "max_tokens": args.max_tokens,
                          "max_depth": max(depths)})
    index = args.index or out / "index"
    pairs, split = out / "pairs", out / "split"
    if args.pairs != QUESTIONS:
        make_pairs(args.corpus, pairs, args.pairs, args.seed)
    if args.index is None:
        build_index(args.corpus, index, args.device)
    if args.pairs == QUESTIONS:  # the round trip searches the index
        make_questions(args.corpus, out, index, args.questions, args.seed, args.device)
    if not (split / "qrels-dev.txt").is_file():
        write_split(pairs / "queries.tsv", pairs / "qrels.txt", split, HELD_OUT_SHARE, args.seed)
    training, held_out = read_queries(split / "queries-train.tsv"), read_queries(split / "queries-dev.tsv")
    print(f"pairs: {len(training)} train, {len(held_out)} held out (split by passage)", file=sys.stderr)

    model = out / "biencoder"
    held_out_qrels = read_qrels(split / "qrels-dev.txt")
    values, choice_passages = {}, 0
    chosen, reason = PACKAGED, "no bi-encoder trained (--biencoder-steps 0)"
    if args.biencoder_steps:
        negatives = out / "runs" / "negatives.run"
        if not negatives.is_file():
            negatives.parent.mkdir(parents=True, exist_ok=True)
            write_run(negatives, as_run(retrieve(searcher(index, args.device), training, 100)), tag=DEFAULT)
        if train_biencoder.main([
                "--corpus", str(pairs / "corpus.tsv"), "--queries", str(split / "queries-train.tsv"),
                "--qrels", str(split / "qrels-train.txt"), "--negatives-run", str(negatives), *BIENCODER_TRAINING,
                "--max-steps", str(args.biencoder_steps), "--save-every", str(min(50, args.biencoder_steps)),
                "--seed", str(args.seed), "--device", args.device, "--resume", "--output", str(model)]):
            raise RecipeError(f"training the bi-encoder into {model} failed")
        choice = choice_corpus(pairs / "corpus.tsv", held_out_qrels, out / "choice" / "corpus.tsv", args.seed)
        choice_passages = len(choice.read_text(encoding="utf-8").splitlines())
        by_pair = held_out_values(choice, out / "choice", model, held_out_qrels, held_out, args.device)
        values = {label: statistics.fmean(found.values()) for label, found in by_pair.items()}
        chosen, reason = chosen_model(by_pair, args.seed)
        print(f"chosen on {len(held_out)} held-out pairs (dense {MEASURE}): {chosen}, as {reason} ("
              + ", ".join(f"{label} {value:.4f}" for label, value in values.items()) + ")", file=sys.stderr)
    indexes, stage = {DEFAULT: index}, DEFAULT
    if chosen != PACKAGED:
        indexes[BIENCODER], stage = out / "index-biencoder", BIENCODER
        build_index(args.corpus, indexes[BIENCODER], args.device, candidates(model)[chosen])
    setting, why = tuning.DEFAULT, "not tuned (--tune-first-stage tunes it)"
    if args.tune_first_stage:
        setting, why = tuned_setting(indexes[stage], held_out_qrels, held_out, args.device, args.seed)
        print(f"first stage tuned on the held-out pairs ({MEASURE}): {why}", file=sys.stderr)
    served = indexes[stage]
    if setting != tuning.DEFAULT:
        indexes[TUNED], stage = served, TUNED
    tuned = setting.env() if stage == TUNED else {}
    first = searcher(served, args.device, setting)
    pipeline, why_reranked, reranked_means = Pipeline(first_stage=stage), "no reranker trained (--steps 0)", {}
    if args.steps:
        pipeline, why_reranked, reranked_means = reranked(args, pairs, split, first, stage, depths, weights, held_out,
                                                          held_out_qrels)
    env_file(out / "serve.env", pipeline, indexes, tuned,
             f"serve: the {chosen} bi-encoder's index, {setting.name}, "
             f"{'reranked by ' + pipeline.name if pipeline.checkpoint else 'not reranked'}; chosen on held-out pairs "
             "with no judgement read")

    report = {}
    if args.qrels is not None:
        judged, queries = read_qrels(args.qrels), read_queries(args.queries)
        compared = {"packaged": searcher(index, args.device), "chosen": first}
        lists = {mode: {name: per_query(judged, as_run(retrieve(loaded, queries, K, **options)))
                        for name, loaded in compared.items()} for mode, options in MODES.items()}
        if pipeline.checkpoint is not None:
            answers = served_answers(pipeline.settings(indexes, tuned), args.device, queries, ANSWER_K, True,
                                     "judged queries, served")
            lists[RERANKED] = {"packaged": lists[DEFAULT_MODE]["packaged"],
                               "chosen": per_query(judged, ranked_run(answers))}
        report = {mode: _row(paired_bootstrap(found["packaged"], found["chosen"], seed=args.seed),
                             len(found["packaged"])) for mode, found in lists.items()}
    summary = {"pairs": {"train": len(training), "held_out": len(held_out), "choice_passages": choice_passages},
               "held_out_ndcg@10": values, "chosen": chosen, "why": reason, "index": str(served.resolve()),
               "first_stage": {"setting": setting.name, "env": setting.env(), "why": why},
               "reranker": {**pipeline.as_json(), "why": why_reranked, "held_out_ndcg@10": reranked_means},
               "serve": pipeline.settings(indexes, tuned), "reported": report}
    write_json(out / SUMMARY_FILE, summary)
    for mode, row in report.items():
        print(f"{mode} on {row['queries']} judged queries (report only): packaged {row['packaged']:.4f}, chosen "
              f"{row['chosen']:.4f}, {row['difference']:+.4f} ({row['low']:+.4f} to {row['high']:+.4f})"
              f"{' real' if row['real'] else ''}, better on {row['better']}, worse on {row['worse']}")
    print(f"unjudged recipe: {len(training)} pairs from the corpus trained the bi-encoder {args.biencoder_steps} "
          f"steps and the reranker {args.steps}, chosen on {len(held_out)} held-out pairs: the {chosen} model "
          f"({setting.name}), {'reranked by ' + pipeline.name if pipeline.checkpoint else 'not reranked'}; served by "
          f"{out / 'serve.env'} in {(time.perf_counter() - started) / 60:.1f} min")
    return summary


def reranked(args: argparse.Namespace, pairs: Path, split: Path, first: Searcher, stage: str, depths: list[int],
             weights: list[float], held_out: dict[str, str], held_out_qrels: Qrels
             ) -> tuple[Pipeline, str, dict[str, float]]:
    """The residual monoBERT trained on `first`'s lists of the training pairs (DIR/model) and the pipeline chosen
    on its lists of the held-out pairs (`chosen_reranker`), why, and each pipeline's mean on them."""
    k = max(max(depths), K)
    training = read_queries(split / "queries-train.tsv")
    saved = train_reranker(pairs / "corpus.tsv", split / "queries-train.tsv", split / "qrels-train.txt",
                           retrieve(first, training, k), args.out, tag=stage, steps=args.steps,
                           save_every=args.save_every, max_tokens=args.max_tokens, seed=args.seed, device=args.device,
                           init=args.init_reranker)
    part = Part(held_out, held_out_qrels, {stage: retrieve(first, held_out, k)})
    pipeline, why, means = chosen_reranker(part, stage, saved, depths, weights, args.device, args.seed)
    print(f"reranker chosen on {len(held_out)} held-out pairs ({MEASURE}): {why}", file=sys.stderr)
    return pipeline, why, means


def _row(difference: Difference, queries: int) -> dict:
    """A report row: packaged -> chosen on `queries` judged queries."""
    return {"packaged": difference.base, "chosen": difference.other, "difference": difference.mean,
            "low": difference.low, "high": difference.high, "real": difference.real,
            "better": difference.better, "worse": difference.worse, "queries": queries}
