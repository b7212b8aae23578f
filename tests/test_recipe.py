"""The SciFact recipe (scripts/scifact.sh), run end to end on a BEIR folder made from the demo collection:
its split holds out a seeded 20% of the judged queries, grouped so that no abstract is relevant on both
sides, and the reranker it trains loads in the service and reorders results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from retrieval.dense_index import gpu_count
from service.http.app import create_app
from tests.conftest import DEMO, SMALL_CORPUS_LINES, read_tsv
from tests.test_service import settings_for
from training.split import WITHHELD_FILE, groups_of, read_withheld, split_fold, split_groups, split_ids, write_split

QUERIES = 60  # q0001..q0060: their relevant passages are within the first 300 corpus lines


def scifact_sh(base: Path, *steps: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """scripts/scifact.sh STEPS with SCIFACT base/data (an empty corpus where none is there), WORK base/work and
    `env` added."""
    (base / "data").mkdir(exist_ok=True)
    (base / "data" / "corpus.jsonl").touch()
    env = {**os.environ, "SCIFACT": str(base / "data"), "WORK": str(base / "work"), "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", "scripts/scifact.sh", *steps], env=env, cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    """WORK of `scifact.sh split index runs monobert` on a tiny BEIR collection (1 monoBERT step)."""
    base = tmp_path_factory.mktemp("recipe")
    data = base / "data"
    data.mkdir()
    passages = list(read_tsv(DEMO / "corpus.tsv").items())[:SMALL_CORPUS_LINES]
    (data / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": pid, "title": "", "text": text}) + "\n" for pid, text in passages))
    queries = list(read_tsv(DEMO / "queries.tsv").items())[:QUERIES]
    (data / "queries-train.jsonl").write_text("".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in queries))
    qrels = [line.split() for line in (DEMO / "qrels.txt").read_text().splitlines()[:QUERIES]]
    (data / "qrels-train.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"{qid}\t{pid}\t{rel}\n" for qid, _, pid, rel in qrels))
    done = scifact_sh(base, "split", "index", "runs", "monobert", timeout=900, DEVICE="cpu", STEPS_MONOBERT="1")
    assert done.returncode == 0, done.stderr[-2000:]
    return base / "work"


def split_of(folder: Path) -> dict[str, list[str]]:
    return {part: [line.split("\t")[0] for line in (folder / f"queries-{part}.tsv").read_text().splitlines()]
            for part in ("train", "dev")}


def test_the_split_holds_out_a_seeded_fifth_of_the_judged_queries(recipe):
    parts = split_of(recipe / "split")
    assert len(parts["dev"]) == QUERIES // 5 and len(parts["train"]) == QUERIES - QUERIES // 5
    assert not set(parts["dev"]) & set(parts["train"])
    for part, ids in parts.items():
        assert {line.split()[0] for line in (recipe / "split" / f"qrels-{part}.txt").read_text().splitlines()} == set(ids)


# Twelve claims over eight abstracts: c0-c3 cite a0; c3 also cites a1, which c4 cites (so c0-c4 are one group,
# joined through c3); c5 and c6 cite a2; c7-c11 cite one abstract each.
CITES = {"c0": ["a0"], "c1": ["a0"], "c2": ["a0"], "c3": ["a0", "a1"], "c4": ["a1"], "c5": ["a2"], "c6": ["a2"],
         "c7": ["a3"], "c8": ["a4"], "c9": ["a5"], "c10": ["a6"], "c11": ["a7"]}


@pytest.fixture
def twelve_claims(tmp_path) -> dict[str, list[str]]:
    (tmp_path / "queries.tsv").write_text("".join(f"{q}\tclaim {q}\n" for q in CITES))
    (tmp_path / "qrels.txt").write_text("".join(f"{q} 0 {a} 1\n" for q, cited in CITES.items() for a in cited))
    return CITES


def test_no_abstract_is_relevant_on_both_sides_of_the_split(tmp_path, twelve_claims):
    cites = twelve_claims
    positives = {q: set(cited) for q, cited in cites.items()}
    assert groups_of(positives) == [["c0", "c1", "c2", "c3", "c4"], ["c10"], ["c11"], ["c5", "c6"], ["c7"], ["c8"],
                                    ["c9"]]
    for seed in range(20):
        counts = write_split(tmp_path / "queries.tsv", tmp_path / "qrels.txt", tmp_path / "split", 0.5, seed)
        parts = split_of(tmp_path / "split")
        assert parts == split_ids(positives, 0.5, seed)  # the same judgements and seed give the same split
        cited = {part: {a for q in ids for a in cites[q]} for part, ids in parts.items()}
        assert not cited["train"] & cited["dev"]
        assert sorted(parts["train"] + parts["dev"]) == sorted(cites) and 1 <= counts["dev"] <= 6
    assert len({tuple(split_ids(positives, 0.5, seed)["dev"]) for seed in range(20)}) > 1  # the seed matters


def test_the_withheld_split_holds_out_queries_at_random_and_withholds_their_relevant_passages(tmp_path, twelve_claims):
    # The same twelve claims: held out at random, c0-c4 may fall on both sides, so every abstract a held-out
    # claim cites is withheld from training (with an outer split's, a9 here), and training cites the others only.
    cites, singletons = twelve_claims, [[q] for q in sorted(twelve_claims)]
    for seed in range(20):
        counts = write_split(tmp_path / "queries.tsv", tmp_path / "qrels.txt", tmp_path / "split", 0.25, seed,
                             "withheld", frozenset({"a9"}))
        parts = split_of(tmp_path / "split")
        assert parts == split_groups(singletons, 0.25, seed) and len(parts["dev"]) == 3
        assert sorted(parts["train"] + parts["dev"]) == sorted(cites)
        withheld = read_withheld(tmp_path / "split" / WITHHELD_FILE)
        assert withheld == {"a9", *(a for q in parts["dev"] for a in cites[q])} and counts["withheld"] == len(withheld)
    assert len({tuple(split_groups(singletons, 0.25, seed)["dev"]) for seed in range(20)}) > 1


@pytest.mark.parametrize("split", ["grouped", "withheld"])
def test_folds_hold_out_every_judged_query_exactly_once_and_the_first_is_the_plain_split(tmp_path, twelve_claims,
                                                                                         split):
    for seed in range(10):
        folds = []
        for fold in range(1, 5):
            counts = write_split(tmp_path / "queries.tsv", tmp_path / "qrels.txt", tmp_path / "split", seed=seed,
                                 split=split, fold=(fold, 4))
            parts = split_of(tmp_path / "split")
            assert sorted(parts["train"] + parts["dev"]) == sorted(CITES) and counts["dev"] == len(parts["dev"])
            if split == "grouped":  # a group is never cut, in any fold
                assert not {a for q in parts["train"] for a in CITES[q]} & {a for q in parts["dev"] for a in CITES[q]}
            else:
                assert read_withheld(tmp_path / "split" / WITHHELD_FILE) == {a for q in parts["dev"] for a in CITES[q]}
            folds.append(parts["dev"])
        assert sorted(q for dev in folds for q in dev) == sorted(CITES)
        groups = groups_of({q: set(cited) for q, cited in CITES.items()}) if split == "grouped" else [
            [q] for q in sorted(CITES)]
        assert folds[0] == split_groups(groups, 0.25, seed)["dev"] == split_fold(groups, 4, 1, seed)["dev"]
        if split == "withheld":
            assert sorted(map(len, folds)) == [3, 3, 3, 3]


@pytest.mark.parametrize("flags, message", [
    ([], "no grouped split holds out a share of 0.2 of the queries: their relevant passages join them into groups "
         "too large (the largest has 3 of 3 queries; --split withheld"),
    (["--folds", "3", "--fold", "2"], "no grouped split holds out fold 2 of 3 of the queries"),
    (["--fold", "2"], "--folds and --fold go together: --folds N --fold K holds out fold K of N"),
    (["--folds", "3", "--fold", "4"], "--folds must be from 2 to 100 and --fold from 1 to --folds, got 3 and 4"),
])
def test_a_split_that_cannot_hold_out_a_group_is_refused(tmp_path, flags, message):
    (tmp_path / "queries.tsv").write_text("c0\tone\nc1\ttwo\nc2\tthree\n")
    (tmp_path / "qrels.txt").write_text("c0 0 a0 1\nc1 0 a0 1\nc1 0 a1 1\nc2 0 a1 1\n")
    done = subprocess.run([sys.executable, "-m", "training.split", "--queries", str(tmp_path / "queries.tsv"),
                           "--qrels", str(tmp_path / "qrels.txt"), "--out", str(tmp_path / "split"), *flags],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 2 and message in done.stderr
    assert not (tmp_path / "split").exists()


def finished_training(folder: Path, steps: int = 1) -> None:
    """`folder` as a training that reached its last step leaves it (its trainer state is what scifact.sh reads)."""
    checkpoint = folder / f"checkpoint-{steps:07d}"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": steps, "settings": {"max_steps": steps}}))


@pytest.mark.parametrize("step, present, missing, writer", [
    ("ensemble", [], "models/generative-mle", "generative"),
    ("ensemble", ["models/generative-mle"], "models/monobert-residual", "monobert-residual"),
    ("distil", [], "models/generative-mle", "generative"),
    ("monobert-generated", [], "models/generative-mle", "generative"),
    ("monobert-generated", ["models/generative-mle"], "index-biencoder", "biencoder"),
])
def test_a_step_run_before_the_step_it_reads_exits_2_naming_that_step(tmp_path, step, present, missing, writer):
    for folder in present:
        finished_training(tmp_path / "work" / folder)
    done = scifact_sh(tmp_path, step, DEVICE="cpu")
    assert done.returncode == 2
    assert done.stderr.strip() == (f"error: no finished {tmp_path / 'work' / missing}: run the step {writer} first "
                                   "(it resumes an interrupted training)")


def test_a_model_whose_training_stopped_short_of_its_last_step_is_not_taken_for_a_finished_one(tmp_path):
    finished_training(tmp_path / "work" / "models" / "generative-mle")
    stopped = tmp_path / "work" / "models" / "monobert-residual" / "checkpoint-0000100"
    stopped.mkdir(parents=True)
    (stopped / "trainer_state.json").write_text(json.dumps({"step": 100, "settings": {"max_steps": 300}}))
    done = scifact_sh(tmp_path, "ensemble", DEVICE="cpu")
    assert done.returncode == 2 and "no finished" in done.stderr and "monobert-residual first" in done.stderr


def test_an_interrupted_training_step_resumes_from_its_newest_checkpoint_when_run_again(recipe, tmp_path):
    import shutil
    import signal

    work = tmp_path / "work"
    for part in ("split", "index", "train-runs"):
        shutil.copytree(recipe / part, work / part)
    shutil.copytree(recipe.parent / "data", tmp_path / "data")
    env = {**os.environ, "SCIFACT": str(tmp_path / "data"), "WORK": str(work), "PYTHON": sys.executable,
           "DEVICE": "cpu", "STEPS_MONOBERT": "4", "SAVE_EVERY": "1"}
    models = work / "models" / "monobert"
    running = subprocess.Popen(["bash", "scripts/scifact.sh", "monobert"], env=env, start_new_session=True,
                               cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while not (models / "checkpoint-0000001" / "trainer_state.json").exists() and time.monotonic() < deadline:
        assert running.poll() is None, "the training ended before it could be interrupted"
        time.sleep(0.05)
    os.killpg(running.pid, signal.SIGKILL)  # the session's end, or a machine lost, mid-training
    running.wait()
    assert not (models / "checkpoint-0000004").exists()
    kept = {path.name: (path / "trainer_state.json").read_text() for path in models.glob("checkpoint-*")}

    again = scifact_sh(tmp_path, "monobert", timeout=600, DEVICE="cpu", STEPS_MONOBERT="4", SAVE_EVERY="1")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "starting from step 0" not in again.stderr
    final = json.loads((models / "checkpoint-0000004" / "trainer_state.json").read_text())
    assert final["step"] == 4
    for name, state in kept.items():  # resumed after them, not recomputed
        assert (models / name / "trainer_state.json").read_text() == state

    trained = {path.name: (path / "trainer_state.json").read_text() for path in models.glob("checkpoint-*")}
    finished = scifact_sh(tmp_path, "monobert", timeout=600, DEVICE="cpu", STEPS_MONOBERT="4", SAVE_EVERY="1")
    assert finished.returncode == 0 and "0 steps (now at step 4)" in finished.stdout  # nothing left to train
    assert {path.name: (path / "trainer_state.json").read_text() for path in models.glob("checkpoint-*")} == trained


@pytest.mark.skipif(gpu_count() > 0 or torch.cuda.is_available(), reason="a GPU is here")
def test_device_cuda_where_no_gpu_is_seen_exits_2_before_any_step(tmp_path):
    done = scifact_sh(tmp_path, "split", DEVICE="cuda")
    assert done.returncode == 2 and "neither faiss nor torch sees a GPU" in done.stderr and "DEVICE=auto" in done.stderr
    assert not (tmp_path / "work").exists()


def test_the_recipe_times_each_step_and_keeps_hard_negative_runs(recipe):
    minutes = (recipe / "minutes.txt").read_text()
    assert "index: " in minutes and "monobert: " in minutes
    assert (recipe / "train-runs" / "dense.run").is_file() and (recipe / "train-runs" / "bm25.run").is_file()


def test_the_reranker_the_recipe_saves_loads_in_the_service_and_reorders_results(recipe, demo_queries):
    checkpoint = sorted((recipe / "models" / "monobert").glob("checkpoint-*"))[-1]
    app = create_app(settings_for(recipe / "index", rerankers=[checkpoint]))
    with TestClient(app) as client:
        deadline = time.monotonic() + 120
        while client.get("/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert client.get("/ready").json()["index"]["rerankers"] == {"monobert": checkpoint.name}
        reordered = 0
        for qid in ("q0001", "q0002", "q0003", "q0004", "q0005"):
            body = client.post("/search", json={"query": demo_queries[qid], "k": 10, "rerank": True, "depth": 10}).json()
            assert body["score_kind"] == "probability"
            scores = [hit["score"] for hit in body["results"]]
            assert scores == sorted(scores, reverse=True)
            retrieval_order = sorted(body["results"], key=lambda hit: -hit["retrieval_score"])
            reordered += [hit["id"] for hit in retrieval_order] != [hit["id"] for hit in body["results"]]
    assert reordered > 0


def pseudo_queries(corpus: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "training.pseudo_queries", "--corpus", str(corpus), "--out", str(out),
                           *extra], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])


def test_titles_become_queries_whose_one_relevant_passage_is_their_own_text_without_the_title(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(record) + "\n" for record in [
        {"_id": "a1", "title": "Aspirin lowers the risk of stroke.", "text": "In 400 patients, aspirin ..."},
        {"_id": "a2", "title": "Short title", "text": "A passage whose title is too short to be a query."},
        {"_id": "a3", "title": "Statins  raise\tmuscle pain in the elderly", "text": "A cohort of ..."},
        {"_id": "a4", "title": "A title with no text to match", "text": ""}]))
    done = pseudo_queries(corpus, tmp_path / "pseudo")
    assert done.returncode == 0 and "wrote 2 title queries (2 passages left out)" in done.stdout
    assert (tmp_path / "pseudo" / "queries.tsv").read_text() == (
        "title:a1\tAspirin lowers the risk of stroke.\ntitle:a3\tStatins raise muscle pain in the elderly\n")
    assert (tmp_path / "pseudo" / "qrels.txt").read_text() == "title:a1 0 a1 1\ntitle:a3 0 a3 1\n"
    assert (tmp_path / "pseudo" / "corpus.tsv").read_text() == "a1\tIn 400 patients, aspirin ...\na3\tA cohort of ...\n"


def test_a_corpus_without_usable_titles_exits_2_naming_it(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"_id": "a1", "title": "", "text": "no title"}) + "\n")
    done = pseudo_queries(corpus, tmp_path / "pseudo")
    assert done.returncode == 2 and f"{corpus}: no passage has a title" in done.stderr


def test_generated_queries_each_judge_the_one_drawn_passage_they_were_sampled_from(tmp_path):
    from models.generative import new_small_model

    texts = dict(list(read_tsv(DEMO / "corpus.tsv").items())[:40])
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"_id": pid, "title": "", "text": text}) + "\n" for pid, text in texts.items()))
    generator = new_small_model(tmp_path / "gpt2", "causal", list(texts.values()), vocab_size=500, width=32)
    flags = ("--generator", str(generator), "--passages", "12", "--min-words", "1", "--device", "cpu")
    done = pseudo_queries(corpus, tmp_path / "a", *flags)
    assert done.returncode == 0, done.stderr
    queries = [line.split("\t") for line in (tmp_path / "a" / "queries.tsv").read_text().splitlines()]
    qrels = [line.split() for line in (tmp_path / "a" / "qrels.txt").read_text().splitlines()]
    written = int(done.stdout.split("wrote ")[1].split()[0])
    assert 0 < written == len(queries) == len(qrels) <= 12
    assert all(qid.startswith("gen:") and query.strip() for qid, query in queries)
    drawn = [qid.removeprefix("gen:") for qid, _ in queries]
    assert len(set(drawn)) == len(drawn) and set(drawn) <= set(texts)
    assert qrels == [[f"gen:{pid}", "0", pid, "1"] for pid in drawn]
    assert not (tmp_path / "a" / "corpus.tsv").exists()  # the corpus itself is the training corpus
    # Seeded: the same seed draws the same passages and writes the same queries; another draws others.
    assert pseudo_queries(corpus, tmp_path / "b", *flags).returncode == 0
    assert (tmp_path / "b" / "queries.tsv").read_text() == (tmp_path / "a" / "queries.tsv").read_text()
    assert pseudo_queries(corpus, tmp_path / "c", *flags, "--seed", "14").returncode == 0
    assert (tmp_path / "c" / "qrels.txt").read_text() != (tmp_path / "a" / "qrels.txt").read_text()


def test_cropped_spans_become_queries_whose_one_relevant_passage_is_the_text_they_were_cut_from(tmp_path):
    words = [f"w{i}" for i in range(60)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(record) + "\n" for record in [
        {"_id": "long", "title": "A title never cropped", "text": " ".join(words)},
        {"_id": "short", "title": "", "text": "seven words are too few to crop"},
        {"_id": "mid", "title": "", "text": " ".join(words[:12])}]))
    done = pseudo_queries(corpus, tmp_path / "a", "--crops", "3")
    assert done.returncode == 0 and "wrote 6 cropped queries (1 passages left out)" in done.stdout, done.stderr
    queries = [line.split("\t") for line in (tmp_path / "a" / "queries.tsv").read_text().splitlines()]
    qrels = [line.split() for line in (tmp_path / "a" / "qrels.txt").read_text().splitlines()]
    texts = dict(line.split("\t") for line in (tmp_path / "a" / "corpus.tsv").read_text().splitlines())
    assert texts == {"long": " ".join(words), "mid": " ".join(words[:12])}  # titles left out, as for title queries
    assert [qid for qid, _ in queries] == [f"crop:{pid}:{n}" for pid in ("long", "mid") for n in range(3)]
    assert qrels == [[qid, "0", qid.split(":")[1], "1"] for qid, _ in queries]
    for qid, span in queries:
        text = texts[qid.split(":")[1]]
        assert f" {span} " in f" {text} "  # a contiguous span of its passage's text
        assert 4 <= len(span.split()) <= max(4, min(len(text.split()) // 2, 24))
    assert len({span for _, span in queries}) > 3  # drawn, not the same span each time
    assert pseudo_queries(corpus, tmp_path / "b", "--crops", "3").returncode == 0  # seeded
    assert (tmp_path / "b" / "queries.tsv").read_text() == (tmp_path / "a" / "queries.tsv").read_text()
    assert pseudo_queries(corpus, tmp_path / "c", "--crops", "3", "--seed", "14").returncode == 0
    assert (tmp_path / "c" / "queries.tsv").read_text() != (tmp_path / "a" / "queries.tsv").read_text()


def test_a_split_of_pairs_cut_from_passages_keeps_each_passage_on_one_side(tmp_path):
    from training.split import write_split

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"p{i}", "title": f"the title of passage number {i}",
                                          "text": " ".join(f"w{i}x{j}" for j in range(40))}) + "\n"
                              for i in range(30)))
    pairs = tmp_path / "pairs"
    done = pseudo_queries(corpus, pairs, "--crops", "4", "--with-titles")
    assert done.returncode == 0 and "wrote 150 cropped and title queries" in done.stdout, done.stderr
    write_split(pairs / "queries.tsv", pairs / "qrels.txt", tmp_path / "split", dev_share=0.2)
    sides = {side: [line.split() for line in (tmp_path / "split" / f"qrels-{side}.txt").read_text().splitlines()]
             for side in ("train", "dev")}
    held_out = {pid for _, _, pid, _ in sides["dev"]}
    assert held_out and not held_out & {pid for _, _, pid, _ in sides["train"]}
    # Every pair of a held-out passage, title and crops alike, is held out with it.
    assert {qid for qid, _, _, _ in sides["dev"]} == {f"{source}{pid}{crop}" for pid in held_out for source, crop in
                                                     [("title:", "")] + [("crop:", f":{n}") for n in range(4)]}


@pytest.mark.parametrize("generated, query", [
    ("IgG cells produce anti-IgA1 antibodies.Aroma compounds are", "IgG cells produce anti-IgA1 antibodies."),
    ("Tf4 binds   integrins.\nassistant\nThe", "Tf4 binds integrins."),
    ("S. aureus grows in 5% of cases. Next, we", "S. aureus grows in 5% of cases."),
    ("The rate (n = 5). More", "The rate (n = 5)."),
    ("A claim cut short by the token limit", "A claim cut short by the token limit"),
])
def test_a_generated_query_is_its_first_sentence(generated, query):
    from training.pseudo_queries import first_sentence

    assert first_sentence(generated) == query


@pytest.mark.parametrize("flags, reason", [
    (("--passages", "3"), "--generator and --passages go together"),
    (("--generator", "GEN", "--passages", "0"), "--passages must be between 1 and 2 (the corpus's passages), got 0"),
    (("--generator", "GEN", "--passages", "3"), "--passages must be between 1 and 2 (the corpus's passages), got 3"),
    (("--with-titles",), "--with-titles adds titles to --crops; titles alone are the default source"),
])
def test_generated_queries_refuse_bad_flags_with_exit_2(tmp_path, flags, reason):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"a{i}", "title": "", "text": "some text"}) + "\n" for i in (1, 2)))
    done = pseudo_queries(corpus, tmp_path / "out", *(str(tmp_path) if flag == "GEN" else flag for flag in flags))
    assert done.returncode == 2 and done.stderr.strip() == f"error: {reason}"
