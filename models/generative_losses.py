"""Fine-tuning losses of the generative reranker (paper 003).

All take per-token log-probabilities of the query tokens (and `<eoq>`) given a passage, as
`GenerativeReranker.token_logprobs` returns them: `logprobs` (pairs, T), 0 at padding, and the
bool `mask` of real tokens. A pair's log-likelihood is the sum over its tokens. Sums over a
pair's tokens are averaged over the pairs of a batch, so a loss does not grow with batch size.
"""

from __future__ import annotations

import math

import torch


def mle_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Eq. 2 with the passage as context (eq. 3): -sum_i log p(q_i | q_<i, a) over relevant pairs only."""
    return -(logprobs * mask).sum(dim=1).mean()


def log1m_exp(logp: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(logp)) for logp <= 0, accurate near both ends (Maechler 2012); -inf where p = 1 is
    replaced by log of the smallest float32, so one certain token cannot make the loss infinite."""
    logp = logp.clamp(max=0.0)
    near_one = logp > -math.log(2.0)
    value = torch.where(near_one, torch.log(-torch.expm1(logp)), torch.log1p(-torch.exp(logp)))
    return value.clamp(min=math.log(torch.finfo(torch.float32).tiny))


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
