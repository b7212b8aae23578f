"""A compaction extends each candidate structure it can instead of building it again (retrieval.compaction): the
structure over the new generation holds one entry per row, the kept rows' as they were (renumbered past the
removed ones) and the written passages' encoded by the same trained quantizer; a graph (hnsw) keeps every node,
a deleted passage's walked through but never proposed, and takes the written ones as new nodes, until too many of
its nodes are deleted; every structure's recall card is measured again, on the new generation."""

from __future__ import annotations

import shutil
from pathlib import Path

import faiss
import numpy as np
import pytest

from bench.scale import build_synthetic, clustered_vectors, unit_vectors
from index_builder.build import encoder_record
from retrieval import dense_index, index_writer
from retrieval.candidates import recall, structures
from retrieval.candidates.registry import KINDS
from retrieval.compaction import compact
from retrieval.index_format import INDEX_FILE, read_manifest
from retrieval.searcher import Searcher
from retrieval.writes import Writes
from tests.conftest import CPU

SIZE, CHANGED = 3000, 120
EXTENDED = ["int8", "binary", "ivf", "pq"]


@pytest.fixture(scope="module")
def structured(tmp_path_factory, encoder) -> Path:
    out = tmp_path_factory.mktemp("structures") / "index"
    record = encoder_record(encoder)
    centres = unit_vectors(np.random.default_rng(3), 40, record.dimension)
    build_synthetic(out, SIZE, record.dimension, record, centres, 0.35, bm25=True)
    for kind in [*EXTENDED, "hnsw"]:
        index_writer.write_candidates(out, kind, sample=200, progress=False)
    return out


def entries(index) -> dict[int, bytes]:
    """Each row's entry in a structure: its code (and, in an IVF index, the list it is filed under)."""
    if isinstance(index, faiss.IndexIVF):
        lists, found = index.invlists, {}
        for number in range(index.nlist):
            size, code = lists.list_size(number), index.code_size
            ids = faiss.rev_swig_ptr(lists.get_ids(number), size).copy()
            codes = faiss.rev_swig_ptr(lists.get_codes(number), size * code).reshape(size, code)
            found.update((int(row), bytes([number % 256, number // 256]) + codes[i].tobytes())
                         for i, row in enumerate(ids))
        return found
    codes = faiss.vector_to_array(index.xb if isinstance(index, faiss.IndexBinaryFlat) else index.codes)
    return {row: part.tobytes() for row, part in enumerate(codes.reshape(index.ntotal, -1))}


def test_a_compaction_extends_each_structure_with_the_written_rows_and_measures_its_card_again(structured, tmp_path,
                                                                                              encoder):
    index = Path(shutil.copytree(structured, tmp_path / "index"))
    writes = Writes.open(Searcher(index, encoder, CPU))
    before = {kind: entries(writes.searcher.structures[kind].index) for kind in EXTENDED}
    rng = np.random.default_rng(5)
    vectors = clustered_vectors(rng, unit_vectors(np.random.default_rng(3), 40, 384), CHANGED, 0.35)
    writes.upsert([{"id": f"new-{i}", "text": f"written passage {i}"} for i in range(CHANGED)], vectors)
    removed = np.sort(rng.choice(SIZE, size=CHANGED, replace=False))
    writes.delete(ids=[f"p{row}" for row in removed])
    assert compact(writes) is not None
    writes.close()

    manifest = read_manifest(index)
    assert manifest.count == SIZE
    kept = np.setdiff1d(np.arange(SIZE), removed)
    served = Searcher(index, encoder, CPU)
    flat = dense_index.load_index(index / INDEX_FILE, "cpu", mmap=True)
    for kind in EXTENDED:
        now = entries(served.structures[kind].index)
        assert sorted(now) == list(range(SIZE)), kind
        assert [now[row] for row in range(len(kept))] == [before[kind][row] for row in kept], kind
        fresh = KINDS[kind].extended(served.structures[kind].index, np.zeros(0, dtype=np.int64), vectors)
        assert [entries(fresh)[SIZE + i] for i in range(CHANGED)] == [now[len(kept) + i] for i in range(CHANGED)], kind
    graph = served.structures["hnsw"].index
    assert isinstance(graph, faiss.IndexIDMap2) and graph.ntotal == SIZE + CHANGED  # every node kept
    nodes = faiss.vector_to_array(graph.id_map)
    assert list(nodes[kept]) == list(range(len(kept))) and set(nodes[removed]) == {-1}
    assert list(nodes[SIZE:]) == list(range(len(kept), SIZE))
    assert_nodes_hold_their_rows(graph, flat)
    for record in manifest.candidates:  # each card is the one its structure, as written, measures now
        card = recall.measure_recall(served.structures[record.kind], flat, sample=record.sample)
        assert (record.recall_at_10, record.recall_at_100) == (round(card.recall_at_10, 4),
                                                               round(card.recall_at_100, 4)), record.kind


def assert_nodes_hold_their_rows(graph, flat) -> None:
    """Each node of an extended graph that is a row holds that row's vector of the generation."""
    nodes = faiss.vector_to_array(graph.id_map)
    vectors = faiss.downcast_index(graph.index).storage.reconstruct_n(0, graph.ntotal)
    rows = np.flatnonzero(nodes >= 0)
    assert sorted(nodes[rows]) == list(range(flat.ntotal))
    np.testing.assert_array_equal(vectors[rows], flat.reconstruct_batch(nodes[rows]))


def test_an_extended_graph_proposes_only_live_rows_and_finds_the_written_ones(structured, tmp_path, encoder):
    index = Path(shutil.copytree(structured, tmp_path / "index"))
    writes = Writes.open(Searcher(index, encoder, CPU))
    rng = np.random.default_rng(8)
    centres = unit_vectors(np.random.default_rng(3), 40, 384)
    deleted = rng.choice(SIZE, size=200, replace=False)
    for round_ in range(2):  # the second compaction extends a graph already extended
        vectors = clustered_vectors(rng, centres, 50, 0.35)
        writes.upsert([{"id": f"new-{round_}-{i}", "text": f"written {i}"} for i in range(50)], vectors)
        writes.delete(ids=[f"p{row}" for row in deleted[100 * round_:100 * (round_ + 1)]])
        assert compact(writes) is not None
    writes.close()

    served = Searcher(index, encoder, CPU)
    structure, flat = served.structures["hnsw"], dense_index.load_index(index / INDEX_FILE, "cpu", mmap=True)
    assert flat.ntotal == SIZE - 100 and structure.index.ntotal == SIZE + 100
    assert_nodes_hold_their_rows(structure.index, flat)
    queries = clustered_vectors(np.random.default_rng(9), centres, 30, 0.35)
    proposed = structures.candidates(structure, queries, 200)
    assert proposed.min() >= 0 and proposed.max() < flat.ntotal  # no deleted node, and the depth filled
    even = faiss.IDSelectorBatch(np.arange(0, flat.ntotal, 2, dtype=np.int64))
    filtered = structures.candidates(structure, queries, 50, even)
    assert np.all(filtered[filtered >= 0] % 2 == 0)
    written = flat.reconstruct_batch(np.arange(flat.ntotal - 50, flat.ntotal))
    assert list(structures.search(structure, flat, written, 1)[1][:, 0]) == list(range(flat.ntotal - 50, flat.ntotal))


def test_a_graph_with_too_many_deleted_nodes_is_built_again(structured, encoder):
    graph = Searcher(structured, encoder, CPU).structures["hnsw"].index
    hnsw = KINDS["hnsw"]
    few = np.arange(0, int(hnsw.DEAD_SHARE * SIZE) - 1, dtype=np.int64)
    many = np.arange(0, int(hnsw.DEAD_SHARE * SIZE) + 1, dtype=np.int64)
    assert hnsw.extended(graph, few, np.zeros((0, graph.d), dtype=np.float32)) is not None
    assert hnsw.extended(graph, many, np.zeros((0, graph.d), dtype=np.float32)) is None
