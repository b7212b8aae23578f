"""Exact maximum-inner-product search with a FAISS flat index, on every GPU present or on the CPU."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np

from models.checkpoint import resolve_device


def gpu_count() -> int:
    """GPUs faiss can use (0 for a faiss-cpu build)."""
    return faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0


def new_flat_index(dimension: int) -> faiss.Index:
    return faiss.IndexFlatIP(dimension)


def shard_over_gpus(index: faiss.Index) -> faiss.Index:
    """Split the rows over all GPUs (faiss.IndexShards underneath); each GPU searches its part and
    the results are merged, so the collection may be larger than one GPU's memory."""
    options = faiss.GpuMultipleClonerOptions()
    options.shard = True
    options.useFloat16 = False  # keep scores exact
    return faiss.index_cpu_to_all_gpus(index, co=options)


def to_gpu(index: faiss.Index, gpu: int) -> faiss.Index:
    """The index copied to GPU `gpu` alone, scores exact (fp32)."""
    resources = faiss.StandardGpuResources()
    options = faiss.GpuClonerOptions()
    options.useFloat16 = False
    placed = faiss.index_cpu_to_gpu(resources, gpu, index, options)
    placed.referenced_objects = [resources]  # the GPU memory lives as long as the index
    return placed


def load_index(path: str | Path, device: str = "auto") -> faiss.Index:
    """Read an index file and place it as `device` says (models.checkpoint.resolve_device): `cpu` on the
    CPU, `cuda:N` on GPU N alone, `cuda` sharded over every GPU, `auto` like `cuda` where faiss sees
    GPUs and torch does too, else on the CPU."""
    index = faiss.read_index(str(path))
    resolved = resolve_device(device)
    if resolved.type == "cpu":
        return index
    if gpu_count() == 0:
        if device == "auto":  # torch sees a GPU but this faiss build cannot use it
            return index
        raise RuntimeError(f"device {device!r} asked for, but faiss sees no GPU (faiss-cpu build or no device)")
    return shard_over_gpus(index) if resolved.index is None else to_gpu(index, resolved.index)


def search(index: faiss.Index, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, rows), each (len(vectors), k), best first; rows are -1 past the index's size."""
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    return index.search(vectors, k)
