"""The index builder: what it writes, how it resumes, and how it refuses bad corpora."""

from __future__ import annotations

import hashlib
import os
import sqlite3
from pathlib import Path

import faiss
import numpy as np
import pytest

from index_builder.build import BuildError, BuildOptions, build_index
from index_builder.cli import main as cli_main
from retrieval import index_writer
from retrieval.index_format import INDEX_FILE, MANIFEST_FILE, PASSAGES_FILE, read_manifest
from retrieval.text_hashes import TEXT_HASHES_FILE
from tests.conftest import DEMO, SMALL_CORPUS_LINES, head, killed_after_chunks


def index_contents(directory: Path) -> tuple[np.ndarray, list[tuple]]:
    index = faiss.read_index(str(directory / INDEX_FILE))
    vectors = index.reconstruct_n(0, index.ntotal)
    with sqlite3.connect(directory / PASSAGES_FILE) as connection:
        rows = connection.execute("SELECT row, id, text, line FROM passages ORDER BY row").fetchall()
    return vectors, rows


def test_index_directory_holds_manifest_faiss_index_and_passages(small_index, encoder):
    manifest = read_manifest(small_index, verify_checksums=True)
    assert manifest.count == SMALL_CORPUS_LINES
    assert manifest.dimension == encoder.dimension == 384
    assert manifest.similarity == "cosine"  # MiniLM's modules.json declares Normalize
    assert manifest.encoder.weights_sha256 == encoder.spec.weights_sha256
    assert sorted(os.listdir(small_index)) == sorted(
        [MANIFEST_FILE, INDEX_FILE, PASSAGES_FILE, TEXT_HASHES_FILE, "bm25"])
    assert manifest.bm25 is not None and manifest.bm25.library.startswith("bm25s")
    assert {name for name in manifest.files if name.startswith("bm25/")} == {
        f"bm25/{name}" for name in os.listdir(small_index / "bm25")}
    vectors, rows = index_contents(small_index)
    assert [row[0] for row in rows] == list(range(SMALL_CORPUS_LINES))
    assert rows[0][1] == head(DEMO / "corpus.tsv", 1).split("\t")[0]
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_index_rows_are_the_encoder_embeddings_of_the_passages(small_index, encoder):
    vectors, rows = index_contents(small_index)
    sample = [0, 57, 299]
    expected = encoder.encode_passages([rows[i][2] for i in sample])
    np.testing.assert_allclose(vectors[sample], expected, atol=1e-5)


def test_interrupted_build_resumes_to_the_same_index(tmp_path, encoder):
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text(head(DEMO / "corpus.tsv", 200), encoding="utf-8")
    reference = tmp_path / "reference"
    build_index(BuildOptions(corpus, reference, chunk_size=20, bm25=False), encoder)

    out = tmp_path / "resumed"
    state = tmp_path / ".resumed.partial" / "state.json"
    done = killed_after_chunks(["build", "--corpus", str(corpus), "--out", str(out), "--chunk-size", "20",
                                "--device", "cpu"], state, 3)
    assert not out.exists()
    assert 3 <= done < 10

    report = build_index(BuildOptions(corpus, out, chunk_size=20, bm25=False), encoder)
    assert report.resumed_chunks == done
    assert report.encoded == 200 - 20 * done
    resumed_vectors, resumed_rows = index_contents(out)
    reference_vectors, reference_rows = index_contents(reference)
    assert resumed_rows == reference_rows
    np.testing.assert_array_equal(resumed_vectors, reference_vectors)
    assert not (tmp_path / ".resumed.partial").exists()
    # The resumed build hashed the prefix it had read before and the rest: the whole file.
    assert read_manifest(out).corpus.sha256 == read_manifest(reference).corpus.sha256 == \
        hashlib.sha256(corpus.read_bytes()).hexdigest()


def test_resume_refuses_a_corpus_changed_before_the_resume_point(tmp_path, encoder):
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("a\tfirst passage\nb\tsecond passage\nc\tthird\na\tagain\n")
    with pytest.raises(BuildError, match="duplicate"):  # stops after chunk 1 (lines 1-2) is stored
        build_index(BuildOptions(corpus, tmp_path / "out", chunk_size=2, bm25=False), encoder)
    corpus.write_text("a\tFIRST passage\nb\tsecond passage\nc\tthird\n")
    with pytest.raises(BuildError, match="changed since the interrupted build"):
        build_index(BuildOptions(corpus, tmp_path / "out", chunk_size=2, bm25=False), encoder)
    report = build_index(BuildOptions(corpus, tmp_path / "out", chunk_size=2, restart=True, bm25=False), encoder)
    assert report.passages == 3


def test_fixing_a_bad_line_lets_the_build_resume_where_it_stopped(tmp_path, encoder):
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("a\tone\nb\ttwo\nc\tthree\nd\n")
    with pytest.raises(BuildError, match="line 4"):
        build_index(BuildOptions(corpus, tmp_path / "out", chunk_size=2, bm25=False), encoder)
    corpus.write_text("a\tone\nb\ttwo\nc\tthree\nd\tfour\n")
    report = build_index(BuildOptions(corpus, tmp_path / "out", chunk_size=2, bm25=False), encoder)
    assert (report.passages, report.resumed_chunks, report.encoded) == (4, 1, 2)


def test_turning_skip_bad_on_resumes_where_a_bad_line_stopped_the_build(tmp_path, encoder):
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("a\tone\nb\ttwo\nc\tthree\nd\n")
    with pytest.raises(BuildError, match=r"line 4: .*\(use --skip-bad to skip such lines\)"):
        build_index(BuildOptions(corpus, tmp_path / "out", chunk_size=2, bm25=False), encoder)
    report = build_index(BuildOptions(corpus, tmp_path / "out", chunk_size=2, skip_bad=True, bm25=False), encoder)
    assert (report.passages, report.skipped, report.resumed_chunks, report.encoded) == (3, 1, 1, 1)


BAD_CORPORA = {
    "no_tab.tsv": ("a\tfine\nno tab here\n", "line 2: expected id<TAB>text"),
    "empty_text.tsv": ("a\tfine\nb\t   \n", "line 2: empty text for id 'b'"),
    "duplicate.tsv": ("a\tfine\nb\tok\na\tagain\n", "line 3: duplicate id 'a' (first on line 1)"),
    "bad.jsonl": ('{"id": "a", "text": "fine"}\n{"id": "b", "text": \n', "line 2: not valid JSON"),
    "no_id.jsonl": ('{"text": "fine"}\n', 'line 1: missing "id"'),
}


@pytest.mark.parametrize("name", sorted(BAD_CORPORA))
def test_bad_corpus_line_is_refused_with_its_line_number(tmp_path, encoder, name):
    content, message = BAD_CORPORA[name]
    corpus = tmp_path / name
    corpus.write_text(content)
    with pytest.raises(BuildError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_index(BuildOptions(corpus, tmp_path / "out", bm25=False), encoder)
    assert not (tmp_path / "out").exists()


def test_skip_bad_counts_and_skips_bad_lines(tmp_path, encoder):
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("a\tone\nbroken\nb\ttwo\na\tdup\n\nc\tthree\n")
    report = build_index(BuildOptions(corpus, tmp_path / "out", skip_bad=True, bm25=False), encoder)
    assert (report.passages, report.skipped) == (3, 2)
    manifest = read_manifest(tmp_path / "out")
    assert (manifest.count, manifest.corpus.skipped) == (3, 2)
    _, rows = index_contents(tmp_path / "out")
    assert [(r[1], r[2], r[3]) for r in rows] == [("a", "one", 1), ("b", "two", 3), ("c", "three", 6)]


def test_beir_jsonl_title_and_text_are_indexed_together(tmp_path, encoder):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"_id": "d1", "title": "Wings", "text": "lift at high speed"}\n{"_id": 7, "text": "x"}\n')
    build_index(BuildOptions(corpus, tmp_path / "out", bm25=False), encoder)
    _, rows = index_contents(tmp_path / "out")
    assert [(r[1], r[2]) for r in rows] == [("d1", "Wings lift at high speed"), ("7", "x")]


def test_existing_output_is_kept_unless_overwrite_and_then_replaced_whole(tmp_path, encoder):
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("a\tone\n")
    out = tmp_path / "out"
    build_index(BuildOptions(corpus, out, bm25=False), encoder)
    corpus.write_text("a\tone\nb\ttwo\n")
    with pytest.raises(BuildError, match="already exists"):
        build_index(BuildOptions(corpus, out, bm25=False), encoder)
    assert read_manifest(out).count == 1
    build_index(BuildOptions(corpus, out, overwrite=True, bm25=False), encoder)
    assert read_manifest(out, verify_checksums=True).count == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.tsv", "out"]


def test_cli_exits_2_with_a_one_line_reason(tmp_path, capsys):
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("a\tone\nb\n")
    assert cli_main(["build", "--corpus", str(tmp_path / "missing.tsv"), "--out", str(tmp_path / "o")]) == 2
    assert cli_main(["build", "--corpus", str(corpus), "--out", str(tmp_path / "o"), "--device", "cpu"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors[0] == f"error: {tmp_path / 'missing.tsv'}: corpus file not found"
    assert errors[-1].startswith(f"error: {corpus}: line 2: expected id<TAB>text")


def test_cli_usage_errors_exit_2():
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["build", "--corpus", "x.tsv"])
    assert exit_info.value.code == 2


def test_overwrite_replaces_an_index_but_never_a_folder_that_is_not_one(tmp_path, capsys):
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("a\tone\n")
    data = tmp_path / "data"  # a mistyped --out: the folder holding the corpus itself
    data.mkdir()
    (data / "corpus.tsv").write_text("a\tone\n")
    assert cli_main(["build", "--corpus", str(corpus), "--out", str(data), "--overwrite", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {data} is not an index (no manifest.json) and --overwrite replaces only an index; choose another --out")
    assert sorted(p.name for p in data.iterdir()) == ["corpus.tsv"]


def test_an_out_that_is_a_symbolic_link_is_refused_before_any_work(tmp_path, encoder, capsys):
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("a\tone\n")
    build_index(BuildOptions(corpus, tmp_path / "v1", bm25=False), encoder)
    (tmp_path / "current").symlink_to(tmp_path / "v1")
    args = ["build", "--corpus", str(corpus), "--out", str(tmp_path / "current"), "--overwrite", "--device", "cpu"]
    assert cli_main(args) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'current'} is a symbolic link; give the folder it points to ({tmp_path / 'v1'})")
    assert (tmp_path / "current").resolve() == tmp_path / "v1" and read_manifest(tmp_path / "v1").count == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.tsv", "current", "v1"]


def test_a_vectors_file_that_cannot_be_written_whole_is_an_os_error_not_a_sealed_index(tmp_path, monkeypatch):
    vectors = np.eye(4, 8, dtype=np.float32)
    with pytest.raises(OSError, match="missing/index.faiss.tmp"):  # FAISS's own failure, as the CLI's exit 2
        index_writer.write_vectors(tmp_path / "missing", [vectors], 8)
    real_write = index_writer.faiss.write_index

    def short_write(index, path, *flags):  # what FAISS leaves when its last flush fails (it only prints that)
        real_write(index, path, *flags)
        if isinstance(path, str):  # not the in-memory writers FAISS's own serialize_index passes
            os.truncate(path, os.path.getsize(path) - 16)

    monkeypatch.setattr(index_writer.faiss, "write_index", short_write)
    with pytest.raises(OSError, match=r"bytes written of \d+ \(is the disk full\?\)"):
        index_writer.write_vectors(tmp_path, [vectors], 8)
    assert not (tmp_path / INDEX_FILE).exists()
    monkeypatch.undo()
    assert index_writer.write_vectors(tmp_path, [vectors], 8) == 4
    assert faiss.read_index(str(tmp_path / INDEX_FILE)).ntotal == 4
