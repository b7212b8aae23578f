"""`python -m training.recipe` on a collection of the user's own (the demo's first 300 passages and the 60
queries judged on them): it holds out a grouped part that reports once, chooses its pipeline on a validation
part of the rest, and writes the service settings that serve exactly the pipeline it measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from models.reranker import load_reranker
from retrieval.evaluation import per_query
from retrieval.index_format import read_manifest
from retrieval.load_options import LoadOptions
from retrieval.readers import read_qrels, read_queries, relevant
from retrieval.searcher import Searcher
from service.settings import ServiceSettings
from tests.conftest import DEMO, SMALL_CORPUS_LINES, head
from tests.test_training import serving
from training.first_stage import DEFAULT, Setting
from training.recipe import ANSWER_K, K, Pipeline, main
from training.served import read_answers
from training.trainer import checkpoints

QUERIES = 60  # q0001..q0060: their relevant passages are within the first 300 corpus lines
ROOT = Path(__file__).resolve().parents[1]


def recipe_args(folder: Path, *extra: str) -> list[str]:
    return ["--corpus", str(folder / "corpus.tsv"), "--queries", str(folder / "queries.tsv"),
            "--qrels", str(folder / "qrels.txt"), "--out", str(folder / "out"), "--steps", "2", "--save-every", "1",
            "--depths", "2", "4", "--weights", "0", "1", "--timing-queries", "5", "--budget-ms", "100000", "--max-tokens", "96", "--biencoder-steps", "1", "--device", "cpu",
            # the tuned first stage adopted even where its gain is not shown on 38 training queries, to follow it
            "--tune-adopt", "best", *extra]


def own_collection(folder: Path) -> Path:
    """The demo's first 300 passages and the 60 queries judged on them, in `folder`."""
    (folder / "corpus.tsv").write_text(head(DEMO / "corpus.tsv", SMALL_CORPUS_LINES))
    (folder / "queries.tsv").write_text(head(DEMO / "queries.tsv", QUERIES))
    (folder / "qrels.txt").write_text(head(DEMO / "qrels.txt", QUERIES))
    return folder


@pytest.fixture(scope="module")
def recipe_out(tmp_path_factory) -> Path:
    folder = own_collection(tmp_path_factory.mktemp("own-collection"))
    done = subprocess.run([sys.executable, "-m", "training.recipe", *recipe_args(folder)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (folder / "out" / "stdout.txt").write_text(done.stdout)
    return folder / "out"


def part(folder: Path, side: str) -> dict[str, set[str]]:
    return {qid: docids for qid, docids in relevant(read_qrels(folder / f"qrels-{side}.txt")).items()
            if qid in read_queries(folder / f"queries-{side}.tsv")}


def test_three_parts_share_no_query_and_no_relevant_passage(recipe_out):
    held_out, train = part(recipe_out / "split", "dev"), part(recipe_out / "split" / "validation", "train")
    validation = part(recipe_out / "split" / "validation", "dev")
    parts = [held_out, train, validation]
    assert sum(map(len, parts)) == QUERIES and all(parts)
    for one in range(3):
        for other in range(one + 1, 3):
            assert not parts[one].keys() & parts[other].keys()
            assert not set().union(*parts[one].values()) & set().union(*parts[other].values())


def test_every_checkpoint_depth_weight_and_backend_is_scored_on_validation_and_the_best_chosen(recipe_out):
    summary = json.loads((recipe_out / "recipe.json").read_text())
    rows = summary["validation"]
    reranked = [(Path(r["checkpoint"]).name, r["backend"], r["depth"], r["weight"]) for r in rows if r["checkpoint"]]
    torch_rows = {(c, d, w) for c, b, d, w in reranked if b == "torch"}
    assert torch_rows == {(c, d, w) for c in ("checkpoint-0000001", "checkpoint-0000002") for d in (2, 4) for w in (0, 1)}
    assert {(d, w) for _, b, d, w in reranked if b == "onnx-int8"} == {(d, w) for d in (2, 4) for w in (0, 1)}
    assert rows[0]["checkpoint"] is None  # the default retrieval competes too
    best = max(row["mean"] for row in rows)
    chosen = summary["held_out"]["chosen"]
    assert chosen["validation"] == best and chosen["ms"] == min(r["ms"] for r in rows if r["mean"] == best)
    fast = summary["held_out"]["fast"]
    assert fast["ms"] <= summary["budget_ms"]
    assert fast["validation"] == max(r["mean"] for r in rows if r["ms"] <= summary["budget_ms"])
    held_out = summary["held_out"]["default"]
    assert held_out["checkpoint"] is None and held_out["difference"] == 0 and held_out["held_out"] == chosen["default"]
    assert summary["queries"]["held_out"] == len(read_queries(recipe_out / "split" / "queries-dev.tsv"))


def test_it_prints_the_held_out_table_and_the_settings_to_serve(recipe_out):
    printed = (recipe_out / "stdout.txt").read_text()
    assert "held-out: " in printed and "reported once" in printed
    serve = next(line for line in printed.splitlines() if line.startswith("serve: "))
    assert f"SEARCH_INDEX_DIR={(recipe_out / 'index').resolve()}" in serve and "ms/query p50 on validation" in serve
    assert printed.splitlines()[-1].startswith("recipe: 2 checkpoints x 2 depths x 2 weights chosen on ")
    env = (recipe_out / "serve.env").read_text()
    assert "SEARCH_INDEX_DIR=" in env and "SEARCH_RERANKERS=" in env


def served_env(file: Path) -> dict[str, str]:
    """The variables a serve.env sets, as `set -a; . FILE` sets them."""
    lines = [line for line in file.read_text().splitlines() if line and not line.startswith("#")]
    return {name: value.strip("'") for name, value in (line.split("=", 1) for line in lines)}


def test_each_reported_pipeline_served_from_its_settings_answers_as_the_recipe_recorded_and_scored(
        recipe_out, monkeypatch):
    # The held-out figures are the service's: each reported pipeline, started from its settings (serve.env and
    # serve-fast.env for the chosen and the fast one), answers every held-out query, asked with a k above any
    # rerank depth as users ask, with the answers the recipe recorded, and they score what the recipe printed.
    summary = json.loads((recipe_out / "recipe.json").read_text())
    reported = summary["held_out"]
    assert "default" in reported and any(row["checkpoint"] for row in reported.values())
    assert served_env(recipe_out / "serve.env") == reported["chosen"]["settings"]
    assert served_env(recipe_out / "serve-fast.env") == reported["fast"]["settings"]
    queries = read_queries(recipe_out / "split" / "queries-dev.tsv")
    qrels = read_qrels(recipe_out / "split" / "qrels-dev.txt")
    for label, row in reported.items():
        reranks = row["checkpoint"] is not None
        with monkeypatch.context() as environment:
            for name, value in row["settings"].items():
                environment.setenv(name, value)
            with serving(ServiceSettings(device="cpu")) as client:
                answers = {qid: client.post("/search", json={"query": text, "k": ANSWER_K, "rerank": reranks}).json()
                           for qid, text in queries.items()}
        recorded = read_answers(Path(row["answers"]))
        assert set(recorded) == set(queries)
        for qid, answer in answers.items():
            results = answer["results"]
            assert len(results) == ANSWER_K > row["depth"]
            if reranks:
                assert answer["score_kind"] == ("blend" if row["weight"] else "probability")
            assert [hit["id"] for hit in results] == [hit["id"] for hit in recorded[qid]], (label, qid)
            np.testing.assert_allclose([hit["score"] for hit in results], [hit["score"] for hit in recorded[qid]],
                                       atol=1e-5, err_msg=f"{label}, {qid}")
        served = per_query(qrels, {qid: [(hit["id"], -hit["rank"]) for hit in answer["results"]]
                                   for qid, answer in answers.items()})
        assert served == pytest.approx(row["per_query"], abs=1e-9), label


def test_a_bi_encoder_fine_tuned_on_the_training_queries_is_a_second_first_stage_chosen_on_validation(recipe_out):
    summary = json.loads((recipe_out / "recipe.json").read_text())
    first_stages = {row["first_stage"]: row["mean"] for row in summary["validation"] if row["checkpoint"] is None}
    assert list(first_stages) == ["default", "tuned", "biencoder"]
    manifest = read_manifest(recipe_out / "index-biencoder")
    assert Path(manifest.encoder.path).resolve().parent == (recipe_out / "biencoder").resolve()
    assert manifest.count == SMALL_CORPUS_LINES
    # The reranker reranks the first stage that reads best on validation (a tie keeps the earlier, the default first).
    reranked_over = {row["first_stage"] for row in summary["validation"] if row["checkpoint"]}
    assert reranked_over == {max(first_stages, key=lambda name: round(first_stages[name], 10))}
    fine_tuned = summary["held_out"]["fine-tuned first stage"]
    assert fine_tuned["settings"] == {"SEARCH_INDEX_DIR": str((recipe_out / "index-biencoder").resolve()),
                                      "SEARCH_RERANKERS": "[]"}
    assert fine_tuned["default"] == summary["held_out"]["default"]["held_out"]


def test_the_first_stage_tuned_on_the_training_queries_is_served_as_the_recipe_searched_it(recipe_out, monkeypatch):
    summary = json.loads((recipe_out / "recipe.json").read_text())
    tuned = summary["held_out"]["tuned first stage"]
    assert tuned["first_stage"] == "tuned" and set(summary["tuned"]) == {
        "SEARCH_DEFAULT_DENSE_WEIGHT", "SEARCH_DEFAULT_FEEDBACK_PASSAGES", "SEARCH_DEFAULT_FEEDBACK_WEIGHT"}
    assert tuned["settings"] == {"SEARCH_INDEX_DIR": str((recipe_out / "index").resolve()), "SEARCH_RERANKERS": "[]",
                                 **summary["tuned"]}
    setting = Setting.from_env(summary["tuned"])
    assert setting != DEFAULT
    # The held-out figure is the tuned searcher's: scored again here from its own answers.
    queries = read_queries(recipe_out / "split" / "queries-dev.tsv")
    searcher = Searcher(recipe_out / "index", load=LoadOptions(device="cpu"), defaults=setting.defaults())
    hits = searcher.batch_search(list(queries.values()), K)
    values = per_query(read_qrels(recipe_out / "split" / "qrels-dev.txt"),
                       {qid: [(hit.id, hit.score) for hit in found] for qid, found in zip(queries, hits)})
    assert values == pytest.approx(tuned["per_query"])
    for name, value in tuned["settings"].items():
        monkeypatch.setenv(name, value)
    query = next(iter(queries.values()))
    with serving(ServiceSettings(device="cpu")) as client:
        answer = client.post("/search", json={"query": query, "k": K}).json()
    assert [hit["id"] for hit in answer["results"]] == [hit.id for hit in hits[0]]


def test_the_reranker_trains_and_serves_at_the_asked_token_limit(recipe_out):
    summary = json.loads((recipe_out / "recipe.json").read_text())
    reranker = load_reranker(summary["held_out"]["chosen"]["checkpoint"] or next(
        r["checkpoint"] for r in summary["validation"] if r["checkpoint"]), device="cpu")
    assert reranker.max_tokens == 96
    assert max(reranker.pair_tokens("a question", ["word " * 500])) == 96


def test_a_reranker_trained_elsewhere_starts_the_training_and_competes_untrained(recipe_out, tmp_path):
    start = next(Path(r["checkpoint"]) for r in json.loads((recipe_out / "recipe.json").read_text())["validation"]
                 if r["checkpoint"])
    argv = recipe_args(recipe_out.parent, "--index", str(recipe_out / "index"), "--out", str(tmp_path / "out"),
                       "--init-reranker", str(start), "--steps", "1", "--biencoder-steps", "0", "--depths", "2",
                       "--weights", "1", "--backends", "torch", "--timing-queries", "2")
    assert main(argv) == 0
    rows = json.loads((tmp_path / "out" / "recipe.json").read_text())["validation"]
    assert [(r["checkpoint"], r["untrained"]) for r in rows if r["checkpoint"]] == [
        (str(start), True), (str(tmp_path / "out" / "model" / "checkpoint-0000001"), False)]
    state = json.loads((tmp_path / "out" / "model" / "checkpoint-0000001" / "trainer_state.json").read_text())
    assert state["started_from"] == str(start)
    assert Pipeline(start, "torch", 2, 1.0, untrained=True).name == f"untrained {start} torch depth 2 weight 1"


def chained_collection(folder: Path) -> dict[str, set[str]]:
    """The recipe's collection with each query also judging the previous query's passage relevant: one chain
    joins all 60 into a single group, as Cranfield's shared judgements join most of its queries. Its positives."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.tsv").write_text(head(DEMO / "corpus.tsv", SMALL_CORPUS_LINES))
    (folder / "queries.tsv").write_text(head(DEMO / "queries.tsv", QUERIES))
    own = [line.split() for line in head(DEMO / "qrels.txt", QUERIES).splitlines()]
    (folder / "qrels.txt").write_text("".join(f"{q} 0 {pid} 1\n" for q, _, pid, _ in own) + "".join(
        f"{q} 0 {previous[2]} 1\n" for (q, *_), previous in zip(own[1:], own)))
    return relevant(read_qrels(folder / "qrels.txt"))


def test_queries_sharing_passages_in_one_group_are_cross_validated_at_random_their_passages_withheld(
        recipe_out, tmp_path, capsys):
    positives = chained_collection(tmp_path)
    argv = recipe_args(tmp_path, "--index", str(recipe_out / "index"), "--steps", "1", "--depths", "2", "--weights",
                       "1", "--backends", "torch", "--timing-queries", "2")
    assert main(argv) == 2  # grouped by relevant passage, nothing can be held out
    assert "the largest has 60 of 60 queries; --split withheld" in capsys.readouterr().err
    out = tmp_path / "withheld"
    # Fold 2 alone (another machine's share, say); then the whole run, which runs fold 1 and pools.
    assert main([*argv, "--out", str(out), "--split", "withheld", "--folds", "2", "--fold", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("recipe: fold 2 of 2")
    assert (out / "fold-2" / "recipe.json").is_file() and not (out / "fold-1").exists()
    assert not (out / "recipe.json").exists()
    assert main([*argv, "--out", str(out), "--split", "withheld", "--folds", "2"]) == 0
    printed = capsys.readouterr()
    assert printed.err.count("finished in") == 1
    assert f"cross-validated: {QUERIES} judged queries in 2 folds, each held out once" in printed.out
    assert printed.out.splitlines()[-1].startswith(f"recipe: 2 folds, each of {QUERIES} judged queries held out once")
    held_out_once = []
    for fold in (out / "fold-1", out / "fold-2"):
        held_out, validation = part(fold / "split", "dev"), part(fold / "split" / "validation", "dev")
        train = part(fold / "split" / "validation", "train")
        assert sorted([*held_out, *validation, *train]) == sorted(positives)
        assert (len(held_out), len(validation)) == (QUERIES // 2, round(0.2 * (QUERIES // 2)))
        assert all(side[qid] == positives[qid] for side in (held_out, validation, train) for qid in side)
        withheld = set().union(*held_out.values(), *validation.values())
        assert set((fold / "split" / "validation" / "withheld.txt").read_text().split()) == withheld
        # Both trainings saw exactly the training queries' pairs on passages no other part judges relevant.
        kept = sum(len(docids - withheld) for docids in train.values())
        assert 0 < kept < sum(map(len, train.values()))
        for model in ("biencoder", "model"):
            assert json.loads((checkpoints(fold / model)[-1] / "trainer_state.json").read_text())["pairs"] == kept
        summary = json.loads((fold / "recipe.json").read_text())
        assert summary["withheld_passages"] == len(withheld) and (fold / "serve.env").is_file()
        held_out_once += held_out
    assert sorted(held_out_once) == sorted(positives)  # every judged query held out in exactly one fold

    # Each pipeline reads on every judged query, each query under its own fold's pipeline.
    summaries = [json.loads((out / f"fold-{k}" / "recipe.json").read_text()) for k in (1, 2)]
    pooled = json.loads((out / "recipe.json").read_text())["pooled"]
    assert list(pooled) == ["default", "tuned first stage", "fine-tuned first stage", "chosen", "fast"]
    for label, row in pooled.items():
        values = {q: v for s in summaries for q, v in s["held_out"][label]["per_query"].items()}
        base = {q: v for s in summaries for q, v in s["held_out"]["default"]["per_query"].items()}
        assert sorted(values) == sorted(positives) and row["held_out"] == pytest.approx(sum(values.values()) / QUERIES)
        assert row["difference"] == pytest.approx(row["held_out"] - sum(base.values()) / QUERIES)
        assert row["interval"][0] <= row["difference"] <= row["interval"][1]
        assert row["ms"] == [s["held_out"][label]["ms"] for s in summaries]

    # A rerun answers from the finished folds and pools them again; other folds in the same folder are refused.
    assert main([*argv, "--out", str(out), "--split", "withheld", "--folds", "2"]) == 0
    assert capsys.readouterr().err.count("finished in") == 2
    assert json.loads((out / "recipe.json").read_text())["pooled"] == pooled
    assert main([*argv, "--out", str(out), "--split", "withheld", "--folds", "3"]) == 2
    assert "was made with other dev_share, folds" in capsys.readouterr().err


def test_a_rerun_asking_other_settings_of_the_same_folder_is_refused(recipe_out, capsys):
    folder = recipe_out.parent
    assert main(recipe_args(folder, "--seed", "14")) == 2
    assert capsys.readouterr().err.strip() == (f"error: {recipe_out} was made with other seed "
                                               f"({recipe_out / 'recipe-settings.json'}): give another --out")


@pytest.mark.parametrize("flag, value, message", [
    ("--max-tokens", "64", "--max-tokens must be from 72 to 512, got 64"),
    ("--folds", "0", "--folds must be from 1 to 100, got 0"),
    ("--weights", "-1", "--weights must be from 0 to 100, got [-1.0]"),
    ("--biencoder-steps", "-1", "--biencoder-steps must be >= 0, got -1"),
    ("--init-reranker", "/nonexistent", "--init-reranker /nonexistent: no model folder (no config.json)"),
])
def test_a_bad_setting_exits_2_naming_it(tmp_path, capsys, flag, value, message):
    assert main(recipe_args(tmp_path, flag, value)) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"


@pytest.mark.parametrize("extra, message", [
    (("--fold", "2"), "--fold K needs --folds N, the folds it is one of"),
    (("--folds", "5", "--fold", "6"), "--fold 6 is not one of --folds 5 (1 to 5)"),
    (("--folds", "5", "--fold", "0"), "--fold 0 is not one of --folds 5 (1 to 5)"),
])
def test_a_fold_outside_the_folds_exits_2(tmp_path, capsys, extra, message):
    assert main(recipe_args(tmp_path, *extra)) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"


def test_folds_and_a_dev_share_exclude_each_other(tmp_path, capsys):
    assert main(recipe_args(tmp_path, "--folds", "5", "--dev-share", "0.3")) == 2
    assert capsys.readouterr().err.strip() == ("error: --dev-share and --folds exclude each other: each of 5 folds "
                                               "holds out 1/5 of the queries")


def test_a_missing_input_file_exits_2_naming_it(tmp_path, capsys):
    assert main(["--corpus", str(tmp_path / "none.tsv"), "--queries", str(tmp_path), "--qrels", str(tmp_path),
                 "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == f"error: --corpus {tmp_path / 'none.tsv'}: no such file"
