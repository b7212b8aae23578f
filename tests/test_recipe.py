"""The SciFact recipe (scripts/scifact.sh), run end to end on a BEIR folder made from the demo collection:
its split holds out a seeded 20% of the judged queries, and the reranker it trains loads in the
service and reorders results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from tests.conftest import DEMO, SMALL_CORPUS_LINES, read_tsv
from tests.test_service import settings_for
from training.split import split_ids, write_split

QUERIES = 60  # q0001..q0060: their relevant passages are within the first 300 corpus lines


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    """WORK of `scifact.sh split index runs monobert` on a tiny BEIR collection (4 monoBERT steps)."""
    data = tmp_path_factory.mktemp("beir")
    passages = list(read_tsv(DEMO / "corpus.tsv").items())[:SMALL_CORPUS_LINES]
    (data / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": pid, "title": "", "text": text}) + "\n" for pid, text in passages))
    queries = list(read_tsv(DEMO / "queries.tsv").items())[:QUERIES]
    (data / "queries-train.jsonl").write_text("".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in queries))
    qrels = [line.split() for line in (DEMO / "qrels.txt").read_text().splitlines()[:QUERIES]]
    (data / "qrels-train.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"{qid}\t{pid}\t{rel}\n" for qid, _, pid, rel in qrels))
    work = data / "work"
    env = {**os.environ, "SCIFACT": str(data), "WORK": str(work), "PYTHON": sys.executable, "DEVICE": "cpu",
           "STEPS_MONOBERT": "4"}
    done = subprocess.run(["bash", "scripts/scifact.sh", "split", "index", "runs", "monobert"], env=env,
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return work


def test_the_split_holds_out_a_seeded_fifth_of_the_judged_queries(recipe):
    dev = [line.split("\t")[0] for line in (recipe / "split" / "queries-dev.tsv").read_text().splitlines()]
    train = [line.split("\t")[0] for line in (recipe / "split" / "queries-train.tsv").read_text().splitlines()]
    assert len(dev) == QUERIES // 5 and len(train) == QUERIES - QUERIES // 5 and not set(dev) & set(train)
    assert dev == split_ids(train + dev, 0.2, seed=13)["dev"]  # the same seed always gives the same split
    assert {line.split()[0] for line in (recipe / "split" / "qrels-dev.txt").read_text().splitlines()} == set(dev)


def test_the_unseen_dev_part_holds_the_dev_queries_whose_passages_no_training_query_judged(tmp_path):
    # Ten claims over six abstracts: a0 is judged for c0-c3, a1 for c4 and c5, a2-a5 for one claim each. Seed 13
    # puts c0 c1 c4 c5 c6 in dev: c0 and c1 share a0 with training claims; a1's claims are both in dev.
    abstract = {f"c{i}": f"a{0 if i < 4 else 1 if i < 6 else i - 4}" for i in range(10)}
    (tmp_path / "queries.tsv").write_text("".join(f"{q}\tclaim {q}\n" for q in abstract))
    (tmp_path / "qrels.txt").write_text("".join(f"{q} 0 {a} 1\n" for q, a in abstract.items()))
    counts = write_split(tmp_path / "queries.tsv", tmp_path / "qrels.txt", tmp_path / "split", dev_share=0.5, seed=13)
    parts = split_ids(list(abstract), 0.5, seed=13)
    trained = {abstract[q] for q in parts["train"]}
    expected = [q for q in parts["dev"] if abstract[q] not in trained]
    assert expected == ["c4", "c5", "c6"]
    unseen = [line.split("\t")[0] for line in (tmp_path / "split" / "queries-dev-unseen.tsv").read_text().splitlines()]
    assert unseen == expected and counts["dev-unseen"] == len(expected)
    assert {line.split()[0] for line in (tmp_path / "split" / "qrels-dev-unseen.txt").read_text().splitlines()} == set(expected)


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
