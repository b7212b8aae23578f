"""The monoBERT cross-encoder reranker (paper 004, section 2).

The query is segment A, truncated to 64 tokens; the passage is segment B, truncated
so that `[CLS] query [SEP] passage [SEP]` fits in 512 tokens. The `[CLS]` vector goes
through one linear layer to P(relevant), and passages are ranked by it.

A checkpoint directory is any local Hugging Face BERT sequence-classification folder
with its tokenizer: two labels (monoBERT; P(relevant) = softmax probability of label 1)
or one logit (P(relevant) = its sigmoid).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification

from models.encoder import length_sorted_batches, load_checkpoint


def relevance_probability(logits: torch.Tensor) -> torch.Tensor:
    """P(relevant) per pair: softmax label 1 of a two-label head, sigmoid of a one-logit head."""
    logits = logits.float()
    if logits.shape[-1] == 2:
        return logits.softmax(dim=-1)[:, 1]
    return torch.sigmoid(logits[:, 0])


class CrossEncoder:
    """Scores a query against many passages; thread-compatible for inference."""

    def __init__(
        self,
        path: str | Path,
        *,
        device: str = "auto",
        query_max_tokens: int = 64,
        max_tokens: int = 512,
        batch_size: int = 32,
        fp16: bool | None = None,
    ) -> None:
        self.path = Path(path)
        self.name = self.path.name
        self.tokenizer, self.model, self.device = load_checkpoint(
            self.path, AutoModelForSequenceClassification, device, fp16
        )
        self.batch_size = batch_size
        if self.model.config.num_labels not in (1, 2):
            labels = self.model.config.num_labels
            raise ValueError(f"{self.path}: expected a 1- or 2-label head, got num_labels={labels}")
        self.max_tokens = min(max_tokens, self.model.config.max_position_embeddings)
        self.query_max_tokens = query_max_tokens
        if self.query_max_tokens + 4 > self.max_tokens:
            raise ValueError(
                f"query_max_tokens={query_max_tokens} leaves no room for a passage in max_tokens={self.max_tokens}"
            )

    def score(self, query: str, passages: Sequence[str]) -> np.ndarray:
        """P(relevant) of each passage to `query`, float32, in the order of `passages`."""
        out = np.empty(len(passages), dtype=np.float32)
        if not passages:
            return out
        pairs = self.tokenize(query, passages)
        with torch.inference_mode():
            for positions in length_sorted_batches([len(ids) for ids, _ in pairs], self.batch_size):
                logits = self.logits([pairs[i] for i in positions])
                out[positions] = relevance_probability(logits).cpu().numpy()
        return out

    def tokenize(self, query: str, passages: Sequence[str]) -> list[tuple[list[int], list[int]]]:
        """(input ids, segment ids) of `[CLS] query [SEP] passage [SEP]` for each passage, within the token limits."""
        query_ids = self.tokenizer(query, add_special_tokens=False, truncation=True, max_length=self.query_max_tokens)
        query_ids = query_ids["input_ids"]
        passage_budget = self.max_tokens - len(query_ids) - 3
        passage_ids = self.tokenizer(
            list(passages), add_special_tokens=False, truncation=True, max_length=passage_budget
        )["input_ids"]
        cls, sep = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        segment_a = [cls, *query_ids, sep]
        return [(segment_a + ids + [sep], [0] * len(segment_a) + [1] * (len(ids) + 1)) for ids in passage_ids]

    def logits(self, pairs: Sequence[tuple[list[int], list[int]]]) -> torch.Tensor:
        """The head's logits, (len(pairs), num_labels), for tokenized pairs padded on the right into one batch.

        Differentiable outside `torch.inference_mode`, which fine-tuning relies on.
        """
        width = max(len(ids) for ids, _ in pairs)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in pairs], device=self.device)
        segments = torch.tensor([types + [0] * (width - len(types)) for _, types in pairs], device=self.device)
        mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in pairs], device=self.device)
        return self.model(input_ids=input_ids, attention_mask=mask, token_type_ids=segments).logits
