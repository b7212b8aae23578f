"""hnsw: a HNSW graph (faiss IndexHNSWFlat, inner product) over index.faiss's vectors. The file holds the graph
only (written with IO_FLAG_SKIP_STORAGE) and the loaded graph reads the flat index's vectors, so they are not
held twice (memory-mapped, they are the page cache's, not the process's). A build saves its graph every
checkpoint_seconds, so an interrupted one resumes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import faiss
import numpy as np

from retrieval.candidates.kind import BLOCK, Kind, Param, Structure, write_index


class Hnsw(Kind):
    name = "hnsw"
    summary = "a HNSW graph over index.faiss's own vectors (the file holds the links only)"
    params = {
        "M": Param(32, "--m", "links per node"),
        "efConstruction": Param(200, "--ef-construction", "search width while building"),
        "efSearch": Param(128, "--ef-search", "search width while searching", raises_recall=True),
    }
    index_type = faiss.IndexHNSWFlat
    skips_storage = True
    checkpoint_seconds = 300.0

    def default_depth(self, params: dict[str, int]) -> int:
        # Its search holds efSearch candidates at the end anyway: returning them all costs only their rescoring.
        return params["efSearch"]

    def depth_text(self) -> str:
        return "its --ef-search"

    def new_index(self, flat, params, progress, checkpoint, identity):
        resumed = _resumed(flat, params, checkpoint, identity)
        if resumed is not None:
            return resumed
        index = faiss.IndexHNSWFlat(flat.d, params["M"], faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = params["efConstruction"]
        index.hnsw.efSearch = params["efSearch"]
        return index

    def propose(self, structure: Structure, vectors: np.ndarray, depth: int, selector) -> np.ndarray:
        search = faiss.SearchParametersHNSW(efSearch=max(structure.params["efSearch"], depth))
        if selector is not None:
            search.sel = selector
        return structure.index.search(vectors, depth, params=search)[1]

    def extended(self, index, removed, vectors):
        return None  # a graph's nodes are its rows: a removed row cannot leave it, so a compaction builds it again

    def attach(self, index, flat: faiss.IndexFlat) -> None:
        """Make the graph search `flat`'s vectors (which it must outlive: it keeps a reference); its own copy,
        a fresh build's, is freed."""
        if index.storage is not None and index.own_fields:
            own = faiss.downcast_index(index.storage)
            own.this.acquire()  # freed with `own`, now Python's
        index.storage, index.own_fields = flat, False
        index.referenced_objects = [flat]

    def save(self, index, params: dict[str, int], checkpoint: Path, identity: str) -> None:
        """The graph so far (its vectors are index.faiss's first rows) and what it was built for, each by rename."""
        partial = checkpoint.with_name(checkpoint.name + ".tmp")
        with partial.open("wb") as handle:
            write_index(index, handle, binary=False, skips_storage=True)
        os.replace(partial, checkpoint)
        state = _state(checkpoint)
        state.with_name(state.name + ".tmp").write_text(json.dumps({"identity": identity, "params": params}))
        os.replace(state.with_name(state.name + ".tmp"), state)


def _state(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + ".json")


def _resumed(flat: faiss.IndexFlat, params: dict[str, int], checkpoint: Path | None, identity: str):
    """The graph a build interrupted over the same vectors (`identity`) and parameters saved, holding its rows'
    vectors again; None where there is none."""
    if checkpoint is None or not checkpoint.is_file() or not _state(checkpoint).is_file():
        return None
    try:
        if json.loads(_state(checkpoint).read_text()) != {"identity": identity, "params": params}:
            return None
        index = faiss.read_index(str(checkpoint), faiss.IO_FLAG_SKIP_STORAGE)
    except (ValueError, RuntimeError):  # a checkpoint cut short: start over
        return None
    storage = faiss.IndexFlatIP(flat.d)
    for start in range(0, index.ntotal, BLOCK):
        storage.add(flat.reconstruct_n(start, min(BLOCK, index.ntotal - start)))
    storage.this.disown()  # the graph owns it from here on (own_fields), as a fresh IndexHNSWFlat owns its own
    index.storage, index.own_fields = storage, True
    return index
