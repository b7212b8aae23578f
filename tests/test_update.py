"""Incremental builds and replicas that follow: `build --update` and `update --add/--delete` equal a full build
of the corpus they define while encoding only what changed, a killed update leaves the old index whole and
resumes, and a service watching its index folder swaps to each new generation without a failed request."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import faiss
import httpx
import numpy as np
import pytest

from index_builder import cli
from index_builder.ann import AnnOptions
from index_builder.build import BuildError, BuildOptions, build_index
from index_builder.build_update import build_update
from index_builder.update import ChangeOptions, apply_changes
from retrieval import out_lock
from retrieval import index_writer
from retrieval.index_format import INDEX_FILE, MANIFEST_FILE, PASSAGES_FILE, read_manifest, sealed, write_json_atomic
from retrieval.searcher import Searcher
from retrieval.text_hashes import TEXT_HASHES_FILE, text_sha256
from service.engine.search_engine import SearchEngine
from tests.conftest import CPU, ROOT, killed_after_chunks
from tests.test_admission import serving, wait_until
from tests.test_format_upgrade import as_format_1

NOUNS = ["river", "lantern", "compiler", "meadow", "engine", "archive", "harbour", "violin", "glacier", "parser"]
VERBS = ["follows", "hides", "repairs", "measures", "paints", "sorts", "guards"]
PLACES = ["the old mill", "a quiet library", "the northern pass", "a busy market", "the server room"]
BASE = 36


def passage(number: int, variant: str = "") -> dict:
    """A short JSONL record (short texts keep the slow CPU encoder quick), with a metadata field."""
    noun, other = NOUNS[number % len(NOUNS)], NOUNS[(number * 3 + 1) % len(NOUNS)]
    text = f"note {number}{variant}: the {noun} {VERBS[number % len(VERBS)]} the {other} near {PLACES[number % 5]}"
    return {"id": f"p{number}", "title": f"entry {number}", "text": text, "topic": noun}


def write_corpus(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def contents(folder: Path) -> tuple[np.ndarray, list[tuple]]:
    """The index's vectors, and every column of its passage store but `line` (a diff's rows keep the line of
    the file each passage was read from), in row order."""
    index = faiss.read_index(str(folder / INDEX_FILE))
    with sqlite3.connect(folder / PASSAGES_FILE) as connection:
        cursor = connection.execute("SELECT * FROM passages ORDER BY row")
        names = [column[0] for column in cursor.description]
        rows = [tuple(value for name, value in zip(names, row) if name != "line") for row in cursor]
    return index.reconstruct_n(0, index.ntotal), rows


def vectors_by_id(folder: Path) -> dict[str, np.ndarray]:
    vectors, rows = contents(folder)
    return {row[1]: vectors[row[0]] for row in rows}


def assert_same_index(updated: Path, full: Path) -> None:
    """Same rows (ids, texts, fields, in order) and vectors within 1e-6: the full build encodes the passages
    in other batches, whose padding moves the last bits (about 1e-7 here)."""
    updated_vectors, updated_rows = contents(updated)
    full_vectors, full_rows = contents(full)
    assert updated_rows == full_rows
    np.testing.assert_allclose(updated_vectors, full_vectors, rtol=0, atol=1e-6)
    manifest = read_manifest(updated, verify_checksums=True)
    assert manifest.fields == read_manifest(full).fields == {"topic": "string"}
    assert np.array_equal(np.load(updated / TEXT_HASHES_FILE), text_sha256(row[2] for row in updated_rows))


@pytest.fixture(scope="module")
def base_corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("update") / "base.jsonl", [passage(i) for i in range(BASE)])


@pytest.fixture(scope="module")
def base_index(tmp_path_factory, base_corpus, encoder) -> Path:
    """The base corpus with BM25 and an int8 candidate structure, both to be rebuilt by every update."""
    out = tmp_path_factory.mktemp("update-index") / "base"
    build_index(BuildOptions(base_corpus, out, chunk_size=8, bm25=True, ann=[AnnOptions("int8", sample=10)]),
                encoder)
    return out


def copy_of(index: Path, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copytree(index, folder / "index"))


def edited_records() -> list[dict]:
    """The base corpus with 3 passages removed, 3 changed, 4 added, and the whole reordered."""
    records = [passage(i, " revised" if i in (4, 11, 20) else "") for i in range(BASE) if i not in (2, 7, 30)]
    records += [passage(i) for i in range(100, 104)]
    return records[1::2] + records[::2]


def test_an_update_equals_a_full_build_of_the_edited_corpus_and_encodes_only_what_changed(
        tmp_path, encoder, base_index, monkeypatch, capsys):
    index = copy_of(base_index, tmp_path)
    corpus = write_corpus(tmp_path / "edited.jsonl", edited_records())
    monkeypatch.setattr(cli, "BiEncoder", lambda *args, **kwargs: encoder)  # the session's: no second load
    assert cli.main(["build", "--corpus", str(corpus), "--out", str(index), "--update", "--chunk-size", "8",
                     "--device", "cpu"]) == 0
    summary = capsys.readouterr().out.splitlines()[0]
    assert summary.startswith(f"updated {index}: 37 passages; kept 30, encoded 7, dropped 3 in ")

    full = tmp_path / "full"
    build_index(BuildOptions(corpus, full, chunk_size=8, bm25=True, ann=[AnnOptions("int8", sample=10)]), encoder)
    assert_same_index(index, full)
    old, new = vectors_by_id(base_index), vectors_by_id(index)
    kept = [record["id"] for record in edited_records() if record == passage(int(record["id"][1:]))
            and int(record["id"][1:]) < BASE]
    assert len(kept) == 30 and all(np.array_equal(new[pid], old[pid]) for pid in kept)  # the stored bits
    manifest = read_manifest(index)
    assert manifest.bm25 is not None and manifest.corpus.sha256 == read_manifest(full).corpus.sha256
    [card] = manifest.candidates  # rebuilt with the old parameters, a new recall card over the new rows
    assert (card.kind, card.depth, card.sample) == ("int8", read_manifest(base_index).candidates[0].depth, 10)
    assert not any(path.name.startswith(".index.") for path in tmp_path.iterdir())  # no scratch left


def test_add_and_delete_give_the_full_build_of_the_corpus_their_order_defines(tmp_path, encoder, base_index):
    index = copy_of(base_index, tmp_path)
    added = [passage(5), passage(9, " revised"), passage(200), passage(201), passage(8, " again")]
    add = write_corpus(tmp_path / "add.jsonl", added)
    delete = tmp_path / "delete.txt"
    delete.write_text("p3\n\np12\nnot-there\np8\n")
    report = apply_changes(ChangeOptions(index, add, delete, chunk_size=2), lambda manifest: encoder)
    # p5 is given again unchanged (in place, its vector kept), p9 replaced in place, p8 deleted then added again
    # at the end.
    assert (report.passages, report.kept, report.encoded, report.dropped) == (BASE, BASE - 4, 4, 3)
    assert "2 replaced in place, 3 added at the end, 1 ids to delete not in the index" in report.summary()

    order = [passage(9, " revised") if i == 9 else passage(i) for i in range(BASE) if i not in (3, 8, 12)]
    expected = write_corpus(tmp_path / "expected.jsonl", [*order, passage(200), passage(201), passage(8, " again")])
    full = tmp_path / "full"
    build_index(BuildOptions(expected, full, chunk_size=8, bm25=True), encoder)
    assert_same_index(index, full)
    assert [record.kind for record in read_manifest(index).candidates] == ["int8"]
    assert not (tmp_path / ".index.adding").exists() and not (tmp_path / ".index.updating").exists()


def test_a_deletion_alone_loads_no_encoder_and_a_bad_diff_is_refused(tmp_path, base_index):
    index = copy_of(base_index, tmp_path)
    delete = tmp_path / "delete.txt"
    delete.write_text("p0\np1\n")

    def no_encoder(manifest):
        raise AssertionError("a deletion encodes nothing")

    report = apply_changes(ChangeOptions(index, delete=delete), no_encoder)
    assert (report.passages, report.encoded, report.dropped) == (BASE - 2, 0, 2)
    assert contents(index)[1][0][1] == "p2"
    with pytest.raises(BuildError, match="needs --add FILE, --delete IDS_FILE, or both"):
        apply_changes(ChangeOptions(index), no_encoder)
    everything = tmp_path / "everything.txt"
    everything.write_text("".join(f"p{i}\n" for i in range(BASE)))
    with pytest.raises(BuildError, match="would leave .* with no passages"):
        apply_changes(ChangeOptions(index, delete=everything), no_encoder)
    assert read_manifest(index, verify_checksums=True).count == BASE - 2


def test_a_format_1_index_without_content_hashes_is_updated_from_its_stored_texts_into_format_2(
        tmp_path, encoder, base_index, base_corpus):
    index = as_format_1(copy_of(base_index, tmp_path))
    report = build_update(BuildOptions(base_corpus, index, chunk_size=8), encoder)
    assert (report.kept, report.encoded, report.dropped) == (BASE, 0, 0)
    manifest = read_manifest(index, verify_checksums=True)
    assert manifest.format_version == 2 and TEXT_HASHES_FILE in manifest.files


class OtherPassageLimit:
    """The session's encoder claiming another passage token limit: an encoder whose vectors would differ."""

    def __init__(self, encoder) -> None:
        self.encoder, self.spec = encoder, replace(encoder.spec, passage_max_tokens=64)

    def __getattr__(self, name):
        return getattr(self.encoder, name)


def test_an_update_under_another_encoder_is_refused_with_exit_2(tmp_path, encoder, base_index, base_corpus,
                                                                monkeypatch, capsys):
    index = copy_of(base_index, tmp_path)
    monkeypatch.setattr(cli, "BiEncoder", lambda *args, **kwargs: OtherPassageLimit(encoder))
    assert cli.main(["build", "--corpus", str(base_corpus), "--out", str(index), "--update"]) == 2
    for argv in (["build", "--corpus", str(base_corpus), "--out", str(tmp_path / "none"), "--update"],
                 ["build", "--corpus", str(tmp_path / "missing.jsonl"), "--out", str(index), "--update"],
                 ["build", "--corpus", str(base_corpus), "--out", str(tmp_path), "--update"],
                 ["build", "--corpus", str(base_corpus), "--out", str(index), "--update", "--shards", "2"],
                 ["update", "--index", str(index)],
                 ["update", "--index", str(tmp_path / "none"), "--delete", str(base_corpus)]):
        assert cli.main(argv) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 7, errors
    assert "passage_max_tokens 256 here, 64 now" in errors[0] and "rebuild with --overwrite" in errors[0]
    assert "no index to update" in errors[1] and "corpus file not found" in errors[2]
    assert "not an index directory" in errors[3] and "drop --shard" in errors[4]
    assert "needs --add" in errors[5] and "no index to update" in errors[6]
    assert contents(index)[1] == contents(base_index)[1]


def test_a_killed_update_leaves_the_old_index_whole_and_serving_and_a_rerun_resumes(tmp_path, encoder, base_index):
    index = copy_of(base_index, tmp_path)
    before = (index / MANIFEST_FILE).read_bytes()
    records = [passage(i) for i in range(BASE)] + [passage(i) for i in range(300, 324)]  # 24 to encode
    corpus = write_corpus(tmp_path / "grown.jsonl", records)
    state = tmp_path / ".index.partial" / "state.json"
    done = killed_after_chunks(["build", "--corpus", str(corpus), "--out", str(index), "--update",
                                "--chunk-size", "2", "--device", "cpu"], state, BASE // 2 + 2)  # encoding now
    assert (index / MANIFEST_FILE).read_bytes() == before
    read_manifest(index, verify_checksums=True)
    hits = Searcher(index, encoder, load=CPU).search(passage(17)["title"] + " " + passage(17)["text"], k=1)
    assert hits[0].id == "p17"

    report = build_update(BuildOptions(corpus, index, chunk_size=2), encoder)
    assert report.resumed_chunks == done < len(records) // 2
    assert (report.passages, report.dropped) == (len(records), 0)
    assert report.encoded == len(records) - 2 * done  # only what the killed run had not committed
    vectors, rows = contents(index)
    assert [row[1] for row in rows] == [record["id"] for record in records]
    np.testing.assert_allclose(vectors[-3:], encoder.encode_passages([row[2] for row in rows[-3:]]), atol=1e-6)
    assert not (tmp_path / ".index.partial").exists()


def broken_generation(index: Path, folder: Path) -> Path:
    """A copy of `index` as a new generation (another build time) whose vectors' bytes were damaged on disk."""
    broken = Path(shutil.copytree(index, folder))
    manifest = read_manifest(broken)
    write_json_atomic(broken / MANIFEST_FILE, sealed(manifest.model_copy(update={"built_at": "2000-01-01T00:00:00"})))
    with (broken / INDEX_FILE).open("r+b") as handle:
        handle.seek(-64, 2)
        handle.write(bytes(64))
    return broken


def test_a_watching_service_swaps_to_each_new_generation_under_16_clients_without_a_failed_request(
        tmp_path, encoder, base_index):
    index = copy_of(base_index, tmp_path / "served")
    staged = copy_of(base_index, tmp_path / "staged")  # the next generation, made as a builder makes it
    new = passage(400)
    build_update(BuildOptions(write_corpus(tmp_path / "next.jsonl", [passage(i) for i in range(BASE)] + [new]),
                              staged, chunk_size=8), encoder)
    engine = SearchEngine(Searcher(index, encoder, load=CPU))
    query = new["title"] + " " + new["text"]
    statuses: list = []
    stop = threading.Event()

    def client(base: str) -> None:
        with httpx.Client(base_url=base, trust_env=False, timeout=60) as http:
            while not stop.is_set():
                try:
                    statuses.append(http.post("/search", json={"query": query, "k": 3}).status_code)
                except httpx.HTTPError as error:  # noqa: PERF203 - a failed request is what is counted
                    statuses.append(repr(error))

    with serving(index, engine, watch_index=True, watch_interval_s=0.1) as (app, base, _):
        clients = [threading.Thread(target=client, args=(base,)) for _ in range(16)]
        for thread in clients:
            thread.start()
        try:
            wait_until(lambda: len(statuses) >= 16, 60)
            with out_lock.hold(index, "build"):
                index_writer.move_into_place(staged, index)
            wait_until(lambda: httpx.get(f"{base}/ready", trust_env=False).json()["index"]["count"] == BASE + 1, 60)
            served = len(statuses)
            wait_until(lambda: len(statuses) >= served + 16, 60)
        finally:
            stop.set()
            for thread in clients:
                thread.join(60)
        assert len(statuses) > 32 and set(statuses) == {200}, [s for s in statuses if s != 200][:5]
        assert httpx.post(f"{base}/search", json={"query": query, "k": 1}, trust_env=False).json()[
            "results"][0]["id"] == "p400"
        ready = httpx.get(f"{base}/ready", trust_env=False).json()
        assert ready["detail"] is None

        # A broken generation: the old one keeps serving, and /ready says why.
        served_copy = Path(shutil.copytree(index, tmp_path / "served-again"))
        with out_lock.hold(index, "build"):
            index_writer.move_into_place(broken_generation(index, tmp_path / "broken"), index)
        wait_until(lambda: httpx.get(f"{base}/ready", trust_env=False).json()["detail"] is not None, 60)
        ready = httpx.get(f"{base}/ready", trust_env=False)
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        assert "the previous index keeps serving" in ready.json()["detail"]
        assert "index.faiss" in ready.json()["detail"] and "sha256" in ready.json()["detail"]
        assert ready.json()["index"]["count"] == BASE + 1
        answer = httpx.post(f"{base}/search", json={"query": query, "k": 1}, trust_env=False)
        assert answer.status_code == 200 and answer.json()["results"][0]["id"] == "p400"

        # The served generation put back over the broken one: nothing failed any more, and /ready says so.
        with out_lock.hold(index, "build"):
            index_writer.move_into_place(served_copy, index)
        wait_until(lambda: httpx.get(f"{base}/ready", trust_env=False).json()["detail"] is None, 60)


# Runs `python -m index_builder ARGS...` with a SIGKILL of its own at one point of the index writer: `when`
# ("before" or "after") a call of retrieval.index_writer's function `name`.
KILLED_AT = """
import os, signal, sys
from index_builder import cli
from retrieval import index_writer
name, when = sys.argv[1], sys.argv[2]
original = getattr(index_writer, name)
def killing(*args, **kwargs):
    if when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    result = original(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
setattr(index_writer, name, killing)
sys.exit(cli.main(sys.argv[3:]))
"""


@pytest.mark.parametrize("name, when", [
    ("write_vectors", "before"),  # the new generation's passages written, its vectors not yet
    ("write_manifest", "after"),  # the new generation finished in its work folder, not yet swapped in
    ("_exchange", "after"),  # swapped in, the old generation not yet removed
])
def test_an_update_killed_while_it_writes_or_swaps_leaves_a_whole_index_and_a_rerun_finishes_it(
        tmp_path, encoder, base_index, name, when):
    index = copy_of(base_index, tmp_path)
    old_ids = [pid for _, pid, *_ in contents(index)[1]]
    deletes = tmp_path / "delete.txt"
    deletes.write_text("p3\np5\n")
    update = ["update", "--index", str(index), "--delete", str(deletes)]
    killed = subprocess.run([sys.executable, "-c", KILLED_AT, name, when, *update], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    assert killed.returncode == -signal.SIGKILL
    read_manifest(index, verify_checksums=True)
    served = [hit.id for hit in Searcher(index, encoder, load=CPU).search(passage(17)["text"], k=BASE)]
    assert sorted(served) in (sorted(old_ids), sorted(set(old_ids) - {"p3", "p5"}))
    assert cli.main(update) == 0
    assert [pid for _, pid, *_ in contents(index)[1]] == [pid for pid in old_ids if pid not in ("p3", "p5")]
    read_manifest(index, verify_checksums=True)
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith(".")) == []


def test_an_update_add_killed_while_it_encodes_leaves_the_old_index_and_a_rerun_resumes(tmp_path, encoder, base_index):
    index = copy_of(base_index, tmp_path)
    before = (index / MANIFEST_FILE).read_bytes()
    add = write_corpus(tmp_path / "add.jsonl", [passage(i) for i in range(500, 524)])
    state = tmp_path / "..index.adding.partial" / "state.json"  # the --add build's work folder
    killed_after_chunks(["update", "--index", str(index), "--add", str(add), "--chunk-size", "2", "--device", "cpu"],
                        state, 2)
    assert (index / MANIFEST_FILE).read_bytes() == before
    read_manifest(index, verify_checksums=True)
    report = apply_changes(ChangeOptions(index, add=add, chunk_size=2), lambda manifest: encoder)
    assert report.encoded < 24 and report.passages == BASE + 24
    assert [pid for _, pid, *_ in contents(index)[1]][-24:] == [f"p{i}" for i in range(500, 524)]


@pytest.mark.parametrize("holder", ["update", "build"])
def test_an_update_while_another_update_or_a_build_holds_the_index_exits_2_and_changes_nothing(
        tmp_path, base_index, capsys, holder):
    index = copy_of(base_index, tmp_path)
    before = (index / MANIFEST_FILE).read_bytes()
    deletes = tmp_path / "delete.txt"
    deletes.write_text("p3\n")
    held, release = threading.Event(), threading.Event()

    def other() -> None:  # another thread: the lock is re-entrant within one
        with out_lock.hold(index, holder):
            held.set()
            release.wait(60)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert held.wait(60)
        assert cli.main(["update", "--index", str(index), "--delete", str(deletes)]) == 2
    finally:
        release.set()
        thread.join(60)
    assert f"{index} is in use by pid {os.getpid()} (another {holder})" in capsys.readouterr().err
    assert (index / MANIFEST_FILE).read_bytes() == before
