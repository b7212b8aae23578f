"""`python -m training.recipe --corpus C --out DIR` with no judgements (training.unjudged), on the demo's first 300
passages: pairs cut from the corpus, split by passage, the bi-encoder and the reranker trained on one side and
chosen on the other, and served; judged queries, where a user has some, only report."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from retrieval.evaluation import as_run, paired_bootstrap, per_query, retrieve
from retrieval.index_format import read_manifest
from retrieval.readers import read_qrels, read_queries
from tests.conftest import DEMO, head
from tests.test_training_recipe import QUERIES, own_collection
from training import first_stage as tuning
from models.reranker import load_reranker
from service.engine.search_engine import SearchEngine
from service.http.routes.search import answer
from service.http.schemas import SearchRequest
from training.pipeline import Pipeline
from training.recipe import main
from training.reranking import Part, reranker_scores
from training.served import ranked_run, served_settings
from training.trainer import STATE_FILE, checkpoints
from training.unjudged import PACKAGED, RERANKED, ROUND_TRIP_K, candidates, make_questions, searcher

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def unjudged(tmp_path_factory, small_corpus, small_index) -> Path:
    """The recipe over the session's small index (the packaged encoder's, of `small_corpus`, a TSV: no titles, so
    crops), its first stage tuned on the held-out pairs, reporting on the 60 demo queries judged on those
    passages."""
    folder = own_collection(tmp_path_factory.mktemp("unjudged"))
    done = subprocess.run([sys.executable, "-m", "training.recipe", "--unjudged", "--corpus", str(small_corpus),
                           "--index", str(small_index), "--queries", str(folder / "queries.tsv"),
                           "--qrels", str(folder / "qrels.txt"), "--out", str(folder / "out"),
                           "--pairs", "crops", "--tune-first-stage", "--biencoder-steps", "2", "--steps", "2",
                           "--save-every", "1", "--depths", "2", "4", "--weights", "0", "1", "--max-tokens", "96",
                           "--device", "cpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (folder / "out" / "stdout.txt").write_text(done.stdout)
    return folder / "out"


def pairs(split: Path, side: str) -> dict[str, str]:
    """Each pair of one side of the split: query id -> the passage it was cut from."""
    return {qid: docid for qid, _, docid, _ in (line.split() for line in (split / f"qrels-{side}.txt").read_text()
                                                  .splitlines())}


def served(unjudged: Path) -> dict[str, str]:
    """The settings serve.env gives the service."""
    return {name: value.strip("'") for name, value in (line.split("=", 1) for line in
            (unjudged / "serve.env").read_text().splitlines() if not line.startswith("#"))}


def test_pairs_cut_from_a_held_out_passage_never_reach_the_training(unjudged):
    training, held_out = pairs(unjudged / "split", "train"), pairs(unjudged / "split", "dev")
    assert training and held_out
    assert not set(training.values()) & set(held_out.values())
    every = {qid: docid for qid, _, docid, _ in (line.split() for line in
                                                  (unjudged / "pairs" / "qrels.txt").read_text().splitlines())}
    assert training | held_out == every  # each pair on one side, none lost
    trained_on = {line.split("\t")[0] for line in (unjudged / "split" / "queries-train.tsv").read_text().splitlines()}
    assert trained_on == set(training)
    # The choice corpus holds every held-out pair's passage.
    choice = {line.split("\t")[0] for line in (unjudged / "choice" / "corpus.tsv").read_text().splitlines()}
    assert set(held_out.values()) <= choice


def test_the_model_with_the_best_held_out_pairs_is_chosen_and_served(unjudged, small_index):
    summary = json.loads((unjudged / "unjudged.json").read_text())
    values = summary["held_out_ndcg@10"]
    assert list(values) == [PACKAGED, "step-2"]  # a checkpoint every 50 steps, and the last
    # Each value is what the candidate's index of the choice corpus answers for the held-out pairs.
    split = unjudged / "split"
    held_out, queries = read_qrels(split / "qrels-dev.txt"), read_queries(split / "queries-dev.tsv")
    by_pair = {}
    for label, value in values.items():
        found = as_run(retrieve(searcher(unjudged / "choice" / f"index-{label}", "cpu"), queries, 10))
        by_pair[label] = per_query(held_out, found)
        assert statistics.fmean(by_pair[label].values()) == pytest.approx(value, abs=1e-9)
    # The best checkpoint is chosen only where its gain over the packaged model is real on the held-out pairs.
    best = max(values, key=lambda label: round(values[label], 10))
    real = best != PACKAGED and paired_bootstrap(by_pair[PACKAGED], by_pair[best], seed=13).real
    assert summary["chosen"] == (best if real else PACKAGED)
    index = Path(served(unjudged)["SEARCH_INDEX_DIR"])
    assert str(index) == summary["index"]
    if summary["chosen"] == PACKAGED:
        assert index == small_index.resolve()
    else:  # the chosen checkpoint encodes the served index
        assert index == (unjudged / "index-biencoder").resolve()
        chosen = candidates(unjudged / "biencoder")[summary["chosen"]]
        assert Path(read_manifest(index).encoder.path).resolve() == chosen.resolve()


def test_the_first_stage_is_tuned_on_the_held_out_pairs_and_served_so(unjudged):
    summary = json.loads((unjudged / "unjudged.json").read_text())
    setting = tuning.Setting.from_env(summary["first_stage"]["env"])
    split = unjudged / "split"
    held_out, queries = read_qrels(split / "qrels-dev.txt"), read_queries(split / "queries-dev.tsv")
    by_setting = tuning.values(searcher(Path(summary["index"]), "cpu"), held_out, queries, tuning.grid())
    assert tuning.adopted(by_setting, list(queries))[0] == setting
    settings = served(unjudged)
    if setting == tuning.DEFAULT:
        assert not any(name.startswith("SEARCH_DEFAULT_") for name in settings)
    else:
        assert {name: settings[name] for name in setting.env()} == setting.env()


def test_the_reranker_trained_on_the_pairs_is_served_where_its_gain_on_the_held_out_pairs_is_real(unjudged):
    summary = json.loads((unjudged / "unjudged.json").read_text())
    setting = tuning.Setting.from_env(summary["first_stage"]["env"])
    stage = summary["reranker"]["first_stage"]
    split = unjudged / "split"
    held_out, queries = read_qrels(split / "qrels-dev.txt"), read_queries(split / "queries-dev.tsv")
    part = Part(queries, held_out, {stage: retrieve(searcher(Path(summary["index"]), "cpu", setting), queries, 10)})
    alone = part.scored(Pipeline(first_stage=stage), None)
    saved = checkpoints(unjudged / "model")
    assert [json.loads((path / STATE_FILE).read_text())["step"] for path in saved] == [1, 2]  # --save-every 1
    # Every checkpoint at every depth and weight, in that order; the first best is the candidate.
    rows = []
    for checkpoint in saved:
        scores = reranker_scores(load_reranker(checkpoint, device="cpu", backend="torch"), part, stage, 4, "test")
        rows += [(Pipeline(checkpoint, "torch", depth, weight, stage), part.scored(
            Pipeline(checkpoint, "torch", depth, weight, stage), scores)) for depth in (2, 4) for weight in (0, 1)]
    assert summary["reranker"]["held_out_ndcg@10"] == pytest.approx(
        {Pipeline(first_stage=stage).name: statistics.fmean(alone.values()),
         **{pipeline.name: statistics.fmean(values.values()) for pipeline, values in rows}}, abs=1e-9)
    pipeline, values = max(rows, key=lambda row: round(statistics.fmean(row[1].values()), 10))
    better = round(statistics.fmean(values.values()), 10) > round(statistics.fmean(alone.values()), 10)
    served_reranker = better and paired_bootstrap(alone, values, seed=13).real
    settings = served(unjudged)
    if served_reranker:
        assert {name: summary["reranker"][name] for name in pipeline.as_json()} == pipeline.as_json()
        assert json.loads(settings["SEARCH_RERANKERS"]) == [str(pipeline.checkpoint.resolve())]
        assert settings["SEARCH_RERANK_DEPTH"] == str(pipeline.depth)
    else:
        assert summary["reranker"]["checkpoint"] is None and settings["SEARCH_RERANKERS"] == "[]"
        assert summary["reranker"]["why"].startswith(
            f"{pipeline.name}'s gain" if better else "no reranked pipeline beats")


def test_judged_queries_only_report_the_packaged_and_the_served_pipeline(unjudged):
    summary = json.loads((unjudged / "unjudged.json").read_text())
    judged, queries = read_qrels(unjudged.parent / "qrels.txt"), read_queries(unjudged.parent / "queries.tsv")
    setting = tuning.Setting.from_env(summary["first_stage"]["env"])
    chosen = per_query(judged, as_run(retrieve(searcher(Path(summary["index"]), "cpu", setting), queries, 10)))
    row = summary["reported"]["hybrid (default)"]
    assert row["chosen"] == pytest.approx(statistics.fmean(chosen.values()), abs=1e-9)
    assert row["queries"] == QUERIES and row["low"] <= row["difference"] <= row["high"]
    served_reranker = summary["reranker"]["checkpoint"] is not None
    assert set(summary["reported"]) == {"hybrid (default)", "dense", *([RERANKED] if served_reranker else [])}
    if served_reranker:  # the service's own answers under serve.env, against the packaged default
        engine_settings = served_settings(served(unjudged), "cpu")
        engine = SearchEngine.served(engine_settings)
        answers = {qid: answer(engine_settings, engine, SearchRequest.model_validate(
            {"query": text, "k": 100, "rerank": True})).hits for qid, text in queries.items()}
        reranked = per_query(judged, ranked_run(answers))
        assert summary["reported"][RERANKED]["chosen"] == pytest.approx(statistics.fmean(reranked.values()), abs=1e-9)
    stdout = (unjudged / "stdout.txt").read_text()
    assert f"on {QUERIES} judged queries (report only)" in stdout and "unjudged recipe: " in stdout
    # No judged query was trained on or chose: the pairs are the corpus's own.
    assert not set(queries) & set(read_queries(unjudged / "pairs" / "queries.tsv"))


def test_questions_are_kept_only_where_the_default_retrieval_finds_their_passage(tmp_path, small_corpus,
                                                                                   small_index):
    """`--pairs questions`: SmolLM2's question for each of N passages drawn, then the round trip."""
    make_questions(small_corpus, tmp_path, small_index, 6, 13, "cpu")
    written, relevant = read_queries(tmp_path / "questions" / "queries.tsv"), read_qrels(tmp_path / "questions" /
                                                                                           "qrels.txt")
    passages = {line.split("\t", 1)[0] for line in small_corpus.read_text().splitlines()}
    assert len(written) == 6 and all(len(question.split()) >= 4 for question in written.values())
    assert all(relevant[qid] == {qid.removeprefix("q:"): 1} and qid.removeprefix("q:") in passages
               for qid in written)
    found = as_run(retrieve(searcher(small_index, "cpu"), written, ROUND_TRIP_K))
    kept, kept_relevant = read_queries(tmp_path / "pairs" / "queries.tsv"), read_qrels(tmp_path / "pairs" / "qrels.txt")
    assert kept == {qid: question for qid, question in written.items()
                    if relevant[qid].keys() & {docid for docid, _ in found[qid]}}
    assert kept_relevant == {qid: relevant[qid] for qid in kept}
    # The pairs' passages are the whole corpus, as the index holds them: the choice draws others from it.
    assert {line.split("\t", 1)[0] for line in (tmp_path / "pairs" / "corpus.tsv").read_text().splitlines()} == passages


def test_questions_for_no_passage_exit_2(tmp_path, capsys, small_corpus):
    from training.questions import main as questions

    assert questions(["--corpus", str(small_corpus), "--out", str(tmp_path), "--passages", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --passages must be at least 1, got 0"


@pytest.mark.parametrize("flags, message", [
    (("--qrels", "QRELS"), "--queries and --qrels go together (with --unjudged, they report and never choose)"),
    (("--biencoder-steps", "0", "--steps", "0"),
     "--biencoder-steps 0 and --steps 0 leave nothing to adapt: give either steps"),
    (("--steps", "-1"), "--biencoder-steps and --steps must be >= 0 and --save-every >= 1, got 200, -1 and 100"),
    (("--depths", "0"), "--depths must be from 1 to 1000, got [0]"),
    (("--weights", "-1"), "--weights must be from 0 to 100, got [-1.0]"),
    (("--pairs", "questions", "--questions", "0"),
     "--questions must be at least 1 (passages drawn to get a question), got 0"),
])
def test_a_bad_unjudged_setting_exits_2_naming_it(tmp_path, capsys, flags, message):
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text(head(DEMO / "corpus.tsv", 5))
    flags = [str(corpus) if flag == "QRELS" else flag for flag in flags]
    assert main(["--unjudged", "--corpus", str(corpus), "--out", str(tmp_path / "out"), *flags]) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"


def test_judged_queries_without_their_qrels_exit_2(tmp_path, capsys):
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text(head(DEMO / "corpus.tsv", 5))
    assert main(["--corpus", str(corpus), "--queries", str(corpus), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --queries and --qrels go together (both left out: the recipe runs --unjudged)")


def test_a_corpus_without_titles_exits_2_with_one_line_naming_the_other_source(tmp_path):
    corpus = tmp_path / "corpus.tsv"  # the default pairs are titles against their text: a TSV has no titles
    corpus.write_text(head(DEMO / "corpus.tsv", 5))
    done = subprocess.run([sys.executable, "-m", "training.recipe", "--corpus", str(corpus), "--out",
                           str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: no titles pairs could be made from {corpus} (the line above says why); --pairs crops cuts them "
        "from the text alone")
