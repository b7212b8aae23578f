"""The n-gram co-attention reranker (paper 002): input features, masking, checkpoints, training."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from models.coattention import (
    IDF_BUCKETS,
    CoAttentionConfig,
    CoAttentionNet,
    CoAttentionReranker,
    Vocabulary,
    load_glove,
    parameter_counts,
    words,
)
from models.reranker import Reranker, load_reranker
from tests.conftest import DEMO, read_tsv
from tests.test_training import demo, demo_split, held_out, mrr_at_10  # noqa: F401
from training.train_coattention import main as train_main

TINY = dict(hidden=16, feature_dim=8, query_max_words=16, passage_max_words=48, dropout=0.0)
TINY_CLI = ["--hidden", "32", "--feature-dim", "16", "--passage-max-words", "64", "--device", "cpu"]


@pytest.fixture(scope="module")
def passages() -> list[str]:
    return list(read_tsv(DEMO / "corpus.tsv").values())


@pytest.fixture(scope="module")
def tiny(passages) -> CoAttentionReranker:
    vocabulary = Vocabulary.build(passages[:500])
    reranker, _ = CoAttentionReranker.create(vocabulary, CoAttentionConfig(len(vocabulary), **TINY), glove=False,
                                             device="cpu", batch_size=7)
    return reranker


def test_words_are_lowercased_letter_and_digit_runs():
    expected = ["os", "path", "abspath", "path", "return", "doc", "2x"]
    assert words("os.path.abspath(Path): Return __doc__ 2x!") == expected


def test_idf_is_normalised_and_bucketed_by_005():
    vocabulary = Vocabulary.build(["common rare", "common word", "common word", "common word"])
    bucket = {w: vocabulary.idf_bucket[vocabulary.ids[w]] for w in ("common", "word", "rare")}
    # idf = log(N / df) / log(N) with N = 4: common 0, word log(4/3)/log(4) = 0.21, rare 1.
    assert bucket == {"common": 0, "word": 4, "rare": IDF_BUCKETS - 1}
    assert vocabulary.idf_bucket[vocabulary.ids["<unk>"]] == IDF_BUCKETS - 1  # unseen words count as rarest


def test_overlap_position_is_the_words_position_in_the_other_text(tiny):
    # The paper's example: "school" is word 6 of the passage and word 4 of the query; 0 = absent.
    (features,) = tiny.features("I go to school", ["We should come back to school"])
    assert features[2] == [0, 0, 5, 6]
    assert features[5] == [0, 0, 0, 0, 3, 4]


def test_scores_are_float32_one_per_passage_in_input_order(tiny, passages):
    query = "Return the absolute version of a path."
    scores = tiny.score(query, passages[:12])
    assert isinstance(tiny, Reranker)
    assert scores.dtype == np.float32 and scores.shape == (12,)
    np.testing.assert_allclose(tiny.score(query, passages[:12][::-1]), scores[::-1], rtol=1e-5, atol=1e-5)
    assert tiny.score(query, []).shape == (0,)
    assert np.isfinite(tiny.score("", ["", "!!"])).all()  # texts with no word still score


def test_padding_never_changes_a_score(tiny, passages):
    query = "Return the absolute version of a path."
    mixed = [passages[i] for i in (0, 3, 7, 11, 19, 23, 31, 40, 41, 42)]  # 4 to 48+ words
    batched = tiny.score(query, mixed)  # batches of 7, longest first: short passages ride with long ones
    alone = np.array([tiny.score(query, [p])[0] for p in mixed])
    np.testing.assert_allclose(batched, alone, rtol=1e-5, atol=1e-5)


def test_glove_vectors_start_the_word_embeddings_and_stay_frozen(passages):
    vocabulary = Vocabulary.build(passages[:50])
    reranker, found = CoAttentionReranker.create(vocabulary, CoAttentionConfig(len(vocabulary), **TINY), device="cpu")
    glove = load_glove(["function", "the"])
    assert found > len(vocabulary) // 2
    for word, vector in glove.items():
        np.testing.assert_array_equal(reranker.net.word.weight[vocabulary.ids[word]].detach().numpy(), vector)
    assert not reranker.net.word.weight.requires_grad
    trainable, total = parameter_counts(reranker.net)
    assert total - trainable == len(vocabulary) * 50


def test_paper_sized_network_has_about_2m_trainable_parameters():
    # GRU 200 per direction, l = 50, 50-d GloVe; paper 002 reports 3.5M with 300-d GloVe inputs.
    trainable, total = parameter_counts(CoAttentionNet(CoAttentionConfig(vocab_size=1000)))
    assert trainable == 1_954_407 and total == trainable + 1000 * 50


def test_checkpoint_loads_through_load_reranker_without_the_corpus(tiny, tmp_path, passages):
    tiny.save(tmp_path / "model")
    record = json.loads((tmp_path / "model" / "reranker.json").read_text())
    assert record["kind"] == "coattention" and record["idf"]["documents"] == 500
    loaded = load_reranker(tmp_path / "model", device="cpu")
    assert isinstance(loaded, CoAttentionReranker) and loaded.name == "model"
    query = "Create a socket object."
    np.testing.assert_allclose(loaded.score(query, passages[:9]), tiny.score(query, passages[:9]), atol=1e-6)
    assert loaded.vocabulary.idf_bucket == tiny.vocabulary.idf_bucket


def test_training_resumes_exactly_where_it_stopped(tmp_path, demo_split):
    common = [*demo_split["train"], *TINY_CLI, "--batch-size", "2", "--max-steps", "6", "--save-every", "3",
              "--keep-checkpoints", "0", "--max-vocab", "3000"]
    assert train_main([*common, "--output", str(tmp_path / "run")]) == 0
    final = tmp_path / "run" / "checkpoint-0000006"
    uninterrupted = final.joinpath("model.safetensors").read_bytes()
    shutil.rmtree(final)  # as if stopped after the checkpoint at step 3
    assert train_main([*common, "--output", str(tmp_path / "run"), "--resume"]) == 0
    assert final.joinpath("model.safetensors").read_bytes() == uninterrupted


def test_bad_input_exits_2_with_one_line(tmp_path, capsys):
    code = train_main(["--corpus", str(tmp_path / "missing.tsv"), "--queries", str(DEMO / "queries.tsv"),
                       "--qrels", str(DEMO / "qrels.txt"), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and "missing.tsv" in err[0]


def test_coattention_learns_to_rank_held_out_queries(tmp_path, demo_split, demo, held_out, capsys):
    """Trained on 300 demo queries, the relevant passage of 40 others rises well above 9 random ones."""
    common = [*demo_split["train"], *TINY_CLI, "--batch-size", "8", "--seed", "13"]
    assert train_main([*common, "--max-steps", "0", "--output", str(tmp_path / "untrained")]) == 0
    trained_run = [*common, "--max-steps", "120", "--save-every", "120", "--output", str(tmp_path / "trained")]
    assert train_main(trained_run) == 0
    assert "coattention: 120 steps" in capsys.readouterr().out

    def held_out_mrr(checkpoint):
        return mrr_at_10(demo, held_out, load_reranker(checkpoint, device="cpu").score)

    untrained = held_out_mrr(tmp_path / "untrained" / "checkpoint-0000000")
    trained = held_out_mrr(tmp_path / "trained" / "checkpoint-0000120")
    print(f"co-attention held-out MRR@10: untrained {untrained:.3f}, trained {trained:.3f} after 120 steps")
    assert trained >= untrained + 0.2
