"""What every model class shares: devices, checkpoint folders, padded batches and batched scoring.

- One meaning of a device string (`auto`, `cpu`, `cuda`, `cuda:N`), used by the models and by
  FAISS placement (`retrieval.dense_index`) alike.
- Hugging Face folders (or a GGUF file inside one) load through `load_pretrained`; a reranker
  folder names its kind in `reranker.json`.
- Batches are padded on the right, once, with numpy: the tokenizer's own padding walks every id
  in Python, which costs more than a GPU forward pass.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer
from transformers.utils import logging as transformers_logging

transformers_logging.disable_progress_bar()  # one bar per weight load is noise in a service log

WEIGHT_SUFFIXES = (".safetensors", ".bin")
RERANKER_FILE = "reranker.json"
DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
Item = TypeVar("Item")


def resolve_device(device: str) -> torch.device:
    """`auto` is the first GPU torch sees, else the CPU; `cuda` is the current GPU; `cuda:N` GPU N.
    ValueError for anything else, so a typo never silently runs on another device."""
    if not isinstance(device, str) or not DEVICE.match(device):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def read_json(path: Path) -> dict | list | None:
    """The JSON in `path`, or None where there is no such file."""
    return json.loads(path.read_text()) if path.is_file() else None


def file_sha256(path: Path, digest=None) -> str:
    """sha256 of a file's bytes, read in blocks (or fed into `digest`, whose hex digest is returned)."""
    digest = digest or hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def weights_sha256(folder: Path) -> str:
    """Hash of every weight file (names and bytes), so an index refuses a fine-tuned sibling of the same shape."""
    digest = hashlib.sha256()
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        raise FileNotFoundError(f"{folder}: no weight file (*.safetensors or *.bin)")
    for path in files:
        digest.update(path.name.encode())
        file_sha256(path, digest)
    return digest.hexdigest()


def load_config(path: Path, gguf_file: str | None = None):
    """The model config of a Hugging Face folder (or of a GGUF file inside it)."""
    if not gguf_file and not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a Hugging Face checkpoint directory (no config.json)")
    return AutoConfig.from_pretrained(path, **({"gguf_file": gguf_file} if gguf_file else {}))


def load_pretrained(path: Path, auto_class, *, device: str = "auto", fp16: bool | None = None,
                    gguf_file: str | None = None):
    """(tokenizer, model in eval mode on its device, device) from a local Hugging Face folder, through
    `auto_class` (AutoModel, AutoModelForSequenceClassification, ...); a GGUF file in the folder is
    dequantised by transformers. fp16 by default on CUDA only."""
    if not gguf_file and not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a Hugging Face checkpoint directory (no config.json)")
    resolved = resolve_device(device)
    source = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(path, **source)
    use_fp16 = resolved.type == "cuda" if fp16 is None else fp16
    model = auto_class.from_pretrained(path, dtype=torch.float16 if use_fp16 else torch.float32, **source)
    if gguf_file:
        _forget_gguf(model)
    model.to(resolved).eval()
    return tokenizer, model, resolved


def _forget_gguf(model) -> None:
    """Where transformers has dequantised every GGUF weight into a plain tensor (no GGUF kernel in use),
    it still keeps its GGUF quantizer on the model, which refuses `save_pretrained`: a reranker
    fine-tuned from a GGUF file could not save a checkpoint. Such a model is a plain one; it is made
    to say so."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None or getattr(quantizer, "packed_modules", None):
        return  # not from GGUF, or GGUF kernels run packed weights: those stay as they are
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def pad_right(rows: Sequence[Sequence[int]], value: int = 0, *, width: int | None = None,
              multiple: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(rows right-padded with `value` into one int64 matrix, each row's length). The width is the
    longest row (or `width`), rounded up to `multiple`."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    width = width or int(lengths.max(initial=1))
    width = -(-width // multiple) * multiple
    matrix = np.full((len(rows), width), value, dtype=np.int64)
    for row, ids in zip(matrix, rows):
        row[: len(ids)] = ids
    return matrix, lengths


def padded_batch(rows: Sequence[Sequence[int]], value: int, device: torch.device, *, width: int | None = None,
                 multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), each (len(rows), width) int64 on `device`: `pad_right` as tensors."""
    matrix, lengths = pad_right(rows, value, width=width, multiple=multiple)
    mask = (np.arange(matrix.shape[1])[None, :] < lengths[:, None]).astype(np.int64)
    return torch.from_numpy(matrix).to(device), torch.from_numpy(mask).to(device)


def length_sorted_batches(lengths: Sequence[int], batch_size: int) -> Iterator[list[int]]:
    """Positions grouped into batches of similar length, longest first, to cut padding."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


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
    """The folder's `reranker.json` as a dict holding a string `kind` (which models.reranker checks against
    the kinds it knows), or None where the folder has none."""
    path = Path(folder) / RERANKER_FILE
    try:
        record = read_json(path)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if record is None:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        raise ValueError(f"{path}: an object with a string 'kind' is expected, got {record!r:.80}")
    return record


def write_reranker_json(folder: str | Path, kind: str, **fields) -> None:
    """Writes `reranker.json` (kind first, then `fields`) into `folder`."""
    (Path(folder) / RERANKER_FILE).write_text(json.dumps({"kind": kind, **fields}, indent=2) + "\n")
