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

from models.backends import Backend
from models.checkpoint import (
    load_pretrained,
    padded_batch,
    read_reranker_json,
    score_in_batches,
    weights_sha256,
    write_reranker_json,
)
from models.onnx_backend import OnnxTransformer, check_backend, exported


def relevance_logit(logits: torch.Tensor) -> torch.Tensor:
    """One score per pair, the log-odds of relevance: label 1 minus label 0 of a two-label head (as
    softmax reads them), or a one-logit head's logit. Differentiable, which training's losses rely on."""
    if logits.dim() == 2 and logits.shape[1] == 2:
        return logits[:, 1] - logits[:, 0]
    if logits.dim() == 2 and logits.shape[1] == 1:
        return logits.squeeze(1)
    if logits.dim() != 1:
        raise ValueError(f"expected logits of shape (pairs, 2), (pairs, 1) or (pairs,), got {tuple(logits.shape)}")
    return logits


def relevance_probability(logits: torch.Tensor) -> torch.Tensor:
    """P(relevant) per pair: the sigmoid of `relevance_logit` (for two labels, softmax's label 1)."""
    return torch.sigmoid(relevance_logit(logits.float()))


class CrossEncoder:
    """Scores a query against many passages; thread-compatible for inference."""

    kind = "monobert"  # models.reranker.RERANKERS
    score_kind = "probability"
    score_meaning = "P(relevant)"
    backends = ("torch", "onnx", "onnx-int8")

    def __init__(
        self,
        path: str | Path,
        *,
        device: str = "auto",
        query_max_tokens: int | None = None,
        max_tokens: int | None = None,
        batch_size: int = 32,
        fp16: bool | None = None,
        backend: Backend = "torch",
        onnx_cache: Path | None = None,
    ) -> None:
        """`backend`: as for models.encoder.BiEncoder. The token limits default to those the folder's
        reranker.json records (a model is scored on what it was fine-tuned on), else 64 and 512."""
        self.path = Path(path)
        self.name = self.path.name
        record = read_reranker_json(self.path) or {}
        query_max_tokens = query_max_tokens or record.get("query_max_tokens", 64)
        max_tokens = max_tokens or record.get("max_tokens", 512)
        self.tokenizer, self.model, self.device = load_pretrained(
            self.path, AutoModelForSequenceClassification, device=device, fp16=fp16
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
        check_backend(backend, self.device)
        self.backend = backend
        self._transformer = lambda ids, mask, types: self.model(
            input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        if backend != "torch":
            onnx_file = exported(self.model, weights_sha256(self.path), backend, "logits", onnx_cache)
            self._transformer = OnnxTransformer(onnx_file, per_sequence=backend == "onnx-int8")

    def score(self, query: str, passages: Sequence[str]) -> np.ndarray:
        """P(relevant) of each passage to `query`, float32, in the order of `passages`."""
        pairs = self.tokenize(query, passages) if passages else []
        return score_in_batches(pairs, [len(ids) for ids, _ in pairs], self.batch_size,
                                lambda batch: relevance_probability(self.logits(batch)))

    def pair_tokens(self, query: str, passages: Sequence[str]) -> list[int]:
        return [len(ids) for ids, _ in self.tokenize(query, passages)] if passages else []

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

        Differentiable outside `torch.inference_mode` on the torch backend, which fine-tuning relies on.
        """
        input_ids, mask = padded_batch([ids for ids, _ in pairs], self.tokenizer.pad_token_id, self.device)
        segments, _ = padded_batch([types for _, types in pairs], 0, self.device)
        return self._transformer(input_ids, mask, segments)

    def save(self, folder: str | Path) -> None:
        """A folder `load_reranker` (and this class) loads back: weights, tokenizer and reranker.json."""
        self.model.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        write_reranker_json(folder, self.kind, query_max_tokens=self.query_max_tokens, max_tokens=self.max_tokens)

    @classmethod
    def load(cls, folder: str | Path, **options) -> "CrossEncoder":
        """The cross-encoder saved in `folder`; `options` as for the constructor."""
        return cls(folder, **options)
