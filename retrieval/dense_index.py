"""Exact maximum-inner-product search with a FAISS flat index, on every GPU present or on the CPU."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import faiss
import numpy as np
import torch

from models.checkpoint import resolve_device
from retrieval.index_format import FileRecord, IndexFormatError
from retrieval.torch_flat import TorchFlatIndex, cuda_devices

log = logging.getLogger(__name__)
PREFETCH_CHUNK = 1 << 20
HASH_CHUNK = 1 << 22


def gpu_count() -> int:
    """GPUs faiss can use (0 for a faiss-cpu build)."""
    return faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0


def new_flat_index(dimension: int) -> faiss.Index:
    return faiss.IndexFlatIP(dimension)


def shard_over_gpus(index: faiss.Index, fp16: bool = False) -> faiss.Index:
    """Split the rows over all GPUs (faiss.IndexShards underneath); each GPU searches its part and
    the results are merged, so the collection may be larger than one GPU's memory. Vectors are
    stored in fp32 (exact scores) unless `fp16`, which halves their memory and the bytes a search
    reads, at a small cost in score precision (faiss then multiplies in fp16, accumulating in fp32)."""
    options = faiss.GpuMultipleClonerOptions()
    options.shard = True
    options.useFloat16 = fp16
    return faiss.index_cpu_to_all_gpus(index, co=options)


def to_gpu(index: faiss.Index, gpu: int, fp16: bool = False) -> faiss.Index:
    """The index copied to GPU `gpu` alone, vectors in fp32 (exact scores) unless `fp16`."""
    resources = faiss.StandardGpuResources()
    options = faiss.GpuClonerOptions()
    options.useFloat16 = fp16
    placed = faiss.index_cpu_to_gpu(resources, gpu, index, options)
    placed.referenced_objects = [resources]  # the GPU memory lives as long as the index
    return placed


def stays_on_gpu(device: str) -> bool:
    """Whether `load_index(..., device)` places the index on a GPU (False: it stays on the CPU): faiss's GPU
    index where this faiss build sees GPUs, else torch's (retrieval.torch_flat) where torch sees them;
    RuntimeError for a GPU asked for by name that neither can use."""
    resolved = resolve_device(device)
    if resolved.type == "cpu":
        return False
    if gpu_count() == 0 and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} asked for, but neither faiss nor torch sees a GPU")
    return True


def load_index(path: str | Path, device: str = "auto", *, mmap: bool = False, fp16: bool = False,
               expected: FileRecord | None = None) -> faiss.Index:
    """Read an index file and place it as `device` says (models.checkpoint.resolve_device): `cpu` on the
    CPU, `cuda:N` on GPU N alone, `cuda` sharded over every GPU, `auto` like `cuda` where torch sees a
    GPU, else on the CPU. On a GPU the index is faiss's where this faiss build has GPU support, else
    torch's exact scan (retrieval.torch_flat.TorchFlatIndex), so no faiss-gpu wheel is needed.

    `mmap`: an index that stays on the CPU is memory-mapped (read-only) instead of read, so loading
    reads nothing up front and processes on one host share the vectors through the page cache; the
    file must not be changed in place while mapped (the index writer replaces files by rename, which
    is safe). A background thread then reads the file once in order (`prefetch`), where it fits the
    available memory, so the first searches do not fault the vectors in a page-cluster at a time.
    Ignored on a GPU, whose copy reads every vector anyway. `fp16`: vectors stored as fp16
    on the GPU (see shard_over_gpus); ignored on the CPU.

    `expected`: the manifest's record of the file; the index is then checked against it from the bytes
    FAISS loads, IndexFormatError where they differ (see read_verified)."""
    resolved = resolve_device(device)
    on_gpu = stays_on_gpu(device)
    in_torch = on_gpu and gpu_count() == 0  # a faiss-cpu build: torch searches on the GPUs
    # IO_FLAG_MMAP_IFC maps the codes of IndexFlatCodes (IndexFlatIP included); IO_FLAG_MMAP maps only
    # IVF inverted lists and reads a flat index whole. Torch copies from the map to the devices.
    flags = faiss.IO_FLAG_MMAP_IFC if (mmap and not on_gpu) or in_torch else 0
    index = faiss.read_index(str(path), flags) if expected is None else read_verified(Path(path), flags, expected)
    if not on_gpu:
        if mmap:
            threading.Thread(target=prefetch, args=(Path(path),), name="index-prefetch", daemon=True).start()
        return index
    if in_torch:
        return TorchFlatIndex.of_faiss(index, cuda_devices(str(resolved)), fp16)
    return shard_over_gpus(index, fp16) if resolved.index is None else to_gpu(index, resolved.index, fp16)


def is_mapped(index: faiss.Index) -> bool:
    """Whether a flat index's vectors are memory-mapped (IO_FLAG_MMAP_IFC) rather than held in the process."""
    return isinstance(index, faiss.IndexFlatCodes) and not index.codes.is_owned


def read_verified(path: Path, flags: int, expected: FileRecord, reader=faiss.read_index) -> faiss.Index:
    """The index in `path`, read with FAISS `flags` by `reader` (faiss.read_index, or read_index_binary for a
    binary index), from bytes whose size and sha256 are `expected`'s;
    IndexFormatError otherwise (the index read is dropped). The file is opened once and checked through
    that one open file, so neither a rewrite in place nor a rename over `path` can slip other bytes in.

    Read (flags 0): FAISS reads through a reader that hashes each block it hands over, then the file's
    rest is hashed: one pass, and no copy of the file beside the index in memory.
    Mapped (IO_FLAG_MMAP_IFC): FAISS maps the open file (/proc/self/fd/N, the inode hashed), which is
    then hashed whole, so the vectors served are those verified at that moment; a file rewritten in place
    later changes what is served, as for any mapped file (the index writer replaces files by rename).
    Where /proc/self/fd is missing (not Linux), FAISS maps `path` itself: a rename over it between the
    two opens is not caught."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        if flags & faiss.IO_FLAG_MMAP_IFC:
            same_file = Path(f"/proc/self/fd/{handle.fileno()}")
            source = str(same_file if same_file.exists() else path)
        else:
            def hashed_read(size: int) -> bytes:
                block = handle.read(size)
                digest.update(block)
                return block

            source = faiss.PyCallbackIOReader(hashed_read)
        try:
            index = reader(source, flags)
        except Exception as error:  # bytes other than the manifest's explain a parse error better than FAISS
            _check_rest(path, handle, digest, expected, error)
            raise
        _check_rest(path, handle, digest, expected)
    return index


def _check_rest(path: Path, handle, digest, expected: FileRecord, cause: Exception | None = None) -> None:
    """Hash what is left of `handle` into `digest` (at most one byte past the recorded size, so a file
    growing meanwhile ends it) and raise IndexFormatError unless the whole is the `expected` file."""
    left = expected.bytes + 1 - handle.tell()  # 1 where FAISS read it all: no block beside the index
    buffer = memoryview(bytearray(min(HASH_CHUNK, max(left, 1))))
    while (position := handle.tell()) <= expected.bytes:
        count = handle.readinto(buffer[:expected.bytes + 1 - position])
        if not count:
            break
        digest.update(buffer[:count])
    size = handle.tell()
    if size != expected.bytes:
        raise IndexFormatError(f"{path}: {size} bytes read, manifest says {expected.bytes}") from cause
    if digest.hexdigest() != expected.sha256:
        raise IndexFormatError(f"{path}: sha256 differs from the manifest's") from cause


GPU_MAX_K = 2048  # the most results FAISS's GPU flat search gives a query


def search(index: faiss.Index, vectors: np.ndarray, k: int, *, params: faiss.SearchParameters | None = None,
           allowed: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(scores, rows), each (len(vectors), k): the first k rows by score, and among equal scores by row,
    lowest first; rows are -1 past the index's size. `params`: FAISS's search parameters, an ID selector
    restricting the search to `allowed` rows (retrieval.filtered_search), then -1 past those.

    Equal scores come from duplicate passages. FAISS orders them by its heap, and which of several tied
    at the k-th place it keeps depends on k and on the order it met them, so a shard's top k (whose rows
    are another subset) could keep others than the whole index's. Fixing the rule makes sharded search
    equal one index even there: a search reads one result past k to see a tie crossing the k-th place,
    and more (rarely) until the tie ends."""
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    total = index.ntotal if allowed is None else allowed
    if k <= 0 or len(vectors) == 0:
        return index.search(vectors, k, params=params)
    if k >= total:  # every row is in: nothing to choose, only to order
        scores, rows = index.search(vectors, k, params=params)
        return ordered(scores, rows, k)
    cap = total if isinstance(index, (faiss.IndexFlat, TorchFlatIndex)) else min(total, GPU_MAX_K)
    fetch = min(k + 1, cap)
    scores, rows = index.search(vectors, fetch, params=params)
    while fetch < cap and np.any((scores[:, k] == scores[:, k - 1]) & (scores[:, -1] == scores[:, k - 1])):
        fetch = min(fetch * 2, cap)  # a tie runs past what was read: read on until it ends
        scores, rows = index.search(vectors, fetch, params=params)
    return ordered(scores, rows, k)


def ordered(scores: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The first k of each query's (score, row) pairs by score descending, then row ascending (-1 rows,
    scored -inf-like, last)."""
    order = np.lexsort((np.where(rows < 0, np.iinfo(np.int64).max, rows), -scores), axis=-1)[:, :k]
    return np.take_along_axis(scores, order, axis=-1), np.take_along_axis(rows, order, axis=-1)


def _available_bytes() -> int:
    """The host's available memory, or less where a cgroup (v2: a container) caps this process's,
    since the page cache counts against that cap."""
    available = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass  # no cgroup v2 memory controller here
    return available


def prefetch(path: Path) -> bool:
    """Read `path` once, in order, into the page cache, where it fits the available memory; whether it
    did. A mapped index's first search otherwise faults its pages in small read-around clusters, several
    times slower than one read in order (see docs/benchmarks.md, bench/scale.py)."""
    try:
        size = path.stat().st_size
        if size > _available_bytes():
            log.info("not prefetching %s: %d MiB is more than the available memory", path, size >> 20)
            return False
        buffer = bytearray(PREFETCH_CHUNK)
        with path.open("rb", buffering=0) as handle:
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while handle.readinto(buffer):
                pass
        return True
    except OSError as error:  # only a speed-up: a failure leaves the mapping to fault pages in
        log.warning("prefetching %s failed: %s", path, error)
        return False
