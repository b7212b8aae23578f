"""Index format 2, and format 1 read through one upgrade step (retrieval.format_upgrade): an older folder serves
and updates as before, and what a writer makes of it is the format its command promises."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import faiss
import numpy as np
import pytest

from index_builder.ann import AnnOptions, add_structure
from index_builder.merge import merge_shards
from retrieval.filters import FilterError
from retrieval.index_format import (
    FORMAT_VERSION,
    INDEX_FILE,
    MANIFEST_FILE,
    PASSAGES_FILE,
    TEXT_HASHES_FILE,
    IndexFormatError,
    Manifest,
    file_record,
    read_manifest,
    sealed,
    write_json_atomic,
)
from retrieval.passage_store import PassageStore
from retrieval.searcher import Searcher
from service.engine.search_engine import SearchEngine
from service.http.app import create_app
from tests.conftest import CPU
from tests.test_layout import BEFORE_LAYOUT
from tests.test_service import one, settings_for

QUERIES = ["join two paths", "parse a url into its parts", "sort a list in place"]


def as_format_1(index: Path) -> Path:
    """`index` rewritten in place as format 1 left an index built before content hashes (and, where it has no
    metadata fields, before the `fields` column): no text-sha256.npy, and a manifest with neither format 2's
    added fields nor its digest, carrying format 1's top-level copies of the dimension and similarity."""
    manifest = read_manifest(index)
    assert (manifest.encoder.backend, manifest.encoder.query_prefix, manifest.encoder.passage_prefix) == ("torch", "", "")
    if not manifest.fields:
        connection = sqlite3.connect(index / PASSAGES_FILE)
        with connection:
            connection.execute("ALTER TABLE passages DROP COLUMN fields")
        connection.execute("VACUUM")
        connection.close()
    (index / TEXT_HASHES_FILE).unlink()
    raw = manifest.model_dump(mode="json", exclude={"manifest_sha256"} | ({"fields"} if not manifest.fields else set())
                              | ({"candidates"} if not manifest.candidates else set()))
    for name in ("backend", "export_sha256", "query_prefix", "passage_prefix"):
        del raw["encoder"][name]
    del raw["corpus"]["sha256"]
    files = {name: file_record(index / name).model_dump() for name in manifest.files if name != TEXT_HASHES_FILE}
    write_json_atomic(index / MANIFEST_FILE, {**raw, "format_version": 1, "dimension": manifest.dimension,
                                              "similarity": manifest.similarity, "files": files})
    return index


@pytest.fixture
def format_1(tmp_path, small_index) -> Path:
    return as_format_1(Path(shutil.copytree(small_index, tmp_path / "old")))


def test_a_build_writes_format_2_with_every_field_stated(small_index):
    raw = json.loads((small_index / MANIFEST_FILE).read_text())
    assert raw["format_version"] == FORMAT_VERSION == 2
    assert set(raw) == set(Manifest.model_fields)  # candidates and fields too, empty as they are here
    assert (raw["candidates"], raw["fields"]) == ([], {})
    assert TEXT_HASHES_FILE in raw["files"]


def test_a_format_1_manifest_is_read_as_format_2_states_it():
    manifest = read_manifest(BEFORE_LAYOUT, verify_checksums=True)  # written by the code of 2026-11-23
    assert manifest.format_version == 1
    record = manifest.encoder
    assert (record.backend, record.export_sha256, record.query_prefix, record.passage_prefix) == ("torch", None, "", "")
    assert (manifest.candidates, manifest.fields, manifest.corpus.sha256) == ([], {}, None)
    assert (manifest.dimension, manifest.similarity, manifest.count) == (384, "cosine", 6)


def test_a_format_1_index_serves_as_it_did_and_says_it_has_no_fields(format_1, encoder, searcher):
    served = Searcher(format_1, encoder, load=CPU)  # every checksum verified: no file of it was changed
    for query in QUERIES:
        assert served.search(query, 5) == searcher.search(query, 5)
    assert all(hit.fields == {} for hit in served.search(QUERIES[0], 5, fields=True))
    with pytest.raises(FilterError, match="built without metadata fields"):
        served.search(QUERIES[0], 5, filter={"source": "x"})
    app = create_app(settings_for(format_1), SearchEngine(served))
    assert one(app, "POST", "/search", {"query": QUERIES[0], "k": 3}).status_code == 200
    response = one(app, "POST", "/search", {"query": QUERIES[0], "filter": {"source": "x"}})
    assert response.status_code == 422 and "it was built without metadata fields" in response.json()["detail"][0]["msg"]


def test_ann_over_a_format_1_index_keeps_its_format_and_the_structure_serves(format_1, encoder, searcher):
    add_structure(format_1, AnnOptions("int8", sample=10), progress=False)
    manifest = read_manifest(format_1, verify_checksums=True)
    assert manifest.format_version == 1 and [record.kind for record in manifest.candidates] == ["int8"]
    served = Searcher(format_1, encoder, load=CPU)
    assert served.answered_by(served.request(10)) == "approximate:int8"
    assert [hit.id for hit in served.search(QUERIES[1], 10)] == [hit.id for hit in searcher.search(QUERIES[1], 10)]


def test_format_1_shards_merge_into_a_format_2_index_of_the_same_passages(tmp_path, small_shards, merged_shards):
    old = [as_format_1(Path(shutil.copytree(shard, tmp_path / "shards" / shard.name))) for shard in small_shards]
    merge_shards(old, tmp_path / "merged")
    manifest = read_manifest(tmp_path / "merged", verify_checksums=True)
    assert manifest.format_version == 2 and TEXT_HASHES_FILE in manifest.files
    stores = [PassageStore(folder / PASSAGES_FILE) for folder in (tmp_path / "merged", merged_shards)]
    rows = list(range(manifest.count))
    assert stores[0].records(rows) == stores[1].records(rows)
    assert stores[0].fields(rows) == [{} for _ in rows]
    vectors = [faiss.read_index(str(folder / INDEX_FILE)).reconstruct_n(0, manifest.count)
               for folder in (tmp_path / "merged", merged_shards)]
    np.testing.assert_array_equal(*vectors)


@pytest.mark.parametrize("change,message", [
    (lambda raw: {**raw, "format_version": 4}, "format_version 4, this code reads 1 to 3"),
    (lambda raw: {key: value for key, value in raw.items() if key != "manifest_sha256"}, "changed after it was written"),
    (lambda raw: {**raw, "count": raw["count"] + 1}, "changed after it was written"),
])
def test_a_manifest_outside_the_format_is_refused_naming_why(tmp_path, small_index, change, message):
    index = Path(shutil.copytree(small_index, tmp_path / "index"))
    raw = json.loads((index / MANIFEST_FILE).read_text())
    (index / MANIFEST_FILE).write_text(json.dumps(change(raw)))
    with pytest.raises(IndexFormatError, match=message):
        read_manifest(index)


@pytest.mark.parametrize("update,message", [
    ({"format_version": 3}, "format_version 3 with 0 sealed writes"),
    ({"sealed_writes": 2}, "format_version 2 with 2 sealed writes"),
])
def test_sealed_writes_come_in_format_3_alone(tmp_path, small_index, update, message):
    index = Path(shutil.copytree(small_index, tmp_path / "index"))
    write_json_atomic(index / MANIFEST_FILE, sealed(read_manifest(index).model_copy(update=update)))
    with pytest.raises(IndexFormatError, match=message):
        read_manifest(index)


def test_a_format_2_index_must_list_its_content_hashes(tmp_path, small_index):
    index = Path(shutil.copytree(small_index, tmp_path / "index"))
    manifest = read_manifest(index)
    files = {name: record for name, record in manifest.files.items() if name != TEXT_HASHES_FILE}
    write_json_atomic(index / MANIFEST_FILE, sealed(manifest.model_copy(update={"files": files})))
    with pytest.raises(IndexFormatError, match=f"{TEXT_HASHES_FILE} missing from the manifest"):
        read_manifest(index)
