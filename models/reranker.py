"""The reranker interface the service calls, and the one loader that turns a folder into a reranker.

Three kinds implement it:

- `monobert`: the BERT cross-encoder of paper 004 (`models.cross_encoder.CrossEncoder`);
- `coattention`: the n-gram co-attention network of paper 002 (`models.coattention.CoAttentionReranker`);
- `generative`: ranking by generation, paper 003 (`models.generative.GenerativeReranker`).

A reranker folder says which kind it holds in `reranker.json` (`{"kind": ..., ...}`); the
training CLIs write it. A folder without that file that is a Hugging Face checkpoint is
taken for monoBERT, so every cross-encoder folder made before this file existed still loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from models.backends import Backend
from models.checkpoint import RERANKER_FILE, read_reranker_json
from models.coattention import CoAttentionReranker
from models.cross_encoder import CrossEncoder
from models.generative import GenerativeReranker


@runtime_checkable
class Reranker(Protocol):
    """Scores passages against one query; callers rank by score, higher first."""

    name: str
    score_kind: str  # what a score is: "probability", "logit" or "log_likelihood"

    def score(self, query: str, passages: Sequence[str]) -> np.ndarray:
        """One float32 score per passage, in the order of `passages`; higher = more relevant."""
        ...

    def pair_tokens(self, query: str, passages: Sequence[str]) -> list[int]:
        """Tokens (or words) the model reads for each (query, passage) pair, after its own truncation:
        the work a scoring costs, for budgets."""
        ...

    def save(self, folder: str | Path) -> None:
        """A folder `load_reranker` loads back as this reranker."""
        ...


def reranker_kind(folder: str | Path) -> str:
    """The kind of reranker a folder holds: its reranker.json's, else monobert."""
    record = read_reranker_json(folder)
    return record["kind"] if record else "monobert"


def load_reranker(path: str | Path, *, device: str = "auto", backend: Backend = "torch") -> Reranker:
    """The reranker saved in folder `path`, on `device` ("auto", "cpu", "cuda", "cuda:N"); `backend`
    (models.onnx_backend) applies to monobert, the other kinds run on torch.

    Raises FileNotFoundError for a missing folder or one that is no reranker, ValueError for a
    `reranker.json` that names an unknown kind or settings the model refuses.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such reranker folder")
    kind = reranker_kind(folder)
    if kind == "coattention":
        return CoAttentionReranker.load(folder, device=device)
    if kind == "generative":
        return GenerativeReranker.load(folder, device=device)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: neither {RERANKER_FILE} nor a Hugging Face checkpoint (config.json)")
    return CrossEncoder.load(folder, device=device, backend=backend)
