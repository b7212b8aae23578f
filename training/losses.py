"""Training losses, each cited by its paper's equation.

- `multilabel_margin_loss`: the bi-encoder's MultiLabelMarginLoss, paper 000 eq. 4.
- `in_batch_softmax_loss`: the bi-encoder's alternative, cross-entropy over in-batch negatives (the
  objective the packaged MiniLM was itself trained with).
- `relevance_cross_entropy`: monoBERT's cross-entropy, paper 004 eq. 1.
- `group_softmax_loss`: the cross-encoder's alternative, a softmax over each query's positive and
  its sampled negatives (localized contrastive estimation, Gao et al. 2021), optionally over its blend
  with a first stage's scores (the residual objective).
- `listwise_distillation_loss`: the cross-encoder trained to order each query's list as a teacher
  reranker scores it (knowledge distillation; the teacher: the generative reranker).
- `mle_loss`, `lul_loss`, `rll_loss`: the generative reranker's objectives, paper 003 eqs. 2-5. They
  take per-token log-probabilities of the query tokens (and `<eoq>`) given a passage, as
  `GenerativeReranker.token_logprobs` returns them: `logprobs` (pairs, T), 0 at padding, and the
  bool `mask` of real tokens. A pair's log-likelihood is the sum over its tokens; sums are averaged
  over the pairs of a batch, so a loss does not grow with batch size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from models.cross_encoder import relevance_logit


def multilabel_margin_loss(scores: torch.Tensor, positive: torch.Tensor, margin: float = 1.0) -> torch.Tensor:
    """Paper 000 eq. 4, averaged over the rows of a batch.

    `scores` is (queries, candidates): Rel(q, d) for every query against every candidate
    passage (with in-batch negatives, every passage of the batch). `positive` is a bool
    mask of the same shape: True where the passage is relevant to the query. For one
    row with n candidates, m of them positive:

        L = (1/n) * sum over positive i, negative j of max(0, margin - (s_i - s_j))

    This is exactly `torch.nn.MultiLabelMarginLoss` (which also divides a row's sum by
    its number of classes, n, and averages rows); the mask replaces torch's
    -1-terminated index targets, so a passage relevant to two queries of the batch is
    a positive in both rows. A row with no positive, or no negative, contributes 0.

    Eq. 4's margin is 1, sized for raw inner products; a model that normalises scores by cosine,
    in [-1, 1], where 1 is never met, so every pair keeps pulling at full strength, may want less.
    """
    if scores.shape != positive.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and positive mask {tuple(positive.shape)} differ in shape")
    positive = positive.bool()
    # margins[r, i, j] = margin - (s_ri - s_rj); only (positive i, negative j) pairs count.
    margins = margin - (scores.unsqueeze(2) - scores.unsqueeze(1))
    pairs = positive.unsqueeze(2) & ~positive.unsqueeze(1)
    hinge = margins.clamp(min=0.0) * pairs
    return (hinge.sum(dim=(1, 2)) / scores.shape[1]).mean()


def in_batch_softmax_loss(scores: torch.Tensor, positive: torch.Tensor, scale: float = 20.0) -> torch.Tensor:
    """Cross-entropy of each (query, positive) pair against the query's negatives, averaged over pairs.

    Same inputs as `multilabel_margin_loss`. For row r and positive i:

        L_ri = -log( exp(scale * s_ri) / (exp(scale * s_ri) + sum over negative j of exp(scale * s_rj)) )

    Other positives of the row are left out of the denominator, so a passage relevant to two queries
    is never pushed down for either. Unlike eq. 4's hinge, which stops pulling once every gap
    reaches the margin (see docs/experiments/scifact.md), this keeps ranking the hardest negatives
    below the positive. `scale` 20 is sentence-transformers'
    MultipleNegativesRankingLoss default, for cosine scores in [-1, 1]. Rows with no positive add 0.
    """
    if scores.shape != positive.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and positive mask {tuple(positive.shape)} differ in shape")
    positive = positive.bool()
    logits = scale * scores.float()
    # negatives_lse[r]: log sum over the row's negatives of exp(logit); -inf for a row without one.
    negatives_lse = torch.logsumexp(logits.masked_fill(positive, float("-inf")), dim=1, keepdim=True)
    per_pair = torch.logaddexp(logits, negatives_lse) - logits
    count = positive.sum()
    if count == 0:
        return logits.sum() * 0.0
    return (per_pair * positive).sum() / count


def relevance_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Paper 004 eq. 1, averaged over the query-passage pairs of a batch.

    L = -sum_pos log s_j - sum_neg log(1 - s_j), divided by the number of pairs, where
    s_j = P(relevant). `logits` is (pairs, 2) for a two-label head (s = softmax, label 1
    is "relevant", as in monoBERT) or (pairs, 1) / (pairs,) for a one-logit head
    (s = sigmoid). `labels` holds 1 for relevant and 0 for non-relevant pairs.
    """
    if logits.dim() == 2 and logits.shape[1] == 2:
        return F.cross_entropy(logits.float(), labels.long())
    return F.binary_cross_entropy_with_logits(relevance_logit(logits).float(), labels.float())


def group_softmax_loss(logits: torch.Tensor, group_sizes: list[int],
                       offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Localized contrastive estimation (Gao, Dai and Callan 2021, "Rethink Training of BERT Rerankers
    in Multi-Stage Retrieval Pipeline"), averaged over the groups of a batch.

    The pairs of `logits` come in consecutive groups of `group_sizes`, each a query's positive first
    and then its sampled negatives; a group's loss is -log softmax of the positive's `relevance_logit`
    among the group's. Eq. 1 judges each pair alone, so an easy negative counts as much as a hard
    one; here the negatives compete with the positive for one query, as in reranking.

    `offsets` (one per pair) are added to the logits first: the residual objective's weighted first-stage
    z-scores, so the model is trained as the blend it will be served in (a group the first stage already
    orders by a wide margin pulls little).
    """
    scores = relevance_logit(logits).float()
    if offsets is not None:
        scores = scores + offsets.to(scores)
    if scores.shape[0] != sum(group_sizes):
        raise ValueError(f"{scores.shape[0]} pairs, but groups of {sum(group_sizes)} in all")
    losses = [torch.logsumexp(group, dim=0) - group[0] for group in torch.split(scores, group_sizes)]
    return torch.stack(losses).mean()


def listwise_distillation_loss(logits: torch.Tensor, targets: torch.Tensor, group_sizes: list[int]) -> torch.Tensor:
    """KL(teacher || student) over each group's passages, averaged over the groups of a batch.

    The pairs of `logits` come in consecutive groups of `group_sizes`, each one query's passages; `targets`
    holds the teacher's score of each pair. The teacher's distribution over a group is the softmax of its
    scores standardised over the group (z-scores: a log-likelihood's spread of tens of nats would otherwise
    make it a one-hot), the student's the softmax of its `relevance_logit`s. A group whose teacher scores are
    all equal teaches a uniform order.
    """
    scores = relevance_logit(logits).float()
    if scores.shape[0] != sum(group_sizes) or targets.shape[0] != scores.shape[0]:
        raise ValueError(f"{scores.shape[0]} pairs and {targets.shape[0]} targets, but groups of {sum(group_sizes)}")
    losses = []
    for student, teacher in zip(torch.split(scores, group_sizes), torch.split(targets.float(), group_sizes)):
        spread = teacher.std(unbiased=False)
        teacher = (teacher - teacher.mean()) / spread if spread > 0 else torch.zeros_like(teacher)
        target = torch.softmax(teacher, dim=0)
        losses.append((target * (torch.log(target) - torch.log_softmax(student, dim=0))).sum())
    return torch.stack(losses).mean()


def mle_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Eq. 2 with the passage as context (eq. 3): -sum_i log p(q_i | q_<i, a) over relevant pairs only."""
    return -(logprobs * mask).sum(dim=1).mean()


def log1m_exp(logp: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(logp)) for logp <= 0, accurate near both ends (Maechler 2012); -inf where p = 1 is
    replaced by log of the smallest float32, so one certain token cannot make the loss, or its
    gradient, infinite or NaN. torch.where differentiates both branches, so each gets an input that
    is finite in it (the other's is masked), and 1 - p is floored before its log."""
    tiny = torch.finfo(torch.float32).tiny
    logp = logp.clamp(max=0.0)
    near_one = logp > -math.log(2.0)
    close = torch.log((-torch.expm1(torch.where(near_one, logp, -1.0))).clamp(min=tiny))
    far = torch.log1p(-torch.exp(torch.where(near_one, -1.0, logp)))
    return torch.where(near_one, close, far)


def lul_loss(logprobs: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Eq. 4, likelihood and unlikelihood (LUL): for a relevant pair (label 1) -sum_i log p(q_i | q_<i, a),
    for a non-relevant one (label 0) -sum_i log(1 - p(q_i | q_<i, a)); averaged over the pairs."""
    positive = labels.to(logprobs.dtype)[:, None]
    per_token = -(positive * logprobs + (1.0 - positive) * log1m_exp(logprobs))
    return (per_token * mask).sum(dim=1).mean()


def rll_loss(positive: torch.Tensor, negatives: torch.Tensor, margin: float = 1.0) -> torch.Tensor:
    """Eq. 5, ranking loss on likelihoods (RLL): max(0, margin - log p(q|a+) + log p(q|a-)), with a- the
    highest-scoring of each query's sampled negatives (paper 003, 3.2); averaged over the queries.

    `positive` is (queries,) log p(q|a+); `negatives` is (queries, sampled) log p(q|a-).
    """
    hardest = negatives.max(dim=1).values
    return (margin - positive + hardest).clamp(min=0.0).mean()
