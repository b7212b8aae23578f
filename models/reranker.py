"""The reranker interface the service calls, the kinds that implement it, and the one loader that turns a
folder into a reranker.

RERANKERS holds every kind by name, one line each: `reranker_kind`'s check and the service's schemas
(`RerankerKind`, `ScoreKind` and its description) read it, so a new kind is its class (with `kind`,
`score_kind`, `score_meaning`, `backends`, `load` and `save`) and its line here.

A reranker folder says which kind it holds in `reranker.json` (`{"kind": ..., ...}`); the
training CLIs write it. A folder without that file that is a Hugging Face checkpoint is
taken for monoBERT, as a public cross-encoder (e.g. an ms-marco one from the Hub) is.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Protocol, Sequence, runtime_checkable

import numpy as np

from models.backends import Backend
from models.checkpoint import RERANKER_FILE, read_reranker_json
from models.coattention import CoAttentionReranker
from models.cross_encoder import CrossEncoder
from models.generative import GenerativeReranker


@runtime_checkable
class Reranker(Protocol):
    """Scores passages against one query; callers rank by score, higher first."""

    kind: ClassVar[str]  # its name in RERANKERS and in its folder's reranker.json
    score_kind: ClassVar[str]  # what a score is, in a word: "probability", "logit", ...
    score_meaning: ClassVar[str]  # and in a few: "P(relevant)"
    backends: ClassVar[tuple[str, ...]]  # the backends it runs on (models.backends), torch first
    name: str

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


# monobert: the BERT cross-encoder of paper 004; coattention: the n-gram co-attention network of paper 002;
# generative: ranking by generation, paper 003.
RERANKERS: dict[str, type] = {kind.kind: kind for kind in (CrossEncoder, CoAttentionReranker, GenerativeReranker)}


def reranker_kind(folder: str | Path) -> str:
    """The kind of reranker a folder holds: its reranker.json's, else monobert where it is a Hugging Face
    checkpoint. ValueError for a kind not in RERANKERS, FileNotFoundError for a folder that is neither."""
    folder = Path(folder)
    record = read_reranker_json(folder)
    if record is None:
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder}: neither {RERANKER_FILE} nor a Hugging Face checkpoint (config.json)")
        return CrossEncoder.kind
    if record["kind"] not in RERANKERS:
        raise ValueError(f"{folder / RERANKER_FILE}: 'kind' must be one of {', '.join(RERANKERS)}, "
                         f"got {record['kind']!r}")
    return record["kind"]


def load_reranker(path: str | Path, *, device: str = "auto", backend: Backend = "torch") -> Reranker:
    """The reranker saved in folder `path`, on `device` ("auto", "cpu", "cuda", "cuda:N"); `backend`
    (models.onnx_backend) applies to a kind that runs on more than torch (monobert); the others run on torch.

    Raises FileNotFoundError for a missing folder or one that is no reranker, ValueError for a
    `reranker.json` that names an unknown kind or settings the model refuses.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such reranker folder")
    kind = RERANKERS[reranker_kind(folder)]
    return kind.load(folder, device=device, **({"backend": backend} if len(kind.backends) > 1 else {}))
