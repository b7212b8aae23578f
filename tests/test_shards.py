"""Sharded builds (`build --shard i/N` jobs, or `build --shards N` in one pass) and `merge`: merged shards
equal one unsharded build, row for row."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import faiss
import numpy as np
import pytest

from index_builder.build import BuildError, BuildOptions, build_index
from index_builder.cli import main as cli_main
from index_builder.merge import merge_shards
from retrieval.index_format import INDEX_FILE, MANIFEST_FILE, PASSAGES_FILE, manifest_digest, read_manifest
from retrieval.searcher import Searcher
from retrieval.sharding import Shard, check_shard_set, expand_shard_dirs, shard_folder
from retrieval.text_hashes import TEXT_HASHES_FILE
from tests.conftest import CPU, demo_corpus_head

LINES = 60
N = 3


def contents(directory: Path) -> tuple[np.ndarray, list[tuple]]:
    index = faiss.read_index(str(directory / INDEX_FILE))
    with sqlite3.connect(directory / PASSAGES_FILE) as connection:
        rows = connection.execute("SELECT row, id, text, line FROM passages ORDER BY row").fetchall()
    return index.reconstruct_n(0, index.ntotal), rows


def build_shards(corpus: Path, folder: Path, encoder, count: int, **options) -> list[Path]:
    shards = [folder / f"shard{i}of{count}" for i in range(count)]
    for i, out in enumerate(shards):
        build_index(BuildOptions(corpus, out, shard=Shard(i, count), **{"bm25": False, **options}), encoder)
    return shards


def merge_error(capsys, *args: str) -> str:
    """The one-line reason `merge` prints on stderr (after any progress bar) when it exits 2."""
    capsys.readouterr()  # drop what building the shards printed
    assert cli_main(["merge", *args]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    return errors[0]


@pytest.fixture(scope="module")
def demo_head(tmp_path_factory) -> Path:
    return demo_corpus_head(tmp_path_factory.mktemp("shards"), LINES)


@pytest.fixture(scope="module")
def unsharded(demo_head, encoder) -> Path:
    out = demo_head.parent / "unsharded"
    build_index(BuildOptions(demo_head, out, chunk_size=16, bm25=True), encoder)
    return out


@pytest.fixture(scope="module")
def shards(demo_head, encoder) -> list[Path]:
    return build_shards(demo_head, demo_head.parent, encoder, N, chunk_size=7, bm25=True)


def test_shard_i_keeps_records_i_i_plus_n_i_plus_2n(unsharded, shards):
    _, whole = contents(unsharded)
    for i, shard in enumerate(shards):
        vectors, rows = contents(shard)
        assert [row[1:] for row in rows] == [row[1:] for row in whole[i::N]]
        assert len(vectors) == len(rows) == LINES // N
        assert read_manifest(shard).shard == f"{i}/{N}"
    assert read_manifest(unsharded).shard is None


def test_merged_shards_equal_the_unsharded_build_row_for_row(unsharded, shards, tmp_path, encoder, capsys):
    out = tmp_path / "merged"
    assert cli_main(["merge", "--shards", *map(str, reversed(shards)), "--out", str(out)]) == 0
    summary = capsys.readouterr().out.strip()
    assert summary.startswith(f"merged {N} shards into {out}: {LINES} passages (0 bad lines skipped) in ")
    merged_vectors, merged_rows = contents(out)
    whole_vectors, whole_rows = contents(unsharded)
    assert merged_rows == whole_rows  # row, id, text and corpus line
    np.testing.assert_allclose(merged_vectors, whole_vectors, atol=1e-5)
    manifest, reference = read_manifest(out, verify_checksums=True), read_manifest(unsharded)
    assert manifest.shard is None and manifest.count == LINES
    assert (manifest.encoder, manifest.corpus) == (reference.encoder, reference.corpus)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [MANIFEST_FILE, INDEX_FILE, PASSAGES_FILE, TEXT_HASHES_FILE, "bm25"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]  # no work folder left behind
    merged, whole = Searcher(out, encoder, load=CPU), Searcher(unsharded, encoder, load=CPU)
    assert merged.search(whole_rows[41][2], k=1)[0].id == whole_rows[41][1]
    # BM25 is rebuilt over the merged passages: corpus-wide statistics, so equal to the unsharded one's
    query = "Return the absolute version of a path"
    assert merged.search(query, k=10, mode="bm25") == whole.search(query, k=10, mode="bm25")


def test_blank_lines_do_not_count_and_each_bad_line_is_skipped_by_one_shard(tmp_path, encoder):
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("id\ttext\na\tone\n\n\nb\ttwo\nbroken\n\nc\tthree\nd\tfour\n")
    whole = build_index(BuildOptions(corpus, tmp_path / "whole", skip_bad=True, bm25=False), encoder)
    shards = build_shards(corpus, tmp_path, encoder, 2, skip_bad=True)
    # records (header and blank lines aside): a, b, broken, c, d -> shard 0: a, broken, d; shard 1: b, c
    assert [[row[1] for row in contents(s)[1]] for s in shards] == [["a", "d"], ["b", "c"]]
    assert [read_manifest(s).corpus.skipped for s in shards] == [1, 0]
    report = merge_shards(shards, tmp_path / "merged")
    assert (report.passages, report.skipped) == (whole.passages, whole.skipped) == (4, 1)
    assert contents(tmp_path / "merged")[1] == contents(tmp_path / "whole")[1]


def test_an_interrupted_shard_build_resumes_with_the_same_share(tmp_path, encoder):
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("a\tone\nb\ttwo\nc\tthree\nd\tfour\ne\tfive\nf\n")  # f: no tab, and it falls to shard 1
    options = BuildOptions(corpus, tmp_path / "shard", chunk_size=1, shard=Shard(1, 2), bm25=False)
    with pytest.raises(BuildError, match="line 6"):
        build_index(options, encoder)
    corpus.write_text("a\tone\nb\ttwo\nc\tthree\nd\tfour\ne\tfive\nf\tsix\n")
    report = build_index(options, encoder)
    assert (report.resumed_chunks, report.encoded) == (2, 1)
    assert [row[1:] for row in contents(tmp_path / "shard")[1]] == [("b", "two", 2), ("d", "four", 4), ("f", "six", 6)]


def test_a_shard_with_no_records_is_an_empty_index_that_merges(tmp_path, encoder):
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("a\tone\nb\ttwo\n")
    shards = build_shards(corpus, tmp_path, encoder, 3)
    assert read_manifest(shards[2]).count == 0
    assert merge_shards(shards, tmp_path / "merged").passages == 2


def test_merge_refuses_a_missing_shard(shards, tmp_path, capsys):
    message = merge_error(capsys, "--shards", str(shards[0]), str(shards[2]), "--out", str(tmp_path / "m"))
    assert message == f"error: shard 1/{N} missing (given 2 of {N})"
    assert not (tmp_path / "m").exists() and list(tmp_path.iterdir()) == []


def test_merge_refuses_shards_of_different_n(shards, tmp_path, capsys, encoder, demo_head):
    other = tmp_path / "other"
    build_index(BuildOptions(demo_head, other, shard=Shard(1, 2), bm25=False), encoder)
    message = merge_error(capsys, "--shards", *map(str, shards), str(other), "--out", str(tmp_path / "m"))
    assert message == f"error: {other} is shard 1/2 but {shards[0]} is shard 0/{N}: N differs"


def test_merge_refuses_the_same_shard_twice(shards, tmp_path, capsys):
    message = merge_error(capsys, "--shards", *map(str, shards), str(shards[1]), "--out", str(tmp_path / "m"))
    assert message == f"error: {shards[1]} and {shards[1]} are both shard 1/{N}"


def test_merge_refuses_a_passage_id_in_two_shards_naming_both(tmp_path, encoder, capsys):
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("a\tone\nb\ttwo\nc\tthree\na\tagain\n")  # the second 'a' falls to shard 1
    shards = build_shards(corpus, tmp_path, encoder, 2)
    message = merge_error(capsys, "--shards", *map(str, shards), "--out", str(tmp_path / "m"))
    assert message == f"error: duplicate passage id 'a' in {shards[0]} (line 1) and {shards[1]} (line 4)"
    assert not (tmp_path / "m").exists() and not (tmp_path / ".m.merging").exists()


def test_merge_refuses_shards_of_another_encoder_naming_both_values(shards, tmp_path, capsys):
    changed = tmp_path / "changed"
    shutil.copytree(shards[2], changed)
    manifest = json.loads((shards[2] / MANIFEST_FILE).read_text())
    manifest["encoder"]["weights_sha256"] = "0" * 64
    manifest["manifest_sha256"] = manifest_digest(manifest)  # a sealed manifest: another encoder, not tampering
    (changed / MANIFEST_FILE).write_text(json.dumps(manifest))
    message = merge_error(capsys, "--shards", str(shards[0]), str(shards[1]), str(changed), "--out", str(tmp_path / "m"))
    expected = read_manifest(shards[0]).encoder.weights_sha256
    assert message == f"error: {changed}: encoder weights_sha256 '{'0' * 64}' differs from {shards[0]}'s '{expected}'"


def test_merge_refuses_shards_of_different_corpus_files(tmp_path, encoder, capsys):
    # The kept shards of a job array whose corpus was updated before the other jobs ran.
    old, new = tmp_path / "old.tsv", tmp_path / "new.tsv"
    old.write_text("a\tone\nb\ttwo\n")
    new.write_text("a\tone\nb\ttwo, revised\n")
    first = tmp_path / "shard0of2"
    build_index(BuildOptions(old, first, shard=Shard(0, 2), bm25=False), encoder)
    second = tmp_path / "shard1of2"
    build_index(BuildOptions(new, second, shard=Shard(1, 2), bm25=False), encoder)
    message = merge_error(capsys, "--shards", str(first), str(second), "--out", str(tmp_path / "m"))
    assert message == (f"error: {second}: corpus sha256 {read_manifest(second).corpus.sha256!r} differs from "
                       f"{first}'s {read_manifest(first).corpus.sha256!r}")


def test_merge_refuses_an_unsharded_index_and_an_existing_out(shards, unsharded, tmp_path, capsys):
    message = merge_error(capsys, "--shards", str(unsharded), "--out", str(tmp_path / "m"))
    assert message == (f"error: {unsharded}: not a shard "
                       "(its manifest names none; build shards with --shard i/N or --shards N)")
    message = merge_error(capsys, "--shards", *map(str, shards), "--out", str(shards[0]))
    assert message == f"error: {shards[0]} already exists; pass --overwrite to replace it"


@pytest.mark.parametrize("value", ["3/3", "-1/3", "1", "a/b", "1/2/3", "0/0"])
def test_build_refuses_a_malformed_shard(value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["build", "--corpus", "c.tsv", "--out", str(tmp_path / "o"), "--shard", value])
    assert exit_info.value.code == 2
    assert "--shard" in capsys.readouterr().err


def test_if_missing_keeps_an_existing_index_without_loading_a_model(unsharded, capsys):
    assert cli_main(["build", "--corpus", "no-such-file.tsv", "--out", str(unsharded), "--if-missing"]) == 0
    assert capsys.readouterr().out.strip() == f"kept {unsharded}: it already holds an index of {LINES} passages (--if-missing)"


# `build --shards N`: the corpus read and encoded once, every shard written at the end


@pytest.fixture(scope="module")
def one_pass(demo_head, encoder) -> Path:
    return build_index(BuildOptions(demo_head, demo_head.parent / "one-pass", chunk_size=16, bm25=True, shards=N),
                       encoder).out


def test_shards_n_writes_what_n_shard_i_of_n_jobs_write(one_pass, shards):
    assert sorted(p.name for p in one_pass.iterdir()) == [f"shard-{i}" for i in range(N)]  # no scratch left
    assert not (one_pass.parent / ".one-pass.partial").exists() and not (one_pass.parent / ".one-pass.shards").exists()
    for i, job in enumerate(shards):
        vectors, rows = contents(shard_folder(one_pass, i))
        job_vectors, job_rows = contents(job)
        assert rows == job_rows  # row, id, text and corpus line
        np.testing.assert_allclose(vectors, job_vectors, atol=1e-5)  # other batches: the last bits differ
        manifest, reference = read_manifest(shard_folder(one_pass, i), verify_checksums=True), read_manifest(job)
        assert (manifest.shard, manifest.count, manifest.corpus, manifest.encoder) == (
            reference.shard, reference.count, reference.corpus, reference.encoder)
        assert manifest.bm25 is not None and (shard_folder(one_pass, i) / "bm25").is_dir()
    check_shard_set([(str(shard_folder(one_pass, i)), read_manifest(shard_folder(one_pass, i))) for i in range(N)])


def test_shards_n_merge_back_into_the_unsharded_index(one_pass, unsharded, tmp_path):
    report = merge_shards([shard_folder(one_pass, i) for i in range(N)], tmp_path / "merged")
    assert (report.passages, report.skipped) == (LINES, 0)
    merged_vectors, merged_rows = contents(tmp_path / "merged")
    whole_vectors, whole_rows = contents(unsharded)
    assert merged_rows == whole_rows
    np.testing.assert_allclose(merged_vectors, whole_vectors, atol=1e-5)


def test_the_folder_of_a_shards_n_build_stands_for_its_shards(one_pass, unsharded, shards, tmp_path, capsys):
    assert expand_shard_dirs([one_pass]) == [shard_folder(one_pass, i) for i in range(N)]
    assert expand_shard_dirs([unsharded, *shards]) == [unsharded, *shards]  # index folders stay as given
    assert cli_main(["merge", "--shards", str(one_pass), "--out", str(tmp_path / "merged")]) == 0
    assert capsys.readouterr().out.startswith(f"merged {N} shards into {tmp_path / 'merged'}: {LINES} passages")


def test_shards_n_counts_bad_lines_in_their_shard_and_sees_duplicates_across_shards(tmp_path, encoder):
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("id\ttext\na\tone\n\n\nb\ttwo\nbroken\n\nc\tthree\nd\tfour\na\tagain\n")
    # records: a, b, broken, c, d, a (shard 0's id again) -> shard 0: a, broken, d; shard 1: b, c, duplicate a
    # (separate --shard 1/2 jobs would keep it, and `merge` would refuse their shards)
    report = build_index(BuildOptions(corpus, tmp_path / "out", skip_bad=True, chunk_size=2, shards=2, bm25=False), encoder)
    assert (report.passages, report.skipped, report.shards) == (4, 2, 2)
    assert report.summary().startswith(f"built {tmp_path / 'out'}: 4 passages in 2 shards ")
    folders = [shard_folder(tmp_path / "out", i) for i in range(2)]
    assert [[row[1:] for row in contents(f)[1]] for f in folders] == [
        [("a", "one", 2), ("d", "four", 9)], [("b", "two", 5), ("c", "three", 8)]]
    assert [read_manifest(f).corpus.skipped for f in folders] == [1, 1]
    assert [read_manifest(f).corpus.passages for f in folders] == [2, 2]


def test_an_interrupted_shards_n_build_resumes_without_losing_or_doubling_a_passage(tmp_path, encoder):
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("a\tone\nb\ttwo\nc\tthree\nd\tfour\ne\tfive\nf\n")  # f: no tab
    options = BuildOptions(corpus, tmp_path / "out", chunk_size=2, shards=2, bm25=False)
    with pytest.raises(BuildError, match="line 6"):
        build_index(options, encoder)
    corpus.write_text("a\tone\nb\ttwo\nc\tthree\nd\tfour\ne\tfive\nf\tsix\n")
    report = build_index(options, encoder)
    assert (report.resumed_chunks, report.encoded, report.passages) == (2, 2, 6)
    assert [[row[1] for row in contents(shard_folder(tmp_path / "out", i))[1]] for i in range(2)] == [
        ["a", "c", "e"], ["b", "d", "f"]]


def test_shards_n_with_if_missing_keeps_the_existing_shards(one_pass, capsys):
    args = ["build", "--corpus", "no-such-file.tsv", "--out", str(one_pass), "--shards", str(N), "--if-missing"]
    assert cli_main(args) == 0
    kept = f"kept {one_pass}: it already holds an index of {LINES} passages (--if-missing)"
    assert capsys.readouterr().out.strip() == kept


def test_if_missing_refuses_shards_of_another_n(one_pass, capsys):
    args = ["build", "--corpus", "c.tsv", "--out", str(one_pass), "--shards", str(N - 1), "--if-missing"]
    assert cli_main(args) == 2
    assert f"error: {one_pass} holds shards of another --shards N, not {N - 1}" in capsys.readouterr().err


def test_an_interrupted_shards_n_build_is_not_resumed_as_another_build_naming_what_differs(tmp_path, encoder):
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("a\tone\nb\ttwo\nc\n")  # c: no tab
    with pytest.raises(BuildError, match="line 3"):
        build_index(BuildOptions(corpus, tmp_path / "out", chunk_size=1, shards=2, bm25=False), encoder)
    with pytest.raises(BuildError, match="interrupted build with a different shards; rerun with --restart"):
        build_index(BuildOptions(corpus, tmp_path / "out", chunk_size=1, bm25=False), encoder)


@pytest.mark.parametrize("flags, reason", [
    (["--shards", "2", "--shard", "0/2"],
     "error: --shard i/N builds one shard, --shards N all of them: pass one of the two"),
    (["--shards", "0"], "--shards: must be at least 1, got 0"),
])
def test_build_refuses_contradictory_or_empty_shard_counts(flags, reason, tmp_path, capsys):
    try:
        code = cli_main(["build", "--corpus", "c.tsv", "--out", str(tmp_path / "o"), *flags])
    except SystemExit as exit_info:  # argparse's own refusal
        code = exit_info.code
    assert code == 2
    assert reason in capsys.readouterr().err
