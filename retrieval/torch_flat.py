"""Exact inner-product search in torch: the flat scan on GPUs that faiss cannot use (a faiss-cpu build beside
a CUDA torch, since faiss's GPU wheels need CUDA's own libraries), sharded over the devices given.

The vectors are split by rows over the devices; a search multiplies the queries with each device's rows a
chunk at a time (at most SCORE_BUDGET_BYTES of scores at once), keeps each chunk's best, and merges them. Its
answers follow the flat scan's rules through retrieval.dense_index.search (which asks one past k to see a tie
cross the k-th place): scores in fp32, and equal scores ordered by row. Imports torch and numpy only."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

SCORE_BUDGET_BYTES = 1 << 30  # fp32 scores of one chunk: queries x rows x 4 bytes
UPLOAD_ROWS = 1 << 18  # rows copied to a device at a time while loading


class TorchFlatIndex:
    """`ntotal` rows of `d` dimensions on `devices` (fp32, or fp16 where `fp16`: half the memory and the
    bytes a search reads; scores are accumulated and returned in fp32). `search(queries, k)` answers as
    faiss's flat index does: (scores, rows), each (queries, k), best first, -1 rows past the index."""

    def __init__(self, d: int, devices: Sequence[str | torch.device], fp16: bool = False,
                 score_budget_bytes: int = SCORE_BUDGET_BYTES) -> None:
        self.d, self.ntotal = d, 0
        self.devices = [torch.device(device) for device in devices]
        if not self.devices:
            raise ValueError("a torch flat index needs at least one device")
        self.dtype = torch.float16 if fp16 else torch.float32
        self.score_budget_bytes = score_budget_bytes
        self.shards: list[tuple[int, torch.Tensor]] = []  # (first row, the rows on one device)

    @classmethod
    def of(cls, vectors: np.ndarray, devices: Sequence[str | torch.device], fp16: bool = False,
           score_budget_bytes: int = SCORE_BUDGET_BYTES) -> "TorchFlatIndex":
        """`vectors` (rows, any array numpy can view: a memory map too) split evenly over `devices`, copied a
        block at a time so the host never holds a second copy."""
        index = cls(vectors.shape[1], devices, fp16, score_budget_bytes)
        bounds = np.linspace(0, len(vectors), len(index.devices) + 1).astype(np.int64)
        for device, start, end in zip(index.devices, bounds[:-1], bounds[1:]):
            shard = torch.empty((int(end - start), index.d), dtype=index.dtype, device=device)
            for first in range(int(start), int(end), UPLOAD_ROWS):
                last = min(int(end), first + UPLOAD_ROWS)
                block = torch.from_numpy(np.ascontiguousarray(vectors[first:last], dtype=np.float32))
                shard[first - start:last - start] = block.to(device=device, dtype=index.dtype)
            index.shards.append((int(start), shard))
        index.ntotal = len(vectors)
        return index

    @classmethod
    def of_tensors(cls, shards: Sequence[torch.Tensor], score_budget_bytes: int = SCORE_BUDGET_BYTES) -> "TorchFlatIndex":
        """Row blocks already on their devices (one each, in row order, all of one dtype), used as they are."""
        if not shards:
            raise ValueError("a torch flat index needs at least one device")
        index = cls(shards[0].shape[1], [shard.device for shard in shards], shards[0].dtype == torch.float16,
                    score_budget_bytes)
        for shard in shards:
            index.shards.append((index.ntotal, shard))
            index.ntotal += len(shard)
        return index

    @classmethod
    def from_file(cls, path: Path, devices: Sequence[str | torch.device], fp16: bool = False) -> "TorchFlatIndex":
        """The vectors of a flat inner-product index file as the index writer writes it (faiss's IndexFlatIP:
        its rows are the file's last ntotal x d float32 values), read through a memory map."""
        import faiss  # only here: searching needs torch alone (bench/gpu.py runs where faiss is absent)

        flat = faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC)
        return cls.of_faiss(flat, devices, fp16)

    @classmethod
    def of_faiss(cls, flat, devices: Sequence[str | torch.device], fp16: bool = False) -> "TorchFlatIndex":
        """The vectors of a faiss flat index (read or memory-mapped), viewed without a copy."""
        import faiss

        vectors = faiss.rev_swig_ptr(flat.get_xb(), flat.ntotal * flat.d).reshape(flat.ntotal, flat.d)
        return cls.of(vectors, devices, fp16)

    def search(self, queries: np.ndarray, k: int, params=None) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows), each (len(queries), k): the rows of the k best inner products by score (ties in no
        set order: retrieval.dense_index.search orders them); past the index's rows, rows -1 scored as faiss
        scores them."""
        if params is not None:
            raise ValueError("a torch flat index takes no search parameters (filtered searches scan on the CPU)")
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        found = [self._shard_top(start, shard, queries, k) for start, shard in self.shards]  # every device at once
        scores = np.concatenate([s.float().cpu().numpy() for s, _ in found], axis=1)
        rows = np.concatenate([r.cpu().numpy() for _, r in found], axis=1)
        best = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        scores, rows = np.take_along_axis(scores, best, axis=1), np.take_along_axis(rows, best, axis=1)
        if scores.shape[1] < k:  # fewer rows than k: faiss's padding (the lowest float32 for inner products)
            pad = k - scores.shape[1]
            scores = np.pad(scores, ((0, 0), (0, pad)), constant_values=-np.finfo(np.float32).max)
            rows = np.pad(rows, ((0, 0), (0, pad)), constant_values=-1)
        return scores.astype(np.float32), rows.astype(np.int64)

    def _shard_top(self, start: int, shard: torch.Tensor, queries: np.ndarray, k: int):
        """The best min(k, rows) of one device's rows for each query, left on the device (not waited for)."""
        on_device = torch.from_numpy(queries).to(shard.device)
        chunk = max(1, self.score_budget_bytes // (4 * max(1, len(queries))))
        tops_scores, tops_rows = [], []
        for first in range(0, len(shard), chunk):
            scores = _products(on_device, shard[first:first + chunk])
            top = torch.topk(scores, min(k, scores.shape[1]), dim=1)
            tops_scores.append(top.values)
            tops_rows.append(top.indices + (start + first))
        if not tops_scores:
            empty = torch.zeros((len(queries), 0), device=shard.device)
            return empty, empty.long()
        scores, rows = torch.cat(tops_scores, dim=1), torch.cat(tops_rows, dim=1)
        if scores.shape[1] > k:
            top = torch.topk(scores, k, dim=1)
            scores, rows = top.values, torch.gather(rows, 1, top.indices)
        return scores, rows

    def reconstruct_n(self, start: int, count: int) -> np.ndarray:
        """Rows start .. start + count - 1, as fp32 numpy (faiss's name)."""
        return self.reconstruct_batch(np.arange(start, start + count))

    def reconstruct_batch(self, rows) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        found = np.empty((len(rows), self.d), dtype=np.float32)
        for start, shard in self.shards:
            inside = (rows >= start) & (rows < start + len(shard))
            if inside.any():
                picked = torch.from_numpy(rows[inside] - start).to(shard.device)
                found[inside] = shard[picked].float().cpu().numpy()
        return found


def _products(queries: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """queries x rows' inner products in fp32: fp16 rows are multiplied in fp16 with fp32 accumulation and
    output on CUDA (torch.mm's out_dtype), converted to fp32 first elsewhere."""
    if rows.dtype == torch.float32:
        return queries @ rows.T
    if rows.is_cuda:
        try:
            return torch.mm(queries.to(rows.dtype), rows.T, out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # a torch without mm's out_dtype: fp16 out, then widened
            return (queries.to(rows.dtype) @ rows.T).float()
    return queries @ rows.float().T


def cuda_devices(device: str) -> list[torch.device]:
    """The GPUs a torch flat index on `device` spans: every visible one for `cuda`, one for `cuda:N`."""
    resolved = torch.device(device)
    if resolved.index is not None:
        return [resolved]
    return [torch.device("cuda", number) for number in range(torch.cuda.device_count())]
