"""The monoBERT cross-encoder: input layout, scoring mechanics, and the training losses (hand-computed)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizerFast

from models.cross_encoder import CrossEncoder
from models.encoder import default_model_path
from training.losses import (
    group_softmax_loss,
    in_batch_softmax_loss,
    listwise_distillation_loss,
    multilabel_margin_loss,
    relevance_cross_entropy,
)

QUERY = "Return the absolute version of a path."
PASSAGES = [
    "os.path.abspath: Return an absolute path.",
    "A very long passage about something else entirely " * 30,
    "short",
    "ast.literal_eval: Evaluate an expression node or a string containing only a Python expression.",
    "shutil.copytree: Recursively copy a directory tree and return the destination directory.",
]


def tiny_bert(folder, num_labels: int | None = 2, hidden: int = 64, layers: int = 2):
    """A BERT with random weights and the packaged MiniLM's tokenizer: a classifier with `num_labels`
    labels, or with `num_labels=None` a plain encoder (like MiniLM's own folder)."""
    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=2 * hidden,
        num_labels=num_labels or 2,
    )
    (BertForSequenceClassification(config) if num_labels else BertModel(config)).save_pretrained(folder)
    BertTokenizerFast.from_pretrained(default_model_path()).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> CrossEncoder:
    return CrossEncoder(tiny_bert(tmp_path_factory.mktemp("models") / "tiny-monobert"), device="cpu", batch_size=2)


def test_scores_are_probabilities_one_per_passage_in_input_order(cross_encoder):
    scores = cross_encoder.score(QUERY, PASSAGES)
    assert scores.dtype == np.float32 and scores.shape == (len(PASSAGES),)
    assert ((scores > 0) & (scores < 1)).all()
    np.testing.assert_allclose(cross_encoder.score(QUERY, PASSAGES[::-1]), scores[::-1], atol=1e-6)
    assert cross_encoder.score(QUERY, []).shape == (0,)
    assert cross_encoder.name == "tiny-monobert"


def test_padding_and_batching_never_change_a_score(cross_encoder):
    batched = cross_encoder.score(QUERY, PASSAGES)
    alone = np.array([cross_encoder.score(QUERY, [passage])[0] for passage in PASSAGES])
    np.testing.assert_allclose(batched, alone, atol=1e-5)


def test_score_is_softmax_label_1_of_the_head_on_bert_pair_input(cross_encoder):
    """Query as segment A, passage as segment B: the same input as the tokenizer's own pair encoding."""
    encoded = cross_encoder.tokenizer(QUERY, PASSAGES[0], return_tensors="pt")
    with torch.inference_mode():
        logits = cross_encoder.model(**encoded).logits
    expected = logits.softmax(dim=-1)[0, 1].item()
    assert cross_encoder.score(QUERY, PASSAGES[:1])[0] == pytest.approx(expected, abs=1e-6)


def test_query_is_truncated_to_64_tokens_and_the_pair_to_512(cross_encoder):
    long_query = "aerodynamic heating of a swept wing " * 30
    long_passage = "boundary layer transition on a flat plate " * 200
    [(ids, segments)] = cross_encoder.tokenize(long_query, [long_passage])
    tokenizer = cross_encoder.tokenizer
    assert len(ids) == 512 and len(segments) == 512
    assert ids[0] == tokenizer.cls_token_id and ids[65] == tokenizer.sep_token_id and ids[-1] == tokenizer.sep_token_id
    assert segments == [0] * 66 + [1] * (512 - 66)
    first_64 = tokenizer.decode(tokenizer(long_query, add_special_tokens=False)["input_ids"][:64])
    np.testing.assert_allclose(
        cross_encoder.score(long_query, PASSAGES), cross_encoder.score(first_64, PASSAGES), atol=1e-6
    )


def test_a_one_logit_head_is_read_as_a_sigmoid(tmp_path):
    model = CrossEncoder(tiny_bert(tmp_path / "one-logit", num_labels=1), device="cpu")
    encoded = model.tokenizer(QUERY, PASSAGES[0], return_tensors="pt")
    with torch.inference_mode():
        expected = torch.sigmoid(model.model(**encoded).logits[0, 0]).item()
    assert model.score(QUERY, PASSAGES[:1])[0] == pytest.approx(expected, abs=1e-6)


def test_a_folder_that_is_not_a_two_or_one_label_checkpoint_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        CrossEncoder(tmp_path, device="cpu")
    with pytest.raises(ValueError, match="num_labels=3"):
        CrossEncoder(tiny_bert(tmp_path / "three", num_labels=3), device="cpu")


# The training losses, against numbers worked out by hand.


def test_multilabel_margin_loss_equals_eq_4_by_hand_and_torch():
    scores = torch.tensor([[2.0, 1.5, 0.5], [0.2, 1.0, 0.6]])
    positive = torch.tensor([[True, False, True], [False, True, False]])
    # Row 0 (positives 0 and 2, negative 1): max(0, 1 - (2.0 - 1.5)) + max(0, 1 - (0.5 - 1.5)) = 0.5 + 2.0 = 2.5
    # Row 1 (positive 1, negatives 0 and 2): max(0, 1 - (1.0 - 0.2)) + max(0, 1 - (1.0 - 0.6)) = 0.2 + 0.6 = 0.8
    # Eq. 4 divides each row by n = 3 candidates; the batch loss is the mean of the rows: (2.5/3 + 0.8/3) / 2.
    loss = multilabel_margin_loss(scores, positive)
    assert loss.item() == pytest.approx(0.55, abs=1e-6)
    targets = torch.tensor([[0, 2, -1], [1, -1, -1]])  # torch's format: positive indices, -1 ends the list
    assert loss.item() == pytest.approx(torch.nn.MultiLabelMarginLoss()(scores, targets).item(), abs=1e-6)
    # margin 0.5: row 0 keeps 0.5 - (0.5 - 1.5) = 1.5 (its gap of 0.5 is met), row 1 keeps 0.5 - 0.4 = 0.1 only
    assert multilabel_margin_loss(scores, positive, margin=0.5).item() == pytest.approx((1.5 / 3 + 0.1 / 3) / 2, abs=1e-6)


def test_in_batch_softmax_loss_leaves_other_positives_out_of_each_pairs_denominator():
    scores = torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.8, 0.8]])
    positive = torch.tensor([[True, False, False], [False, True, True]])
    # Scale 2: row 0 has one pair, -log(e^1.8 / (e^1.8 + e^0.2 + e^1.0)); row 1 has two, each
    # against its one negative only, -log(e^1.6 / (e^1.6 + e^0.4)); the loss is the mean of the 3 pairs.
    row0 = -math.log(math.exp(1.8) / (math.exp(1.8) + math.exp(0.2) + math.exp(1.0)))
    row1 = -math.log(math.exp(1.6) / (math.exp(1.6) + math.exp(0.4)))
    assert in_batch_softmax_loss(scores, positive, scale=2.0).item() == pytest.approx((row0 + 2 * row1) / 3, abs=1e-6)
    # It keeps pulling where eq. 4's hinge at margin 0.1 has stopped: every gap here is at least 0.3.
    assert multilabel_margin_loss(scores, positive, margin=0.1).item() == 0.0
    assert in_batch_softmax_loss(scores, positive).item() > 1e-4


def test_group_softmax_loss_ranks_each_positive_against_its_own_groups_negatives():
    # Two groups, positive first: (log-odds 1 against 0) and (2 against -1 and 3), from a two-label head.
    two_label = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 2.0], [1.0, 0.0], [0.0, 3.0]])
    first = math.log(math.exp(1) + math.exp(0)) - 1
    second = math.log(math.exp(2) + math.exp(-1) + math.exp(3)) - 2
    assert group_softmax_loss(two_label, [2, 3]).item() == pytest.approx((first + second) / 2, abs=1e-6)
    one_logit = torch.tensor([[1.0], [0.0], [2.0], [-1.0], [3.0]])  # the same scores from a one-logit head
    assert group_softmax_loss(one_logit, [2, 3]).item() == pytest.approx((first + second) / 2, abs=1e-6)
    with pytest.raises(ValueError, match="5 pairs, but groups of 4"):
        group_softmax_loss(one_logit, [2, 2])


def test_group_softmax_loss_with_offsets_ranks_the_blend_of_logit_and_offset():
    # The residual objective: logits 1, 0 (positive first) plus the first stage's weighted z-scores -2, 2.
    logits, offsets = torch.tensor([[1.0], [0.0]]), torch.tensor([-2.0, 2.0])
    expected = math.log(math.exp(1 - 2) + math.exp(0 + 2)) - (1 - 2)
    assert group_softmax_loss(logits, [2], offsets).item() == pytest.approx(expected, abs=1e-6)
    assert group_softmax_loss(logits, [2], offsets).item() > group_softmax_loss(logits, [2]).item()


def test_distillation_loss_is_the_kl_of_the_standardised_teacher_to_the_student_per_group():
    # Group 1: teacher log-likelihoods -10, -40 (z: 1, -1), student logits 0, 0. Group 2: teacher all equal
    # (uniform), student 1, 0, 0 from a one-logit head.
    logits = torch.tensor([[0.0], [0.0], [1.0], [0.0], [0.0]])
    targets = torch.tensor([-10.0, -40.0, -5.0, -5.0, -5.0])
    p = [math.exp(1) / (math.exp(1) + math.exp(-1)), math.exp(-1) / (math.exp(1) + math.exp(-1))]
    first = sum(pi * (math.log(pi) - math.log(0.5)) for pi in p)
    q = [math.e / (math.e + 2), 1 / (math.e + 2), 1 / (math.e + 2)]
    second = sum((1 / 3) * (math.log(1 / 3) - math.log(qi)) for qi in q)
    assert listwise_distillation_loss(logits, targets, [2, 3]).item() == pytest.approx((first + second) / 2, abs=1e-6)
    # A student that orders as the teacher, at the teacher's spread, has nothing left to learn.
    assert listwise_distillation_loss(torch.tensor([[1.0], [-1.0]]), torch.tensor([-10.0, -40.0]), [2]).item() == \
        pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match="groups of 4"):
        listwise_distillation_loss(logits, targets, [2, 2])


def test_cross_entropy_equals_eq_1_by_hand_for_two_label_and_one_logit_heads():
    two_label = torch.tensor([[0.0, 0.0], [1.0, 2.0], [2.0, 0.0]])
    labels = torch.tensor([1, 1, 0])
    # s = softmax label 1: 0.5, e^2 / (e + e^2), 1 / (e^2 + 1); eq. 1: -log s (positives), -log(1 - s) (negative)
    s = [0.5, math.exp(2) / (math.e + math.exp(2)), 1 / (math.exp(2) + 1)]
    by_hand = (-math.log(s[0]) - math.log(s[1]) - math.log(1 - s[2])) / 3  # 0.3778
    assert relevance_cross_entropy(two_label, labels).item() == pytest.approx(by_hand, abs=1e-6)
    assert by_hand == pytest.approx(0.3778, abs=1e-4)

    one_logit = torch.tensor([[0.0], [2.0], [-1.0]])
    sigmoid = [1 / (1 + math.exp(-x)) for x in (0.0, 2.0, -1.0)]
    by_hand = (-math.log(sigmoid[0]) - math.log(1 - sigmoid[1]) - math.log(1 - sigmoid[2])) / 3  # 1.0444
    assert relevance_cross_entropy(one_logit, torch.tensor([1, 0, 0])).item() == pytest.approx(by_hand, abs=1e-6)
    assert by_hand == pytest.approx(1.0444, abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
def test_fp16_scoring_on_gpu_agrees_with_fp32_on_cpu(cross_encoder):
    gpu = CrossEncoder(cross_encoder.path, device="cuda")
    assert next(gpu.model.parameters()).dtype == torch.float16
    np.testing.assert_allclose(gpu.score(QUERY, PASSAGES), cross_encoder.score(QUERY, PASSAGES), atol=5e-3)
