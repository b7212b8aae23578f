"""Writes without a build (retrieval.writes): an upsert or delete is searched at once, in every mode, exactly as
a full build of the changed collection answers; a batch is checked whole; the log replays what was acknowledged,
and a kill at any moment loses none of it."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from index_builder.ann import AnnOptions
from index_builder.build import BuildOptions, build_index
from index_builder.update import ChangeOptions, apply_changes
from retrieval import out_lock
from retrieval.compaction import compact
from retrieval.feedback import Feedback
from retrieval.index_format import read_manifest
from retrieval.searcher import Searcher
from retrieval.write_log import HEADER, LogCorrupt, Record, log_path, read
from retrieval.writes import WriteError, Writes
from service.engine.search_engine import SearchEngine
from service.http.app import create_app
from tests.conftest import CPU, DEMO, ROOT, read_tsv
from tests.test_service import call, one, settings_for

BASE = 40
QUERIES = ["join two paths", "parse a url into its parts", "sort a list in place", "read a file line by line"]
MODES = [{"mode": "dense"}, {"mode": "bm25"}, {"mode": "hybrid", "fusion": "interleave"},
         {"mode": "hybrid", "fusion": "rrf"}, {"mode": "hybrid", "fusion": "zscore"},
         {"mode": "hybrid", "fusion": "zscore", "dense_weight": 0.8, "feedback": Feedback(3, 2.0)}]


def demo_texts() -> list[tuple[str, str]]:
    return list(read_tsv(DEMO / "corpus.tsv").items())


def record(pid: str, text: str, number: int) -> dict:
    return {"id": pid, "text": text, "year": 2000 + number % 7, "tags": ["even" if number % 2 == 0 else "odd"]}


@pytest.fixture(scope="module")
def base_corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("writes") / "base.jsonl"
    texts = demo_texts()
    path.write_text("".join(json.dumps(record(pid, text, i)) + "\n" for i, (pid, text) in enumerate(texts[:BASE])))
    return path


@pytest.fixture(scope="module")
def base_index(tmp_path_factory, base_corpus, encoder) -> Path:
    out = tmp_path_factory.mktemp("writes-index") / "base"
    build_index(BuildOptions(base_corpus, out, bm25=True, ann=[AnnOptions("int8", sample=10)]), encoder)
    return out


@pytest.fixture
def writes(tmp_path, base_index, encoder):
    index = Path(shutil.copytree(base_index, tmp_path / "index"))
    opened = Writes.open(Searcher(index, encoder, CPU))
    yield opened
    opened.close()


def collection(writes: Writes) -> list[dict]:
    """The records the writes' collection holds, in its order: the generation's live rows, then the written ones."""
    searcher = writes.searcher
    segment = searcher.segment
    rows = [row for row in range(segment.base_count) if not segment.is_hidden(row)]
    rows += [segment.base_count + i for i in np.flatnonzero(segment.live)]
    (hits,) = searcher.hits([[(row, 0.0) for row in rows]], tuple(searcher.field_types))
    return [{"id": hit.id, "text": hit.text, **hit.fields} for hit in hits]


def rebuilt(writes: Writes, folder: Path, encoder) -> Searcher:
    folder.mkdir()
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(item) + "\n" for item in collection(writes)))
    build_index(BuildOptions(corpus, folder / "index", bm25=True), encoder)
    return Searcher(folder / "index", encoder, CPU)


def same_answers(live: Searcher, full: Searcher, **options) -> None:
    for query in QUERIES:
        got, expected = live.search(query, 10, **options), full.search(query, 10, **options)
        assert [hit.id for hit in got] == [hit.id for hit in expected], (query, options)
        np.testing.assert_allclose([hit.score for hit in got], [hit.score for hit in expected], rtol=1e-5, atol=1e-5)


def test_random_upserts_and_deletes_answer_as_a_full_build_in_every_mode(writes, tmp_path, encoder):
    chooser, texts = random.Random(7), demo_texts()
    fresh = iter(range(BASE, len(texts)))
    for _ in range(6):
        batch = []
        for _ in range(chooser.randint(1, 5)):
            if chooser.random() < 0.5:  # a new passage
                number = next(fresh)
                batch.append(record(texts[number][0], texts[number][1], number))
            else:  # an existing id with another text and fields
                number = chooser.randrange(BASE)
                batch.append(record(texts[number][0], texts[next(fresh)][1] + " revised", number + 1))
        batch = list({item["id"]: item for item in batch}.values())
        writes.upsert(batch)
        writes.delete(ids=[texts[chooser.randrange(BASE)][0], "no-such-id"])
    seq, deleted = writes.delete(filter={"year": 2003})
    assert deleted > 0 and seq == writes.seq
    full = rebuilt(writes, tmp_path / "full", encoder)
    live = writes.searcher
    assert live.count == full.count
    for mode in MODES:
        same_answers(live, full, exact=True, **mode)
        same_answers(live, full, exact=True, filter={"tags": "even"}, fields=True, **mode)
    with_structure = live.search(QUERIES[0], 10)  # the generation's rows through its int8 structure
    assert {hit.id for hit in with_structure} <= {item["id"] for item in collection(writes)}


def test_a_write_is_seen_by_the_next_search_and_read_back(writes):
    seq = writes.upsert([{"id": "new-1", "title": "Paths", "text": "glue two filesystem paths together", "year": 1999}])
    assert seq == 1 and writes.seq == 1
    assert writes.searcher.search("glue two filesystem paths together", 1, mode="bm25")[0].id == "new-1"
    found = writes.get("new-1")
    assert (found.text, found.fields) == ("Paths glue two filesystem paths together", {"year": 1999})
    first = demo_texts()[0][0]
    assert writes.get(first) is not None
    assert writes.delete(ids=[first]) == (2, 1)
    assert writes.get(first) is None and first not in {h.id for h in writes.searcher.search(QUERIES[0], 40)}
    assert writes.delete(ids=[first]) == (2, 0)  # nothing left to delete: not logged


@pytest.mark.parametrize("items,path,message", [
    ([{"id": "a", "text": " "}], ("passages", 0, "text"), "empty text"),
    ([{"text": "no id"}], ("passages", 0, "id"), 'missing "id"'),
    ([{"id": "x" * 513, "text": "t"}], ("passages", 0, "id"), "over the limit of 512"),
    ([{"id": "a", "text": "t"}, {"id": "a", "text": "u"}], ("passages", 1, "id"), "also item 0"),
    ([{"id": "a", "text": "t"}, {"id": "b", "text": "u", "year": "1999"}], ("passages", 1, "year"),
     'field "year" is a string here but a number'),
])
def test_a_bad_batch_is_refused_whole_naming_the_item_and_field(writes, items, path, message):
    count = writes.searcher.count
    with pytest.raises(WriteError, match=message) as error:
        writes.upsert(items)
    assert error.value.path == path
    assert writes.seq == 0 and writes.searcher.count == count and writes.get("a") is None


def test_the_log_replays_every_write_after_a_restart(writes, encoder):
    writes.upsert([{"id": "new-1", "text": "glue two filesystem paths together"}])
    writes.delete(ids=[demo_texts()[3][0]])
    before = [hit.id for hit in writes.searcher.search(QUERIES[0], 10)]
    writes.close()
    again = Writes.open(Searcher(writes.searcher.index_dir, encoder, CPU))
    assert again.seq == 2 and [hit.id for hit in again.searcher.search(QUERIES[0], 10)] == before
    again.close()


def test_a_torn_last_record_is_dropped_and_the_writes_before_it_kept(writes, encoder, caplog):
    writes.upsert([{"id": "new-1", "text": "kept"}])
    path = log_path(writes.searcher.index_dir)
    writes.close()
    whole = path.stat().st_size
    torn = Record(2, upsert=({"id": "new-2", "text": "torn", "fields": {}},), vectors=np.ones((1, 384), np.float32))
    path.write_bytes(path.read_bytes() + torn.encode()[:-7])
    again = Writes.open(Searcher(writes.searcher.index_dir, encoder, CPU))
    assert again.seq == 1 and again.get("new-2") is None and again.get("new-1") is not None
    assert path.stat().st_size == whole and "dropped" in caplog.text
    again.close()


KILLED_WRITER = """
import sys
import numpy as np
from retrieval.write_log import Record, WriteLog
log = WriteLog.open(sys.argv[1])
while True:
    seq = log.last_seq + 1
    passages = tuple({"id": f"w{seq}-{i}", "text": f"passage {i} of write {seq}", "fields": {}} for i in range(3))
    log.append(Record(seq, upsert=passages, vectors=np.full((3, 384), seq, dtype=np.float32)))
    print(seq, flush=True)  # acknowledged: on disk
"""


def test_a_log_killed_at_random_moments_loses_no_acknowledged_write_and_no_batch_is_half_there(tmp_path):
    index, chooser, acknowledged = tmp_path / "index", random.Random(11), 0
    index.mkdir()
    for trial in range(20):
        writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(index)], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)
        for _ in range(chooser.randint(1, 30)):
            line = writer.stdout.readline()
            assert line, f"trial {trial}: the writer stopped"
            acknowledged = int(line)
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        records, _ = read(log_path(index))
        assert [record.seq for record in records] == list(range(1, len(records) + 1))
        assert records[-1].seq >= acknowledged
        for record in records:
            assert len(record.upsert) == 3 and np.all(record.vectors == record.seq)



@pytest.fixture
def writer_app(tmp_path, base_index, encoder):
    index = Path(shutil.copytree(base_index, tmp_path / "served"))
    app = create_app(settings_for(index, writes=True, max_write_passages=8, max_write_tokens=400),
                     SearchEngine(Searcher(index, encoder, CPU)))
    yield app
    app.state.runtime.writes.close()


def test_writes_over_http_are_answered_with_their_sequence_and_searched_at_once(writer_app):
    written = one(writer_app, "POST", "/passages", {"passages": [
        {"id": "new-1", "title": "Paths", "text": "glue two filesystem paths together", "year": 1999, "tags": ["x"]}]})
    assert written.status_code == 200 and written.json() == {"seq": 1, "upserted": 1, "deleted": 0, "count": BASE + 1}
    found = one(writer_app, "POST", "/search", {"query": "glue two filesystem paths together", "k": 1, "mode": "bm25",
                                                "filter": {"tags": "x"}, "fields": True})
    assert [(hit["id"], hit["fields"]) for hit in found.json()["results"]] == [("new-1", {"year": 1999, "tags": ["x"]})]
    back = one(writer_app, "GET", "/passages/new-1").json()
    assert back == {"id": "new-1", "text": "Paths glue two filesystem paths together", "fields": {"year": 1999, "tags": ["x"]}}
    deleted = one(writer_app, "POST", "/passages/delete", {"filter": {"year": {"$lt": 2000}}})
    assert deleted.json() == {"seq": 2, "upserted": 0, "deleted": 1, "count": BASE}
    assert one(writer_app, "GET", "/passages/new-1").status_code == 404
    ready = one(writer_app, "GET", "/ready").json()["index"]
    assert (ready["count"], ready["write_sequence"]) == (BASE, 2)
    one(writer_app, "POST", "/passages", {"passages": [{"id": "docs/a b", "text": "an id with a slash and a space"}]})
    assert one(writer_app, "GET", "/passages/docs/a%20b").json()["id"] == "docs/a b"


@pytest.mark.parametrize("path,body,loc,message", [
    ("/passages", {"passages": [{"id": "a", "text": "t"}], "upsert": True}, ["body", "upsert"], "Extra inputs"),
    ("/passages", {"passages": [{"id": "a", "text": "t"}, {"id": "b", "text": "u", "year": "old"}]},
     ["body", "passages", 1, "year"], 'field "year" is a string here but a number'),
    ("/passages", {"passages": [{"id": str(i), "text": "t"} for i in range(9)]}, ["body", "passages"],
     "over the max_write_passages limit of 8 (SEARCH_MAX_WRITE_PASSAGES)"),
    ("/passages", {"passages": [{"id": f"long{i}", "text": "word " * 500} for i in range(2)]}, ["body", "passages"],
     "over the max_write_tokens limit of 400 (SEARCH_MAX_WRITE_TOKENS)"),
    ("/passages/delete", {"ids": ["a"], "filter": {"year": 2000}}, ["body", "ids"], "one of them"),
    ("/passages/delete", {"filter": {"yeer": 2000}}, ["body", "filter", "yeer"], "yeer"),
])
def test_a_bad_write_is_a_422_naming_the_field_and_writes_nothing(writer_app, path, body, loc, message):
    response = one(writer_app, "POST", path, body)
    assert response.status_code == 422, response.text
    (problem,) = response.json()["detail"]
    assert problem["loc"] == loc and message in problem["msg"]
    assert one(writer_app, "GET", "/ready").json()["index"]["write_sequence"] == 0


def test_concurrent_writes_and_searches_all_succeed_each_write_once(writer_app):
    writes = [("POST", "/passages", {"passages": [{"id": f"c{i}", "text": f"concurrent passage number {i}"}]})
              for i in range(8)]
    searches = [("POST", "/search", {"query": QUERIES[i % len(QUERIES)], "k": 5, "mode": "hybrid"}) for i in range(16)]
    answers = call(writer_app, *[request for pair in zip(writes + writes, searches) for request in pair])
    assert all(answer.status_code == 200 for answer in answers), [a.text for a in answers if a.status_code != 200]
    written = [answer.json()["seq"] for answer in answers if "seq" in answer.json()]
    assert sorted(written) == list(range(1, 17))  # every write logged once, each its own sequence number
    assert one(writer_app, "GET", "/ready").json()["index"]["count"] == BASE + 8


def test_an_instance_without_writes_refuses_them_and_a_writer_refuses_reloads(small_index, engine, writer_app):
    plain = create_app(settings_for(small_index), engine)
    refused = one(plain, "POST", "/passages", {"passages": [{"id": "a", "text": "t"}]})
    assert refused.status_code == 400 and "SEARCH_WRITES" in refused.json()["detail"]
    assert "/passages" not in one(plain, "GET", "/openapi.json").json()["paths"]
    assert "/passages" in one(writer_app, "GET", "/openapi.json").json()["paths"]
    reload = one(writer_app, "POST", "/admin/reload", {"index": "served"})
    assert reload.status_code == 400 and "changes only through them" in reload.json()["detail"]
    with pytest.raises(ValueError, match="exclude each other"):
        settings_for(small_index, writes=True, watch_index=True)


def test_compaction_folds_the_writes_into_a_generation_answering_alike_while_writes_go_on(writes, encoder):
    texts = demo_texts()
    writes.upsert([record(texts[i][0], texts[i][1], i) for i in range(BASE, BASE + 6)])
    writes.upsert([record(texts[0][0], texts[50][1] + " revised", 3)])
    writes.delete(ids=[texts[5][0]])
    before = {str(mode): [[(h.id, h.score) for h in writes.searcher.search(q, 10, exact=True, **mode)] for q in QUERIES]
              for mode in MODES}
    during = threading.Thread(target=lambda: [writes.upsert([{"id": f"during-{i}", "text": f"written during {i}"}])
                                              for i in range(3)])
    during.start()
    report = compact(writes)
    during.join()
    assert report.folded >= 3 and report.count == BASE + 6 - 1 + (report.folded - 3)
    index_dir = writes.searcher.index_dir
    manifest = read_manifest(index_dir, verify_checksums=True)
    assert manifest.write_sequence == report.folded and manifest.count == report.count
    assert [record.seq for record in read(log_path(index_dir))[0]] == list(range(report.folded + 1, 7))
    assert writes.seq == 6 and writes.searcher.count == BASE + 6 - 1 + 3
    assert all(writes.get(f"during-{i}") is not None for i in range(3))
    replica = Searcher(index_dir, encoder, CPU)  # what a replica following the folder loads
    assert replica.count == report.count
    for mode in MODES:
        writes.delete(ids=[f"during-{i}" for i in range(3)])  # the collection `before` searched
        got = [[(h.id, h.score) for h in writes.searcher.search(q, 10, exact=True, **mode)] for q in QUERIES]
        for old, new in zip(before[str(mode)], got):
            assert [pid for pid, _ in old] == [pid for pid, _ in new], mode
            np.testing.assert_allclose([s for _, s in old], [s for _, s in new], rtol=1e-5, atol=1e-6)
    assert manifest.candidates[0].kind == "int8"


def test_the_writer_holds_the_folder_and_a_reopened_writer_replays_only_what_compaction_left(writes, encoder):
    writes.upsert([{"id": "new-1", "text": "folded in"}])
    compact(writes)
    writes.upsert([{"id": "new-2", "text": "after the compaction"}])
    index_dir = writes.searcher.index_dir
    with ThreadPoolExecutor(1) as other:  # as another process would be: refused at once
        update = other.submit(apply_changes, ChangeOptions(index_dir, delete=DEMO / "queries.tsv"), lambda m: encoder)
        with pytest.raises(out_lock.InUse, match=f"in use by pid {os.getpid()} \\(another writer\\)"):
            update.result()
    writes.close()
    again = Writes.open(Searcher(index_dir, encoder, CPU))
    assert again.seq == 2 and again.searcher.segment.written == 1 and again.searcher.count == BASE + 2
    again.close()


def test_the_service_compacts_once_the_segment_is_full_and_a_replica_follows(tmp_path, base_index, encoder):
    index = Path(shutil.copytree(base_index, tmp_path / "served"))
    writer = create_app(settings_for(index, writes=True, compact_passages=4), SearchEngine(Searcher(index, encoder, CPU)))
    replica = create_app(settings_for(index), SearchEngine(Searcher(index, encoder, CPU)))
    runtime = writer.state.runtime
    first = one(writer, "GET", "/ready").json()["index"]["generation"]
    for i in range(4):
        assert one(writer, "POST", "/passages", {"passages": [{"id": f"n{i}", "text": f"passage {i}"}]}).status_code == 200
    runtime.compacting.result(timeout=300)
    ready = one(writer, "GET", "/ready").json()["index"]
    assert ready["generation"] != first and (ready["count"], ready["write_sequence"]) == (BASE + 4, 4)
    assert read_manifest(index).write_sequence == 4 and read(log_path(index))[0] == []
    reloaded = one(replica, "POST", "/admin/reload", {"index": "served"}).json()  # as its index watch would
    assert (reloaded["generation"], reloaded["count"]) == (ready["generation"], BASE + 4)
    runtime.writes.close()


def test_a_damaged_record_before_the_end_is_refused_not_dropped_with_what_follows(writes, encoder):
    for i in range(3):
        writes.upsert([{"id": f"new-{i}", "text": f"passage {i}"}])
    path = log_path(writes.searcher.index_dir)
    writes.close()
    data = bytearray(path.read_bytes())
    data[HEADER.size + 2] ^= 0xFF  # inside the first record's JSON
    path.write_bytes(bytes(data))
    with pytest.raises(LogCorrupt, match="the record at byte 0 does not match its checksum"):
        Writes.open(Searcher(writes.searcher.index_dir, encoder, CPU))
    assert path.read_bytes() == bytes(data)


def test_a_batch_whose_field_type_another_write_took_first_is_refused_under_the_lock(writes):
    checked = writes.check_upsert([{"id": "late", "text": "a passage", "venue": 3}])
    writes.upsert([{"id": "first", "text": "another passage", "venue": "a string"}])
    with pytest.raises(WriteError, match='field "venue" is a number here but a string') as error:
        writes.upsert(checked, np.zeros((1, 384), dtype=np.float32))
    assert error.value.path == ("passages", 0, "venue") and writes.get("late") is None and writes.seq == 1
