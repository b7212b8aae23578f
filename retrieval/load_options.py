"""How an index folder is loaded: the one set of options, with the one set of defaults, that every reader
of an index (the Searcher, a shard, the service and its sharded replicas) loads it with."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadOptions:
    """`device`: where the vectors are searched (auto, cpu, cuda or cuda:N; auto takes a GPU where torch sees
    one). `verify_checksums`: every file is checked against the manifest's sha256, the vectors and the candidate
    structures from the very bytes loaded (retrieval.dense.DenseIndex.load). `mmap`: memory-map the vectors of
    an index kept on the CPU; None: where a candidate structure is loaded, so the process holds the structure,
    not the vectors. `fp16`: on a GPU, store the vectors as fp16. Each is ignored where it does not apply."""

    device: str = "auto"
    verify_checksums: bool = True
    mmap: bool | None = None
    fp16: bool = False
