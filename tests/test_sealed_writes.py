"""A compaction below the merge share seals the writes beside the rows (retrieval.compaction): the new generation
links every file of the old one and holds the writes themselves, each load replays them, and every answer, the
writer's and a replica's, is the one the writer gave before; a merge then folds them into the rows. Nothing that
reads the rows alone (an update, a shard) takes such a generation."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from index_builder.cli import main as index_builder
from retrieval.compaction import compact
from retrieval.index_format import (
    FORMAT_VERSION,
    INDEX_FILE,
    PASSAGES_FILE,
    SEALED_WRITES_FILE,
    SEALED_WRITES_FORMAT,
    IndexFormatError,
    read_manifest,
)
from retrieval.searcher import Searcher
from retrieval.sharding import ShardIndex
from retrieval.write_log import log_path, read
from retrieval.writes import Writes
from service.engine.search_engine import SearchEngine
from service.http.app import create_app
from retrieval.index_format import MANIFEST_FILE, sealed, write_json_atomic
from tests.conftest import CPU
from tests.test_format_upgrade import as_format_1
from tests.test_service import one, settings_for
from tests.test_writes import BASE, MODES, QUERIES, collection, demo_texts, record
from tests.test_writes import base_corpus, base_index, writes  # noqa: F401 - the fixtures: a writer over a base index

FILTERS = [None, {"year": {"$gte": 2003}}, {"tags": "even"}]


def write_some(writes: Writes, start: int) -> None:
    """Upserts new passages and one replacing a generation's passage, then deletes one of each kind. Each call's
    texts are its own: two passages of one text tie, and a tie may come back in either order."""
    texts = demo_texts()
    writes.upsert([record(f"new-{start + i}", texts[BASE + start + i][1], start + i) for i in range(6)])
    writes.upsert([record(texts[start][0], f"a replaced passage about sorting list {start} in place", 3)])
    writes.delete(ids=[texts[start + 1][0], f"new-{start}"])
    writes.upsert([record(f"new-{start + 1}", f"written twice: reading file {start} line by line", 5)])


def answers(searcher: Searcher) -> dict:
    return {(str(mode), str(where)): [[(hit.id, hit.score) for hit in hits]
                                      for hits in searcher.batch_search(QUERIES, 10, exact=True, filter=where, **mode)]
            for mode in MODES for where in FILTERS}


def assert_same_answers(expected: dict, got: dict) -> None:
    assert expected.keys() == got.keys()
    for key in expected:
        for old, new in zip(expected[key], got[key]):
            assert [pid for pid, _ in old] == [pid for pid, _ in new], key
            np.testing.assert_allclose([s for _, s in old], [s for _, s in new], rtol=1e-5, atol=1e-6)


def inode(path: Path) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino


def test_a_seal_links_the_rows_files_holds_the_writes_and_answers_as_the_writer_did(writes, encoder):
    index = writes.searcher.index_dir
    linked = {name: inode(index / name) for name in (INDEX_FILE, PASSAGES_FILE)}
    write_some(writes, 0)
    before, count = answers(writes.searcher), writes.searcher.count

    report = compact(writes, merge_share=1.0)

    manifest = read_manifest(index)
    assert not report.merged and report.count == count
    assert (manifest.format_version, manifest.sealed_writes, manifest.write_sequence) == (SEALED_WRITES_FORMAT, 4, 4)
    assert manifest.count == BASE and {name: inode(index / name) for name in linked} == linked
    assert [record.seq for record in read(index / SEALED_WRITES_FILE)[0]] == [1, 2, 3, 4]
    assert read(log_path(index))[0] == []  # the log drops what the generation holds
    assert_same_answers(before, answers(writes.searcher))
    replica = Searcher(index, encoder, CPU)
    assert replica.count == count and replica.segment.seq == 4
    assert_same_answers(before, answers(replica))
    assert replica.passage("new-1").text == "written twice: reading file 0 line by line"
    assert replica.passage("new-0") is None and replica.passage(demo_texts()[1][0]) is None


def test_seals_add_to_the_last_one_and_a_merge_folds_them_into_the_rows(writes, encoder):
    index = writes.searcher.index_dir
    write_some(writes, 0)
    compact(writes, merge_share=1.0)
    write_some(writes, 10)
    before, count = answers(writes.searcher), writes.searcher.count

    compact(writes, merge_share=1.0)
    assert read_manifest(index).sealed_writes == 8
    assert_same_answers(before, answers(Searcher(index, encoder, CPU)))

    report = compact(writes)  # merge_share 0: merged
    manifest = read_manifest(index)
    assert report.merged and (manifest.format_version, manifest.sealed_writes) == (FORMAT_VERSION, 0)
    assert manifest.count == count and SEALED_WRITES_FILE not in manifest.files
    assert not (index / SEALED_WRITES_FILE).exists()
    assert_same_answers(before, answers(writes.searcher))
    assert_same_answers(before, answers(Searcher(index, encoder, CPU)))


def test_a_writer_reopened_on_a_sealed_generation_replays_only_the_later_writes(writes, encoder):
    index = writes.searcher.index_dir
    write_some(writes, 0)
    compact(writes, merge_share=1.0)
    writes.upsert([record("after", "a passage written after the seal", 1)])
    before = answers(writes.searcher)
    writes.close()

    again = Writes.open(Searcher(index, encoder, CPU))
    try:
        assert again.seq == 5 and [record.seq for record in again.log.records] == [5]
        assert_same_answers(before, answers(again.searcher))
        assert again.upsert([record("later", "and one more", 2)]) == 6
    finally:
        again.close()


def test_a_sealed_writes_file_changed_on_disk_is_refused(writes, encoder):
    index = writes.searcher.index_dir
    write_some(writes, 0)
    compact(writes, merge_share=1.0)
    writes.close()
    data = bytearray((index / SEALED_WRITES_FILE).read_bytes())
    data[20] ^= 0xFF
    (index / SEALED_WRITES_FILE).write_bytes(bytes(data))
    with pytest.raises(IndexFormatError, match=f"{SEALED_WRITES_FILE}: sha256 differs"):
        Searcher(index, encoder, CPU)


def test_what_reads_the_rows_alone_refuses_sealed_writes_until_compact_merges_them(writes, capsys):
    index = writes.searcher.index_dir
    write_some(writes, 0)
    compact(writes, merge_share=1.0)
    count = writes.searcher.count
    writes.close()
    deletions = index.parent / "delete.txt"
    deletions.write_text("new-2\n")

    assert index_builder(["update", "--index", str(index), "--delete", str(deletions)]) == 2
    assert f"merge them first (python -m index_builder compact --index {index})" in capsys.readouterr().err
    with pytest.raises(IndexFormatError, match="4 writes over HTTP sealed beside its rows, which a shard does not"):
        ShardIndex(index, CPU)

    assert index_builder(["compact", "--index", str(index)]) == 0
    assert f"merged writes 1..4 into {index}" in capsys.readouterr().out
    assert read_manifest(index).sealed_writes == 0 and read_manifest(index).count == count
    assert index_builder(["update", "--index", str(index), "--delete", str(deletions)]) == 0
    assert read_manifest(index).count == count - 1


def test_eval_counts_what_a_filter_keeps_of_the_collection_its_sealed_writes_included(writes, capsys):
    index = writes.searcher.index_dir
    write_some(writes, 0)
    compact(writes, merge_share=1.0)
    kept, count = sum(passage["year"] >= 2003 for passage in collection(writes)), writes.searcher.count
    writes.close()
    (index.parent / "queries.tsv").write_text(f"q1\t{QUERIES[0]}\n")
    (index.parent / "qrels.txt").write_text("q1 0 new-1 1\n")

    assert index_builder(["eval", "--index", str(index), "--queries", str(index.parent / "queries.tsv"), "--qrels",
                          str(index.parent / "qrels.txt"), "--modes", "bm25", "--filter", '{"year": {"$gte": 2003}}']) == 0
    assert f"{kept} of {count} passages match" in capsys.readouterr().out


def as_shard(index: Path) -> Path:
    write_json_atomic(index / MANIFEST_FILE, sealed(read_manifest(index).model_copy(update={"shard": "0/2"})))
    return index


@pytest.mark.parametrize("made", [as_format_1, as_shard], ids=["format 1", "a shard"])
def test_a_format_1_folder_or_a_shard_is_merged_whatever_its_writes(tmp_path, base_index, encoder, made):
    index = made(Path(shutil.copytree(base_index, tmp_path / "index")))
    writes = Writes.open(Searcher(index, encoder, CPU))
    try:
        write_some(writes, 0)
        before = answers(writes.searcher)
        assert compact(writes, merge_share=1.0).merged
    finally:
        writes.close()
    manifest = read_manifest(index)
    assert (manifest.format_version, manifest.sealed_writes, manifest.shard) == (FORMAT_VERSION, 0, None)
    assert_same_answers(before, answers(Searcher(index, encoder, CPU)))


def test_a_structure_added_to_a_sealed_generation_keeps_its_writes(writes, encoder):
    index = writes.searcher.index_dir
    write_some(writes, 0)
    compact(writes, merge_share=1.0)
    before = answers(writes.searcher)
    writes.close()

    assert index_builder(["ann", "--index", str(index), "--kind", "binary", "--sample", "10"]) == 0

    manifest = read_manifest(index)
    assert (manifest.format_version, manifest.sealed_writes) == (SEALED_WRITES_FORMAT, 4)
    assert {record.kind for record in manifest.candidates} == {"int8", "binary"}
    replica = Searcher(index, encoder, CPU)
    assert_same_answers(before, answers(replica))
    found = replica.search("written twice: reading file 0 line by line", 1, mode="dense", structure="binary")
    assert found[0].id == "new-1"


def test_the_service_seals_below_its_merge_share_and_a_replica_follows(tmp_path, base_index, encoder):
    index = Path(shutil.copytree(base_index, tmp_path / "served"))
    writer = create_app(settings_for(index, writes=True, compact_passages=3, merge_share=0.5),
                        SearchEngine(Searcher(index, encoder, CPU)))
    replica = create_app(settings_for(index), SearchEngine(Searcher(index, encoder, CPU)))
    runtime = writer.state.runtime
    for i in range(3):
        written = one(writer, "POST", "/passages", {"passages": [{"id": f"n{i}", "text": f"passage {i}"}]})
        assert written.status_code == 200
    runtime.compacting.result(timeout=300)
    ready = one(writer, "GET", "/ready").json()["index"]
    assert (ready["count"], ready["write_sequence"]) == (BASE + 3, 3) and read_manifest(index).sealed_writes == 3
    reloaded = one(replica, "POST", "/admin/reload", {"index": "served"}).json()  # as its index watch would
    assert (reloaded["generation"], reloaded["count"]) == (ready["generation"], BASE + 3)
    found = one(replica, "POST", "/search", {"query": "passage 1", "k": 3, "mode": "bm25"}).json()
    assert "n1" in [hit["id"] for hit in found["results"]]
    # The sealed writes are not counted again toward the next compaction: one more write starts none.
    assert one(writer, "POST", "/passages", {"passages": [{"id": "n3", "text": "passage 3"}]}).status_code == 200
    assert runtime.compacting.done() and read_manifest(index).write_sequence == 3
    runtime.writes.close()
