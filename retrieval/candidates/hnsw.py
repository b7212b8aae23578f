"""hnsw: a HNSW graph (faiss IndexHNSWFlat, inner product) over index.faiss's vectors. As built, the file holds the
graph only (written with IO_FLAG_SKIP_STORAGE) and the loaded graph reads the flat index's vectors, so they are not
held twice (memory-mapped, they are the page cache's, not the process's). A build saves its graph every
checkpoint_seconds, so an interrupted one resumes.

A graph cannot lose a node, so a compaction (retrieval.compaction) keeps the graph and adds the written vectors to
it (Lucene's and Qdrant's way with deletes): the file then holds an IndexIDMap2 over the graph with its own vectors
(memory-mapped when read), each node mapped to its row of the new generation and a deleted passage's node to -1,
still walked through but never proposed. Past DEAD_SHARE of its nodes deleted, the graph is built again."""

from __future__ import annotations

import json
import os
from pathlib import Path

import faiss
import numpy as np

from retrieval.candidates.kind import BLOCK, Kind, Param, Structure, write_index

LIVE_ROWS = 2**62  # past any row: the selector of an extended graph's rows, [0, LIVE_ROWS), leaves out -1


class Hnsw(Kind):
    name = "hnsw"
    summary = "a HNSW graph over index.faiss's own vectors (as built, the file holds the links only)"
    params = {
        "M": Param(32, "--m", "links per node"),
        "efConstruction": Param(200, "--ef-construction", "search width while building"),
        "efSearch": Param(128, "--ef-search", "search width while searching", raises_recall=True),
    }
    index_type = (faiss.IndexHNSWFlat, faiss.IndexIDMap2)  # as built; extended by a compaction
    skips_storage = True
    checkpoint_seconds = 300.0
    # Past this share of its nodes deleted, a compaction builds the graph again rather than extend it: each dead
    # node still costs the searches that walk through it, and its vector is held.
    DEAD_SHARE = 0.2

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
        if isinstance(structure.index, faiss.IndexIDMap2):  # an extended graph: its deleted nodes (row -1) left out
            live = faiss.IDSelectorRange(0, LIVE_ROWS)
            selector = live if selector is None else faiss.IDSelectorAnd(live, selector)
        if selector is not None:
            search.sel = selector
        return structure.index.search(vectors, depth, params=search)[1]

    def extended(self, index, removed, vectors):
        """The graph with the nodes of the rows `removed` mapped to -1 (kept as paths, never proposed), the others
        to their rows renumbered, and `vectors` added as nodes of the next rows; None past DEAD_SHARE deleted."""
        graph, ids = _graph_and_ids(index)
        dead_rows = np.zeros(int(ids.max(initial=-1)) + 1, dtype=bool)
        dead_rows[removed] = True
        dead = (ids < 0) | dead_rows[np.maximum(ids, 0)]
        if dead.sum() > self.DEAD_SHARE * (len(ids) + len(vectors)):
            return None
        renumbered = np.where(dead, -1, ids - np.searchsorted(removed, ids)).astype(np.int64)
        copy = _owned_copy(graph)
        mapped = faiss.IndexIDMap2(faiss.IndexHNSWFlat(graph.d, 4, graph.metric_type))
        copy.this.disown()  # IndexIDMap2 takes only an empty index: the graph is put in its place, owned by it
        mapped.index, mapped.own_fields, mapped.ntotal = copy, True, copy.ntotal
        faiss.copy_array_to_vector(renumbered, mapped.id_map)
        if len(vectors):
            start = int((~dead).sum())
            mapped.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32),
                                np.arange(start, start + len(vectors), dtype=np.int64))
        return mapped

    def rows(self, index) -> int:
        if not isinstance(index, faiss.IndexIDMap2):
            return index.ntotal
        if not isinstance(faiss.downcast_index(index.index), faiss.IndexHNSWFlat):
            return -1  # an IndexIDMap2 over anything but a graph is no structure of this kind
        return int((faiss.vector_to_array(index.id_map) >= 0).sum())

    def without_vectors(self, index) -> bool:
        return not isinstance(index, faiss.IndexIDMap2)

    def read_flags(self) -> int:
        return faiss.IO_FLAG_SKIP_STORAGE | faiss.IO_FLAG_MMAP_IFC  # an extended graph's own vectors: mapped

    def attach(self, index, flat: faiss.IndexFlat) -> None:
        """Make the graph search `flat`'s vectors (which it must outlive: it keeps a reference); its own copy,
        a fresh build's, is freed. An extended graph keeps its own vectors."""
        if isinstance(index, faiss.IndexIDMap2):
            return
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


def _graph_and_ids(index):
    """(the graph, each node's row: -1 for a deleted one) of a graph as built or extended."""
    if isinstance(index, faiss.IndexIDMap2):
        return faiss.downcast_index(index.index), faiss.vector_to_array(index.id_map)
    return index, np.arange(index.ntotal, dtype=np.int64)


def _owned_copy(graph: faiss.IndexHNSWFlat) -> faiss.IndexHNSWFlat:
    """A copy of `graph` that owns its links and a copy of the vectors it reads (index.faiss's, or its own), the
    vectors read in blocks of BLOCK. Not faiss.clone_index: a graph read mapped clones into views of the same
    mapped arrays, which cannot grow."""
    writer = faiss.VectorIOWriter()
    faiss.write_index(graph, writer, faiss.IO_FLAG_SKIP_STORAGE)
    copy = faiss.deserialize_index(faiss.vector_to_array(writer.data))
    del writer
    storage = faiss.IndexFlat(graph.d, graph.metric_type)
    for start in range(0, graph.ntotal, BLOCK):
        storage.add(graph.storage.reconstruct_n(start, min(BLOCK, graph.ntotal - start)))
    storage.this.disown()
    copy.storage, copy.own_fields = storage, True
    return copy


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
