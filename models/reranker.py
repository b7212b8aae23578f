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

import json
from pathlib import Path
from typing import Callable, Protocol, Sequence, TypeVar, runtime_checkable

import numpy as np
import torch

from models.encoder import length_sorted_batches

RERANKER_FILE = "reranker.json"
KINDS = ("monobert", "coattention", "generative")
Item = TypeVar("Item")


@runtime_checkable
class Reranker(Protocol):
    """Scores passages against one query; callers rank by score, higher first."""

    name: str

    def score(self, query: str, passages: Sequence[str]) -> np.ndarray:
        """One float32 score per passage, in the order of `passages`; higher = more relevant."""
        ...


def score_in_batches(items: Sequence[Item], lengths: Sequence[int], batch_size: int,
                     score_batch: Callable[[list[Item]], torch.Tensor]) -> np.ndarray:
    """float32 scores of `items` in their order, computed by `score_batch` in inference mode on
    batches of similar `lengths` (longest first), so that little padding is computed."""
    out = np.empty(len(items), dtype=np.float32)
    with torch.inference_mode():
        for positions in length_sorted_batches(lengths, batch_size):
            out[positions] = score_batch([items[i] for i in positions]).float().cpu().numpy()
    return out


def read_reranker_json(folder: str | Path) -> dict | None:
    """The folder's `reranker.json` as a dict, or None where the folder has none."""
    path = Path(folder) / RERANKER_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(record, dict) or record.get("kind") not in KINDS:
        raise ValueError(f"{path}: 'kind' must be one of {', '.join(KINDS)}, got {record.get('kind') if isinstance(record, dict) else record!r}")
    return record


def reranker_kind(folder: str | Path) -> str:
    """The kind of reranker a folder holds: its reranker.json's, else monobert."""
    record = read_reranker_json(folder)
    return record["kind"] if record else "monobert"


def write_reranker_json(folder: str | Path, kind: str, **fields) -> None:
    """Writes `reranker.json` (kind first, then `fields`) into `folder`."""
    if kind not in KINDS:
        raise ValueError(f"unknown reranker kind {kind!r}; expected one of {', '.join(KINDS)}")
    (Path(folder) / RERANKER_FILE).write_text(json.dumps({"kind": kind, **fields}, indent=2) + "\n")


def load_reranker(path: str | Path, *, device: str = "auto") -> Reranker:
    """The reranker saved in folder `path`, on `device` ("auto", "cpu", "cuda", ...).

    Raises FileNotFoundError for a missing folder or one that is no reranker, ValueError for a
    `reranker.json` that names an unknown kind or settings the model refuses.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such reranker folder")
    kind = reranker_kind(folder)
    if kind == "coattention":
        from models.coattention import CoAttentionReranker

        return CoAttentionReranker.load(folder, device=device)
    if kind == "generative":
        from models.generative import GenerativeReranker

        return GenerativeReranker(folder, device=device)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: neither {RERANKER_FILE} nor a Hugging Face checkpoint (config.json)")
    from models.cross_encoder import CrossEncoder

    return CrossEncoder(folder, device=device)
