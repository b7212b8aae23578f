"""Fine-tuning both BERT models through their CLIs: they learn (held-out MRR@10 rises), their
checkpoints serve through the API, and an interrupted run resumes exactly where it stopped.

The demo collection is split by query: q0001-q0300 train, q0301-q0400 are held out. Held-out
queries are ranked over a candidate list each (their relevant passage and random others), so
evaluation stays fast on a CPU.
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import ir_measures
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from index_builder.build import BuildOptions, build_index
from models.cross_encoder import CrossEncoder
from models.encoder import BiEncoder, default_model_path
from models.reranker import load_reranker
from retrieval.fusion import standardised
from retrieval.readers import read_run
from service.settings import ServiceSettings
from tests.conftest import DEMO, head
from tests.test_cross_encoder import tiny_bert
from tests.test_service import started
from training.data import Collection, TrainingDataError, load_collection, load_judged, load_triples, prior_groups
from training.train_biencoder import BiEncoderTrainee, in_batch_positives
from training.train_biencoder import main as train_biencoder
from training.train_cross_encoder import CrossEncoderTrainee
from training.train_cross_encoder import main as train_cross_encoder
from training.trainer import STATE_FILE

TRAIN_QUERIES = 300  # qrels.txt lists q0001... in order, one judgement each


@pytest.fixture(scope="module")
def demo_split(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("split")
    (folder / "train-qrels.txt").write_text(head(DEMO / "qrels.txt", TRAIN_QUERIES))
    held_out = [line.split()[0] for line in (DEMO / "qrels.txt").read_text().splitlines()[TRAIN_QUERIES:]]
    data = ["--corpus", str(DEMO / "corpus.tsv"), "--queries", str(DEMO / "queries.tsv")]
    return {"train": data + ["--qrels", str(folder / "train-qrels.txt")], "held_out": held_out}


@pytest.fixture(scope="module")
def demo() -> Collection:
    return load_judged(DEMO / "corpus.tsv", DEMO / "queries.tsv", DEMO / "qrels.txt")


def candidate_lists(demo: Collection, queries: list[str], size: int) -> dict[str, list[str]]:
    """Each query's relevant passage plus `size - 1` random others, fixed by a seed."""
    rng = np.random.default_rng(7)
    passages = list(demo.passages)
    lists = {}
    for qid in queries:
        others = [pid for pid in rng.choice(passages, size + 5, replace=False) if pid not in demo.positives[qid]]
        lists[qid] = sorted(demo.positives[qid]) + others[: size - 1]
    return lists


def mrr_at_10(demo: Collection, candidates: dict[str, list[str]], score) -> float:
    """MRR@10 of ranking each candidate list by `score(query, passages)`, computed by ir-measures."""
    run = [
        ir_measures.ScoredDoc(qid, pid, float(value))
        for qid, pids in candidates.items()
        for pid, value in zip(pids, score(demo.queries[qid], [demo.passages[pid] for pid in pids]))
    ]
    qrels = [ir_measures.Qrel(qid, pid, 1) for qid in candidates for pid in demo.positives[qid]]
    return ir_measures.calc_aggregate([ir_measures.RR @ 10], qrels, run)[ir_measures.RR @ 10]


def biencoder_scorer(encoder: BiEncoder):
    return lambda query, passages: encoder.encode_passages(passages) @ encoder.encode_queries([query])[0]


@contextmanager
def serving(settings: ServiceSettings):
    """The real app, loading its index (and reranker) in the background as in production; yields once ready."""
    with started(settings) as client:
        assert client.get("/ready").status_code == 200, client.get("/ready").json()
        yield client


def trainer_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "trainer_state.json").read_text())


def test_biencoder_cli_learns_and_its_checkpoint_loads(tmp_path, demo_split, demo, capsys):
    """MiniLM already ranks these candidates almost perfectly (0.99), so the test starts from a small
    random BERT: held-out MRR@10 must rise far above the untrained model's."""
    start = tiny_bert(tmp_path / "random-bert", num_labels=None, hidden=128, layers=2)
    steps = 100
    argv = ["--model", str(start), *demo_split["train"], "--output", str(tmp_path / "run"), "--max-steps", str(steps),
            "--batch-size", "16", "--lr", "1e-3", "--passage-max-tokens", "64", "--save-every", str(steps)]
    assert train_biencoder(argv) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    checkpoint = tmp_path / "run" / f"checkpoint-{steps:07d}"
    assert summary.startswith(f"bi-encoder: {steps} steps") and str(checkpoint) in summary

    candidates = candidate_lists(demo, demo_split["held_out"], size=20)
    untrained = mrr_at_10(demo, candidates, biencoder_scorer(BiEncoder(start, device="cpu", passage_max_tokens=64)))
    trained_encoder = BiEncoder(checkpoint, device="cpu", passage_max_tokens=64)
    trained = mrr_at_10(demo, candidates, biencoder_scorer(trained_encoder))
    print(f"bi-encoder held-out MRR@10: untrained {untrained:.3f}, trained {trained:.3f} after {steps} steps")
    assert trained > untrained + 0.2 and trained > 0.35  # random ranking of 20 candidates: about 0.18
    assert trainer_state(checkpoint)["step"] == steps
    assert trained_encoder.spec.weights_sha256 != BiEncoder(start, device="cpu").spec.weights_sha256

    # The checkpoint serves: index the held-out queries' passages with it, then search over HTTP.
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("".join(f"{pid}\t{demo.passages[pid]}\n" for pid in sorted(set(sum(candidates.values(), [])))))
    build_index(BuildOptions(corpus, tmp_path / "index", bm25=False), trained_encoder)
    with serving(ServiceSettings(index_dir=tmp_path / "index", device="cpu")) as client:
        assert client.get("/ready").json()["index"]["model"] == checkpoint.name
        qid = demo_split["held_out"][0]
        response = client.post("/search", json={"query": demo.queries[qid], "k": 5})
        assert response.status_code == 200 and len(response.json()["results"]) == 5


def test_biencoder_learns_with_the_in_batch_softmax_loss_too(tmp_path, demo_split, demo):
    start = tiny_bert(tmp_path / "random-bert", num_labels=None, hidden=128, layers=2)
    steps = 100
    assert train_biencoder(["--model", str(start), *demo_split["train"], "--output", str(tmp_path / "run"),
                            "--max-steps", str(steps), "--batch-size", "16", "--lr", "1e-3", "--passage-max-tokens",
                            "64", "--save-every", str(steps), "--objective", "softmax"]) == 0
    checkpoint = tmp_path / "run" / f"checkpoint-{steps:07d}"
    candidates = candidate_lists(demo, demo_split["held_out"], size=20)
    untrained = mrr_at_10(demo, candidates, biencoder_scorer(BiEncoder(start, device="cpu", passage_max_tokens=64)))
    trained = mrr_at_10(demo, candidates, biencoder_scorer(BiEncoder(checkpoint, device="cpu", passage_max_tokens=64)))
    print(f"bi-encoder (softmax) held-out MRR@10: untrained {untrained:.3f}, trained {trained:.3f} after {steps} steps")
    assert trained > untrained + 0.2 and trained > 0.35


def test_biencoder_checkpoint_keeps_the_start_models_normalisation(tmp_path, demo_split):
    argv = [*demo_split["train"], "--output", str(tmp_path), "--max-steps", "1", "--batch-size", "2",
            "--passage-max-tokens", "32", "--query-max-tokens", "16"]
    assert train_biencoder(argv) == 0
    trained = BiEncoder(tmp_path / "checkpoint-0000001", device="cpu")
    assert (tmp_path / "checkpoint-0000001" / "1_Pooling" / "config.json").is_file()
    assert (trained.spec.pooling, trained.spec.similarity) == ("mean", "cosine")
    assert trained.spec.passage_segment_id == BiEncoder(default_model_path(), device="cpu").spec.passage_segment_id


def test_biencoder_training_scores_pairs_as_the_encoder_serves_them_prefixes_included():
    encoder = BiEncoder(default_model_path(), device="cpu", query_prefix="query: ", passage_prefix="passage: ")
    trainee = BiEncoderTrainee(encoder, data=None, batch_size=2, negatives=0, seed=13)
    queries, passages = ["what is lift"], ["Lift is a force on a wing.", "A path joins two points."]
    with torch.no_grad():
        scores = trainee.scores(queries, passages).numpy()
    expected = encoder.encode_queries(queries) @ encoder.encode_passages(passages).T
    np.testing.assert_allclose(scores, expected, atol=1e-5)


CROSS_ENCODER_COMMON = ["--batch-size", "2", "--negatives", "3", "--lr", "2e-4", "--query-max-tokens", "32",
                        "--max-tokens", "80"]


@pytest.fixture(scope="module")
def held_out(demo, demo_split) -> dict[str, list[str]]:
    """The last 40 held-out queries, each with its relevant passage and 9 random others: the rerankers' test lists."""
    return candidate_lists(demo, demo_split["held_out"][-40:], size=10)


def cross_encoder_mrr(folder: Path, demo: Collection, held_out: dict[str, list[str]]) -> float:
    return mrr_at_10(demo, held_out, CrossEncoder(folder, device="cpu", max_tokens=80, batch_size=10).score)


@pytest.fixture(scope="module")
def untrained_cross_encoder_mrr(tmp_path_factory, demo_split, demo, held_out) -> float:
    """The packaged MiniLM with a new random head (seeded): --max-steps 0 saves it."""
    out = tmp_path_factory.mktemp("cross-encoder-start")
    assert train_cross_encoder([*demo_split["train"], *CROSS_ENCODER_COMMON, "--output", str(out), "--max-steps", "0"]) == 0
    return cross_encoder_mrr(out / "checkpoint-0000000", demo, held_out)


def test_cross_encoder_cli_learns_from_minilm_and_its_checkpoint_loads(tmp_path, demo_split, demo, held_out,
                                                                       untrained_cross_encoder_mrr):
    """Eq. 1's cross-entropy on each pair learns from the packaged MiniLM (the group softmax's loss is checked by
    hand in test_cross_encoder and through the residual objective below)."""
    steps = 60  # held-out MRR@10 0.85-0.88 over seeds 1, 2, 13; 40 steps gave 0.51-0.80
    assert train_cross_encoder([*demo_split["train"], *CROSS_ENCODER_COMMON, "--output", str(tmp_path / "run"),
                                "--max-steps", str(steps), "--save-every", str(steps)]) == 0
    untrained = untrained_cross_encoder_mrr
    trained = cross_encoder_mrr(tmp_path / "run" / f"checkpoint-{steps:07d}", demo, held_out)
    print(f"cross-encoder held-out MRR@10: untrained {untrained:.3f}, trained {trained:.3f} after {steps} steps")
    assert trained > untrained + 0.3 and trained > 0.6  # random ranking of 10 candidates: about 0.29
    assert (tmp_path / "run" / f"checkpoint-{steps:07d}" / "reranker.json").is_file()


def test_cross_encoder_distils_a_teachers_order_of_each_list(tmp_path, demo_split, demo):
    """A teacher that prefers each list's passages by id (an order no text shows) is distilled: the student
    comes to agree with it on the training lists, and a judged positive the teacher lacks joins its list."""
    qids = sorted(demo.positives)[:TRAIN_QUERIES][:40]
    lists = candidate_lists(demo, qids, size=6)
    teacher = tmp_path / "teacher.run"
    teacher.write_text("".join(f"{qid} Q0 {pid} {rank} {-10.0 * rank} teacher\n"
                               for qid in qids for rank, pid in enumerate(sorted(lists[qid])[1:], start=1)))
    start = tiny_bert(tmp_path / "random-bert", num_labels=None, hidden=32, layers=1)
    common = ["--init", str(start), *demo_split["train"], "--batch-size", "4", "--lr", "1e-3", "--query-max-tokens",
              "32", "--max-tokens", "80", "--objective", "distil", "--teacher-run", str(teacher)]
    steps = 300
    assert train_cross_encoder([*common, "--output", str(tmp_path / "start"), "--max-steps", "0"]) == 0
    assert train_cross_encoder([*common, "--output", str(tmp_path / "run"), "--max-steps", str(steps)]) == 0

    def agreement(folder: Path) -> float:
        """Share of the teacher's ordered pairs (sorted ids) the model orders alike, over the lists."""
        model, agree, pairs = CrossEncoder(folder, device="cpu", max_tokens=80, batch_size=10), 0, 0
        for qid in qids:
            ranked = sorted(lists[qid])[1:]
            scores = model.score(demo.queries[qid], [demo.passages[pid] for pid in ranked])
            for i in range(len(ranked)):
                for j in range(i + 1, len(ranked)):
                    agree, pairs = agree + int(scores[i] > scores[j]), pairs + 1
        return agree / pairs

    before, after = agreement(tmp_path / "start" / "checkpoint-0000000"), agreement(tmp_path / "run" / f"checkpoint-{steps:07d}")
    print(f"agreement with the teacher's order: {before:.3f} untrained, {after:.3f} after {steps} steps")
    assert after > before + 0.3  # 0.51 untrained, 1.00 after 300 steps (a 1-layer BERT: 13 s here)


def test_a_teacher_list_gets_its_judged_positive_at_the_best_teacher_score(demo):
    qid = sorted(demo.positives)[0]
    positive = sorted(demo.positives[qid])[0]
    others = [pid for pid in sorted(demo.passages) if pid not in demo.positives[qid]][:2]
    data = Collection(demo.queries, demo.passages, demo.positives, demo.pairs)
    assert data.use_teacher({qid: [(others[0], -3.0), (others[1], -7.0)], "no-such-query": [(positive, 1.0)]}) == 1
    assert data.teacher == {qid: [(others[0], -3.0), (others[1], -7.0), (positive, -3.0)]}


def test_a_trained_cross_encoder_serves_as_the_reranker(tmp_path, demo_split, small_index):
    assert train_cross_encoder([*demo_split["train"], "--batch-size", "2", "--negatives", "1", "--max-tokens", "64", "--query-max-tokens", "16",
                                "--output", str(tmp_path / "run"), "--max-steps", "2"]) == 0
    checkpoint = tmp_path / "run" / "checkpoint-0000002"
    with serving(ServiceSettings(index_dir=small_index, device="cpu", rerankers=[checkpoint], rerank_depth=10)) as client:
        assert client.get("/ready").json()["index"]["rerankers"] == {"monobert": checkpoint.name}
        body = client.post("/search", json={"query": "join two paths", "k": 3, "rerank": True}).json()
        assert len(body["results"]) == 3 and body["latency_ms"]["rerank"] > 0
        assert all(0 <= r["score"] <= 1 and r["retrieval_score"] is not None for r in body["results"])


@pytest.mark.parametrize("cli", [train_biencoder, train_cross_encoder], ids=["biencoder", "cross_encoder"])
def test_an_interrupted_run_resumes_exactly_where_it_stopped(tmp_path, demo_split, cli, capsys):
    start = tiny_bert(tmp_path / "random-bert", num_labels=None, hidden=32, layers=1)
    flag = "--model" if cli is train_biencoder else "--init"
    out = tmp_path / "run"
    argv = [flag, str(start), *demo_split["train"], "--output", str(out), "--batch-size", "2", "--accumulate", "2",
            "--lr", "1e-3", "--save-every", "2", "--keep-checkpoints", "0", "--device", "cpu"]
    assert cli([*argv, "--max-steps", "4"]) == 0
    uninterrupted = load_file(out / "checkpoint-0000004" / "model.safetensors")

    shutil.rmtree(out / "checkpoint-0000004")  # as if the run had died after step 2
    capsys.readouterr()
    assert cli([*argv, "--max-steps", "4"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert cli([*argv, "--max-steps", "4", "--resume"]) == 0
    assert "2 steps (now at step 4)" in capsys.readouterr().out
    resumed = load_file(out / "checkpoint-0000004" / "model.safetensors")
    for name, tensor in uninterrupted.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=1e-6, msg=name)

    assert cli([*argv, "--max-steps", "6", "--resume"]) == 0
    assert "2 steps (now at step 6)" in capsys.readouterr().out
    assert trainer_state(out / "checkpoint-0000006")["step"] == 6
    optimizer = torch.load(out / "checkpoint-0000006" / "training_state.pt", weights_only=True)["optimizer"]
    assert all(state["step"] == 6 for state in optimizer["state"].values())  # AdamW continued, not restarted
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary folder left behind

    assert cli([*argv, "--max-steps", "8", "--resume", "--batch-size", "3"]) == 2
    assert "batch_size=2" in capsys.readouterr().err
    assert cli([*argv, "--max-steps", "8", "--resume", "--lr", "5e-4"]) == 2  # would come back from the checkpoint
    assert "lr=0.001" in capsys.readouterr().err
    if cli is train_cross_encoder:  # the layers that train are the run's too
        assert cli([*argv, "--max-steps", "8", "--resume", "--freeze-layers", "1"]) == 2
        assert "frozen_layers=0, not 1" in capsys.readouterr().err


def test_cross_encoder_trains_from_a_triples_file(tmp_path, capsys):
    triples = tmp_path / "triples.tsv"
    triples.write_text(
        "what is a path\tos.path: Common pathname manipulations.\tjson: JSON encoder and decoder.\n"
        "copy a tree\tshutil.copytree: Recursively copy a directory tree.\tos.path: Common pathname manipulations.\n"
    )
    start = tiny_bert(tmp_path / "random-bert", num_labels=None, hidden=32, layers=1)
    argv = ["--init", str(start), "--triples", str(triples), "--output", str(tmp_path / "run"), "--max-steps", "2",
            "--batch-size", "2", "--query-max-tokens", "16", "--max-tokens", "48"]
    assert train_cross_encoder(argv) == 0
    model = load_reranker(tmp_path / "run" / "checkpoint-0000002", device="cpu")
    assert model.score("what is a path", ["os.path: Common pathname manipulations."]).shape == (1,)
    # Scored within the token limits it was trained with, not the defaults (64, 512).
    assert (model.query_max_tokens, model.max_tokens) == (16, 48)


def test_frozen_layers_keep_their_starting_weights_while_the_layers_above_train(tmp_path):
    triples = tmp_path / "triples.tsv"
    triples.write_text("what is a path\tos.path: Common pathname manipulations.\tjson: JSON encoder and decoder.\n")
    start = tiny_bert(tmp_path / "random-bert", num_labels=None, hidden=32, layers=2)
    argv = ["--init", str(start), "--triples", str(triples), "--batch-size", "1", "--lr", "1e-2", "--query-max-tokens",
            "16", "--max-tokens", "48", "--freeze-layers", "1"]
    for steps in (0, 2):
        assert train_cross_encoder([*argv, "--output", str(tmp_path / f"run-{steps}"), "--max-steps", str(steps)]) == 0
    before = load_file(tmp_path / "run-0" / "checkpoint-0000000" / "model.safetensors")
    after = load_file(tmp_path / "run-2" / "checkpoint-0000002" / "model.safetensors")
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert not {name for name in moved if ".embeddings." in name or ".layer.0." in name}
    assert {name for name in moved if ".layer.1." in name} and {name for name in moved if "classifier" in name}


def test_residual_batches_take_a_positive_and_negatives_of_the_first_stages_list_with_its_z_scores():
    """A first stage's run on three queries: q0001's list holds its positive, q0002's lacks it, q0003's holds
    nothing else. Each group is a positive and others of the list, carried with their z-scores over the list;
    a missing positive joins at the list's lowest; a list with nothing but positives is not used."""
    data = load_judged(DEMO / "corpus.tsv", DEMO / "queries.tsv", DEMO / "qrels.txt")
    one, two, three = sorted(data.positives)[:3]
    judged = set().union(*data.positives.values())
    others = [pid for pid in data.passages if pid not in judged][:4]
    (positive_one,), (positive_two,), (positive_three,) = (data.positives[qid] for qid in (one, two, three))
    assert data.use_prior({one: [(others[0], 3.0), (positive_one, 2.0), (others[1], 1.0)],
                           two: [(others[2], 5.0), (others[3], 1.0)],
                           three: [(positive_three, 1.0)]}) == 2
    z = standardised(np.array([3.0, 2.0, 1.0]))
    assert data.prior[one] == [(others[0], z[0]), (positive_one, z[1]), (others[1], z[2])]
    assert data.prior[two] == [(others[2], 1.0), (others[3], -1.0), (positive_two, -1.0)]
    for batch in range(3):
        groups = prior_groups(data, batch, batch_size=2, negatives=2, seed=13)
        assert sorted(query for query, _, _ in groups) == sorted([data.queries[one], data.queries[two]])
        for query, passages, prior in groups:
            qid = one if query == data.queries[one] else two
            listed = dict(data.prior[qid])
            pid_of = {data.passages[pid]: pid for pid in listed}
            assert len(passages) == 3 and pid_of[passages[0]] in data.positives[qid]
            assert all(pid_of[text] not in data.positives[qid] for text in passages[1:])
            assert prior == [listed[pid_of[text]] for text in passages]


def test_residual_cli_trains_on_the_first_stages_lists_and_records_them(tmp_path, demo_split, demo, capsys):
    """The residual objective through the CLI: it reads the first stage's run, says how many training queries it
    covers, and its checkpoints record the run and the prior's weight (a resume must match them)."""
    qids = sorted(demo.positives)[:TRAIN_QUERIES][:40]
    prior = tmp_path / "prior.run"
    prior.write_text("".join(f"{qid} Q0 {pid} {rank} {-rank} first-stage\n"
                             for qid, ranked in candidate_lists(demo, qids, size=6).items()
                             for rank, pid in enumerate(ranked, start=1)))
    start = tiny_bert(tmp_path / "random-bert", num_labels=None, hidden=32, layers=1)
    assert train_cross_encoder(["--init", str(start), *demo_split["train"], "--batch-size", "4", "--negatives", "3",
                                "--query-max-tokens", "32", "--max-tokens", "80", "--objective", "residual",
                                "--prior-run", str(prior), "--prior-weight", "0.5", "--max-steps", "4",
                                "--output", str(tmp_path / "run")]) == 0
    assert f"first-stage lists from {prior} for 40 of {TRAIN_QUERIES} queries" in capsys.readouterr().err
    state = json.loads((tmp_path / "run" / "checkpoint-0000004" / STATE_FILE).read_text())
    assert (state["objective"], state["prior_run"], state["prior_weight"]) == ("residual", str(prior), 0.5)


def test_residual_loss_is_low_where_the_first_stage_already_ranks_the_positive_first(demo):
    """The residual objective trains the blend: one model on one batch loses less beside a first stage that
    puts each positive first than beside one that knows nothing, and more beside one that puts it last."""
    qids = sorted(demo.positives)[:8]
    lists = candidate_lists(demo, qids, size=6)
    model = CrossEncoder(default_model_path(), device="cpu", query_max_tokens=32, max_tokens=80, batch_size=8)

    def first_batch_loss(score) -> float:
        data = load_judged(DEMO / "corpus.tsv", DEMO / "queries.tsv", DEMO / "qrels.txt")
        data.use_prior({qid: [(pid, score(pid in demo.positives[qid])) for pid in lists[qid]] for qid in qids})
        trainee = CrossEncoderTrainee(model, data, batch_size=8, negatives=3, seed=13, objective="residual",
                                      prior_weight=2.0)
        with torch.no_grad():
            return trainee.loss(0).item()

    knows = first_batch_loss(lambda relevant: 1.0 if relevant else 0.0)
    knows_nothing = first_batch_loss(lambda relevant: 0.5)
    misleads = first_batch_loss(lambda relevant: 0.0 if relevant else 1.0)
    assert knows < knows_nothing < misleads


@pytest.mark.parametrize(
    "change, reason",
    [
        (["--freeze-layers", "7"], "--freeze-layers must be between 0 and 6"),
        (["--qrels", "missing-qrels.txt"], "missing-qrels.txt: cannot read"),
        (["--triples", "t.tsv"], "either --triples or --corpus"),
        (["--max-steps", "-1"], "--max-steps must be >= 0"),
        (["--objective", "distil"], "--objective distil and --teacher-run go together"),
        (["--teacher-run", "t.run"], "--objective distil and --teacher-run go together"),
        (["--objective", "residual"], "--objective residual and --prior-run go together"),
        (["--prior-run", "p.run"], "--objective residual and --prior-run go together"),
    ],
)
def test_bad_input_exits_2_with_a_one_line_reason(tmp_path, demo_split, capsys, change, reason):
    argv = [*demo_split["train"], "--output", str(tmp_path / "run"), *change]
    assert train_cross_encoder(argv) == 2
    err = capsys.readouterr().err.strip()
    assert reason in err and "\n" not in err


def test_run_negatives_come_from_the_top_k_and_never_a_judged_positive(tmp_path):
    run = tmp_path / "run.txt"
    run.write_text("".join(f"q1 Q0 p{rank} {rank} {10 - rank} dense\n" for rank in range(1, 8)))
    passages = {f"p{n}": f"passage {n}" for n in range(1, 20)}
    collection = Collection({"q1": "query"}, passages, {"q1": {"p2"}}, [("q1", "p2")])
    assert collection.use_run_negatives(read_run(run, depth=4)) == 1
    assert collection.negatives["q1"] == ["p1", "p3", "p4"]
    sampled = collection.sample_negatives("q1", 50, np.random.default_rng(0))
    assert set(sampled) == {"p1", "p3", "p4"}


def test_random_negatives_are_never_a_judged_positive():
    passages = {f"p{n}": f"passage {n}" for n in range(1, 5)}
    collection = Collection({"q1": "query"}, passages, {"q1": {"p1", "p2", "p3"}}, [("q1", "p1")])
    assert set(collection.sample_negatives("q1", 20, np.random.default_rng(0))) == {"p4"}


def test_withheld_passages_are_never_a_positive_a_negative_or_in_a_first_stages_list(tmp_path):
    """`--withhold` (the passages a held-out part judges relevant): q2's only relevant passage p2 is withheld, so
    q2 trains no more; q1 keeps its other positive; p2 and p5 are in no list and never sampled."""
    (tmp_path / "corpus.tsv").write_text("".join(f"p{n}\tpassage {n}\n" for n in range(1, 9)))
    (tmp_path / "queries.tsv").write_text("q1\tfirst\nq2\tsecond\nq3\tthird\n")
    (tmp_path / "qrels.txt").write_text("q1 0 p1 1\nq1 0 p2 1\nq2 0 p2 1\nq3 0 p3 1\n")
    run = {"q1": [("p5", 4.0), ("p2", 3.0), ("p4", 2.0), ("p1", 1.0)], "q3": [("p2", 3.0), ("p6", 2.0), ("p3", 1.0)]}

    def loaded() -> Collection:
        return load_collection(triples=None, corpus=tmp_path / "corpus.tsv", queries=tmp_path / "queries.tsv",
                               qrels=tmp_path / "qrels.txt", withheld=frozenset({"p2", "p5"}))

    data = loaded()
    assert data.pairs == [("q1", "p1"), ("q3", "p3")] and not {"p2", "p5"} & data.passages.keys()
    assert data.use_run_negatives(run) == 2 and data.negatives == {"q1": ["p4"], "q3": ["p6"]}
    assert data.use_prior(run) == 2
    assert [pid for pid, _ in data.prior["q1"]] == ["p4", "p1"] and [pid for pid, _ in data.prior["q3"]] == ["p6", "p3"]
    assert set(loaded().sample_negatives("q1", 200, np.random.default_rng(0))) == {"p3", "p4", "p6", "p7", "p8"}


def test_a_passage_relevant_to_two_queries_of_a_batch_is_a_positive_in_both_rows():
    positives = {"q1": {"p1", "p2"}, "q2": {"p2"}, "q3": {"p3"}}
    # Candidates: the three pairs' passages, then one mined negative per query: p9 for q1, p1 for q2, p2 for q3.
    mask = in_batch_positives(["q1", "q2", "q3"], ["p1", "p2", "p3", "p9", "p1", "p2"], positives)
    assert mask.tolist() == [
        [True, True, False, False, True, True],  # p2, q3's mined negative, is relevant to q1: a positive here
        [False, True, False, False, False, True],
        [False, False, True, False, False, False],
    ]


def test_triples_share_ids_for_repeated_texts_and_drop_negatives_that_are_also_positive(tmp_path):
    path = tmp_path / "triples.tsv"
    path.write_text("q\tA\tB\nq\tB\tC\nr\tA\tC\n")
    data = load_triples(path)
    assert data.queries == {"q0": "q", "q1": "r"}
    assert data.passages == {"p0": "A", "p1": "B", "p2": "C"}
    assert data.positives == {"q0": {"p0", "p1"}, "q1": {"p0"}}
    assert data.negatives == {"q0": ["p2"], "q1": ["p2"]}
    path.write_text("only two\tfields\n")
    with pytest.raises(TrainingDataError, match="line 1"):
        load_triples(path)
