"""ONNX Runtime under an encoder's or a cross-encoder's transformer, on the CPU, where it runs a
short query faster than torch eager (see docs/benchmarks.md, bench/backends.py). The same weights,
exported once by torch's exporter and cached by their checksum; `onnx-int8` also quantises the linear
layers' weights to int8 (ONNX Runtime's dynamic quantisation). Tokenisation, pooling, normalisation
and heads stay with the caller, so every backend feeds and reads the transformer the same way."""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from models.backends import BACKENDS, Backend

INPUTS = ("input_ids", "attention_mask", "token_type_ids")
EXPORT_VERSION = 1  # part of the cache folder's name: raise it when the export or the quantisation changes


def default_cache() -> Path:
    """Where exports are kept unless a folder is given: $XDG_CACHE_HOME (or ~/.cache)/dense-search/onnx."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "dense-search" / "onnx"


def check_backend(backend: str, device: torch.device) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend != "torch" and device.type != "cpu":
        raise ValueError(f"backend {backend!r} runs on the CPU only; on {device} use the torch backend")


class _Outputs(torch.nn.Module):
    """The model with the three inputs by position and one output: what the exporter traces."""

    def __init__(self, model: torch.nn.Module, output: str) -> None:
        super().__init__()
        self.model, self.output = model, output

    def forward(self, input_ids, attention_mask, token_type_ids):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return getattr(outputs, self.output)


def _export(model: torch.nn.Module, output: str, file: Path) -> None:
    example = torch.tensor([[101, 2023, 2003, 102], [101, 2023, 102, 0]])
    mask = (example != 0).long()
    axes = {name: {0: "batch", 1: "tokens"} for name in INPUTS}
    axes[output] = {0: "batch"} if output == "logits" else {0: "batch", 1: "tokens"}
    # The tracer warns of shape-dependent branches in the attention code; with the mask always given
    # they take one side for every shape (tests compare outputs across batch shapes).
    # The exporter restores the wrapper's mode when it is done, and with it the model's: a new Module is in
    # training mode, which would leave dropout on in the torch model the caller keeps.
    training = model.training
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Outputs(model.float(), output).eval(), (example, mask, torch.zeros_like(example)),
                          str(file), input_names=list(INPUTS), output_names=[output], dynamic_axes=axes,
                          opset_version=17, dynamo=False)
    model.train(training)


def exported(model: torch.nn.Module, weights_sha256: str, backend: Backend, output: str,
             cache: Path | None = None) -> Path:
    """The ONNX file of `model` for `backend` (exported on first use, then reused): one folder per
    weights checksum and output, written under a temporary name and renamed, so processes that
    export at once never read half a file."""
    folder = (cache or default_cache()) / f"{weights_sha256[:16]}-{output}-v{EXPORT_VERSION}"
    fp32 = folder / "model.onnx"
    target = fp32 if backend == "onnx" else folder / "model-int8.onnx"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    if not fp32.is_file():
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            _export(model, output, Path(scratch) / "model.onnx")
            os.replace(Path(scratch) / "model.onnx", fp32)
    if backend == "onnx-int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            # Per-channel scales, matrix products only, 7-bit weights: the embedding stays far closer to fp32
            # than with per-tensor scales (the default); see docs/benchmarks.md, bench/backends.py.
            quiet = logging.getLogger().level
            logging.getLogger().setLevel(logging.ERROR)  # it advises a pre-processing pass on the root logger
            try:
                quantize_dynamic(fp32, Path(scratch) / "model.onnx", weight_type=QuantType.QInt8, per_channel=True,
                                 reduce_range=True, op_types_to_quantize=["MatMul"])
            finally:
                logging.getLogger().setLevel(quiet)
            os.replace(Path(scratch) / "model.onnx", target)
    return target


class OnnxTransformer:
    """Called as the torch model's forward is, with token tensors on the CPU (padded on the right); returns the
    one exported output (hidden states, or a classifier's logits) as a float32 tensor. With `per_sequence`
    (the int8 backend) each sequence runs alone, unpadded: dynamic quantisation scales a product's input by its
    whole tensor, so in a batch a sequence's output would shift with its neighbours and their padding, and a
    passage's score with the other passages reranked beside it."""

    def __init__(self, file: Path, threads: int | None = None, per_sequence: bool = False) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
        # Idle pool threads would spin for the next run, taking the cores torch encodes the next query on.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.file, self.per_sequence = file, per_sequence
        self.session = onnxruntime.InferenceSession(str(file), options, providers=["CPUExecutionProvider"])

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 token_type_ids: torch.Tensor) -> torch.Tensor:
        inputs = [np.ascontiguousarray(tensor.numpy(), dtype=np.int64)
                  for tensor in (input_ids, attention_mask, token_type_ids)]
        if not self.per_sequence:
            return torch.from_numpy(self._run(inputs))
        outputs = []
        for row, length in enumerate(inputs[1].sum(axis=1)):
            output = self._run([tensor[row:row + 1, :length] for tensor in inputs])
            if output.ndim == 3:  # hidden states: padded back to the batch's tokens, zeros where masked
                output = np.pad(output, ((0, 0), (0, input_ids.shape[1] - length), (0, 0)))
            outputs.append(output)
        return torch.from_numpy(np.concatenate(outputs))

    def _run(self, inputs: list[np.ndarray]) -> np.ndarray:
        return self.session.run(None, dict(zip(INPUTS, inputs)))[0]
