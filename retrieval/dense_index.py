"""Exact maximum-inner-product search with a FAISS flat index, on every GPU present or on the CPU."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np


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


def load_index(path: str | Path, device: str = "auto") -> faiss.Index:
    """Read an index file; with device 'auto' or 'cuda' and GPUs present, shard it over all of them."""
    index = faiss.read_index(str(path))
    if device == "cpu" or gpu_count() == 0:
        if device == "cuda":
            raise RuntimeError("device 'cuda' asked for, but faiss sees no GPU (faiss-cpu build or no device)")
        return index
    return shard_over_gpus(index)


def search(index: faiss.Index, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, rows), each (len(vectors), k), best first; rows are -1 past the index's size."""
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    return index.search(vectors, k)
