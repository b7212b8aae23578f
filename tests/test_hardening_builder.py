"""The builder against a hostile corpus and a careless operator: each case here was seen failing (11.8 GB
for one long line, a silently mixed index, raw SQLite errors, a misleading "not found") before it was mended."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from index_builder.build import BuildError, BuildOptions, build_index
from index_builder.cli import main as cli_main
from retrieval import out_lock
from retrieval.corpus import READ_BLOCK, BadLine, Passage, read_corpus
from retrieval.index_format import read_manifest
from retrieval.passage_store import PassageStore
from tests.conftest import DEMO, ROOT, head

LIMIT = 4096  # a small --max-passage-bytes, so that a long line stays cheap to write


def demo_lines(count: int) -> list[str]:
    return head(DEMO / "corpus.tsv", count).splitlines(keepends=True)


def corpus_with(path: Path, lines: list[str], long_line: str, at: int) -> Path:
    """`lines` with `long_line` put in as line `at` (1-based)."""
    path.write_text("".join(lines[: at - 1]) + long_line + "".join(lines[at - 1 :]), encoding="utf-8")
    return path


def stored_ids(out: Path, count: int) -> list[str]:
    return [pid for pid, _ in PassageStore(out / "passages.sqlite").get(range(count))]


def last_error(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


# 1. A passage's size is limited, and a longer line is never held in memory.

@pytest.mark.parametrize("end", [b"\n", b"\r\n"])
def test_a_line_of_exactly_max_passage_bytes_is_read_and_one_byte_more_is_a_bad_line(end):
    at_limit = b"a\t" + b"x" * (LIMIT - 2)
    data = at_limit + end + at_limit + b"y" + end + b"b\tshort" + end
    records = list(read_corpus(io.BytesIO(data), "tsv", max_bytes=LIMIT))
    assert [record for record, _ in records] == [
        Passage("a", "x" * (LIMIT - 2), 1),
        BadLine(2, f"{LIMIT + 1} bytes, over the limit of {LIMIT} bytes a passage's line may have "
                   "(--max-passage-bytes)"),
        Passage("b", "short", 3),
    ]
    assert [size for _, size in records] == [LIMIT + len(end), LIMIT + 1 + len(end), 7 + len(end)]


class ReadsRecorded(io.BytesIO):
    """A binary corpus handle that remembers the longest piece any one read returned."""

    longest = 0

    def readline(self, size=-1):
        line = super().readline(size)
        self.longest = max(self.longest, len(line))
        return line


def test_the_reader_reads_past_a_long_line_in_bounded_pieces_and_hashes_every_byte_it_read():
    data = b"a\tfirst\n" + b"big\t" + b"z" * (5 * READ_BLOCK) + b"\n" + b"c\tlast line, no newline at the end"
    handle, digest = ReadsRecorded(data), hashlib.sha256()
    records = list(read_corpus(handle, "tsv", max_bytes=LIMIT, digest=digest))
    assert [(type(record).__name__, record.line) for record, _ in records] == [
        ("Passage", 1), ("BadLine", 2), ("Passage", 3)]
    assert handle.longest <= max(LIMIT + 2, READ_BLOCK)  # never the whole line of 5 blocks
    assert sum(size for _, size in records) == len(data)  # so a resume's byte offsets stay exact
    assert digest.hexdigest() == hashlib.sha256(data).hexdigest()


def test_a_passage_over_the_size_limit_exits_2_naming_its_line_the_limit_and_the_flag(tmp_path, capsys):
    long_line = "big\t" + "word " * 10_000 + "\n"
    corpus = corpus_with(tmp_path / "corpus.tsv", demo_lines(10), long_line, at=4)
    code = cli_main(["build", "--corpus", str(corpus), "--out", str(tmp_path / "out"), "--device", "cpu",
                     "--max-passage-bytes", str(LIMIT)])
    assert code == 2
    assert last_error(capsys) == (
        f"error: {corpus}: line 4: {len(long_line) - 1} bytes, over the limit of {LIMIT} bytes a passage's line "
        "may have (--max-passage-bytes) (use --skip-bad to skip such lines)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, long_line", [
    ("corpus.tsv", "big\t" + "word " * 10_000 + "\n"),
    ("corpus.jsonl", json.dumps({"_id": "big", "title": "long", "text": "word " * 10_000}) + "\n"),  # BEIR's form
])
def test_with_skip_bad_a_passage_over_the_size_limit_is_skipped_and_counted(tmp_path, encoder, name, long_line):
    lines = demo_lines(6)
    if name.endswith(".jsonl"):
        lines = [json.dumps(dict(zip(("_id", "text"), line.rstrip("\n").split("\t", 1)))) + "\n" for line in lines]
    corpus = corpus_with(tmp_path / name, lines, long_line, at=3)
    out = tmp_path / "out"
    report = build_index(BuildOptions(corpus, out, skip_bad=True, max_passage_bytes=LIMIT, bm25=False), encoder)
    assert (report.passages, report.skipped) == (6, 1)
    manifest = read_manifest(out, verify_checksums=True)
    assert (manifest.count, manifest.corpus.skipped) == (6, 1)
    assert "big" not in stored_ids(out, 6)
    # The skipped bytes were read and hashed all the same: the record is of the whole file.
    assert manifest.corpus.sha256 == hashlib.sha256(corpus.read_bytes()).hexdigest()


def test_raising_max_passage_bytes_resumes_the_build_a_long_line_stopped(tmp_path, encoder):
    long_line = "big\t" + "word " * 1_000 + "\n"
    corpus = corpus_with(tmp_path / "corpus.tsv", demo_lines(8), long_line, at=6)
    out = tmp_path / "out"
    with pytest.raises(BuildError, match=f"line 6: {len(long_line) - 1} bytes, over the limit of {LIMIT}"):
        build_index(BuildOptions(corpus, out, chunk_size=2, max_passage_bytes=LIMIT, bm25=False), encoder)
    with pytest.raises(BuildError, match="different max_passage_bytes; rerun with --restart"):
        build_index(BuildOptions(corpus, out, chunk_size=2, max_passage_bytes=LIMIT // 2, bm25=False), encoder)  # lowered: no
    report = build_index(BuildOptions(corpus, out, chunk_size=2, max_passage_bytes=8 * LIMIT, bm25=False), encoder)
    assert (report.passages, report.resumed_chunks, report.encoded) == (9, 2, 5)


PEAK_OF_BUILDS = """
import resource, sys
from pathlib import Path
from index_builder.build import BuildOptions, build_index
from models.encoder import BiEncoder

encoder = BiEncoder(device="cpu")
for number, corpus in enumerate(sys.argv[1:]):
    build_index(BuildOptions(Path(corpus), Path(corpus).with_suffix(f".index{number}"), skip_bad=True, bm25=False), encoder)
    print("peak MiB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, flush=True)
"""


def test_a_30_mb_line_is_skipped_in_bounded_memory_at_the_default_limit(tmp_path):
    """One process with one encoder builds two passages twice (the second build reaches the steady peak
    of a build), then the same two with a 30 MiB line between them: its peak RSS stays within half the
    line's size of that. Holding the line would take twice its size (bytes and text), tokenizing it
    gigabytes (4.5 GiB more before the limit)."""
    line_bytes = 30 << 20  # 30 times the default limit
    lines = demo_lines(2)  # few passages: encoding them moves the peak by little, so the bound can be tight
    plain = tmp_path / "plain.tsv"
    plain.write_text("".join(lines), encoding="utf-8")
    long = corpus_with(tmp_path / "long.tsv", lines, "huge\t" + "word " * (line_bytes // 5) + "\n", at=2)
    result = subprocess.run([sys.executable, "-c", PEAK_OF_BUILDS, str(plain), str(plain), str(long)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    _, steady, with_long_line = [int(line.split()[-1]) for line in result.stdout.splitlines()
                                 if line.startswith("peak MiB")]
    assert with_long_line - steady < (line_bytes >> 20) // 2, (steady, with_long_line)
    assert read_manifest(long.with_suffix(".index2")).corpus.skipped == 1


# 2. A corpus changed while a build reads it gives no index.

class RewritesCorpusAfterFirstChunk:
    """The real encoder, with `rewrite` run once the first chunk is encoded: someone editing the corpus
    in the middle of a build (the only thing this wrapper adds)."""

    def __init__(self, encoder, rewrite) -> None:
        self.encoder, self.rewrite, self.chunks = encoder, rewrite, 0

    def __getattr__(self, name):
        return getattr(self.encoder, name)

    def encode_passages(self, passages, progress=None):
        vectors = self.encoder.encode_passages(passages, progress)
        self.chunks += 1
        if self.chunks == 1:
            self.rewrite()
        return vectors


def test_a_corpus_appended_to_during_the_build_gives_no_index_and_a_rerun_resumes_to_the_whole_file(
        tmp_path, encoder):
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("".join(demo_lines(12)), encoding="utf-8")

    def append():
        with corpus.open("a", encoding="utf-8") as handle:
            handle.write("".join(demo_lines(16)[12:]))

    out = tmp_path / "out"
    partial = tmp_path / ".out.partial"
    with pytest.raises(BuildError, match=rf"^corpus {re.escape(str(corpus))} changed during the build \(its size "
                                         rf"went from \d+ to \d+ bytes\), so no index was written; rebuild: the "
                                         rf"partial build in {re.escape(str(partial))} is kept"):
        build_index(BuildOptions(corpus, out, chunk_size=4, bm25=False), RewritesCorpusAfterFirstChunk(encoder, append))
    assert not out.exists()
    assert json.loads((partial / "state.json").read_text())["chunks"]

    report = build_index(BuildOptions(corpus, out, chunk_size=4, bm25=False), encoder)
    assert report.resumed_chunks >= 1 and report.passages == 16
    manifest = read_manifest(out, verify_checksums=True)
    assert manifest.count == 16
    assert manifest.corpus.sha256 == hashlib.sha256(corpus.read_bytes()).hexdigest()


def test_a_corpus_rewritten_in_place_with_its_size_and_time_kept_is_caught_by_its_sha256(tmp_path, encoder):
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("".join(demo_lines(12)), encoding="utf-8")
    before = corpus.stat()

    def rewrite_first_line():  # the same length, and the modification time put back
        with corpus.open("r+b") as handle:
            first = handle.readline()
            handle.seek(0)
            handle.write(first.upper())
        os.utime(corpus, ns=(before.st_atime_ns, before.st_mtime_ns))

    out = tmp_path / "out"
    with pytest.raises(BuildError, match=r"changed during the build \(its bytes differ from those read: "
                                         r"another sha256\)"):
        build_index(BuildOptions(corpus, out, chunk_size=4, bm25=False),
                    RewritesCorpusAfterFirstChunk(encoder, rewrite_first_line))
    assert not out.exists() and (tmp_path / ".out.partial").is_dir()
    with pytest.raises(BuildError, match="changed since the interrupted build"):  # its first chunk read other bytes
        build_index(BuildOptions(corpus, out, chunk_size=4, bm25=False), encoder)
    build_index(BuildOptions(corpus, out, chunk_size=4, restart=True, bm25=False), encoder)
    assert read_manifest(out).corpus.sha256 == hashlib.sha256(corpus.read_bytes()).hexdigest()


# 3. One --out, one writer.

def wait_for(condition, what: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_second_build_into_an_out_being_built_exits_2_naming_the_first_builds_pid(tmp_path, encoder, capsys):
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("".join(demo_lines(30)), encoding="utf-8")
    out = tmp_path / "out"
    first = subprocess.Popen(
        [sys.executable, "-m", "index_builder", "build", "--corpus", str(corpus), "--out", str(out),
         "--chunk-size", "2", "--device", "cpu"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        lock = out_lock.lock_file(out)
        # The CLI takes the lock before it loads its model: seconds before the build ends.
        wait_for(lambda: lock.is_file() and lock.read_text() == f"{first.pid} build\n", "the first build's lock")
        assert cli_main(["build", "--corpus", str(corpus), "--out", str(out), "--device", "cpu"]) == 2
        assert last_error(capsys) == (
            f"error: {out} is in use by pid {first.pid} (another build); wait for it to end, or give another --out")
        with pytest.raises(out_lock.InUse, match=f"in use by pid {first.pid}"):
            build_index(BuildOptions(corpus, out, overwrite=True, restart=True, bm25=False), encoder)
        _, errors = first.communicate(timeout=300)
    finally:
        first.kill()
        first.wait()
    assert first.returncode == 0, errors[-2000:]
    assert read_manifest(out, verify_checksums=True).count == 30
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus.tsv", "out"]  # no lock file left


HOLD_THE_LOCK = """
import sys, time
from pathlib import Path
from retrieval import out_lock

with out_lock.hold(Path(sys.argv[1]), "build"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_merge_into_an_out_in_use_exits_2_and_a_killed_holder_leaves_the_out_free(tmp_path, encoder, capsys):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        shards = [tmp_path / "shard-a", tmp_path / "shard-b"]
        assert cli_main(["merge", "--shards", *map(str, shards), "--out", str(out)]) == 2
        assert last_error(capsys) == (
            f"error: {out} is in use by pid {holder.pid} (another build); wait for it to end, or give another --out")
    finally:
        holder.send_signal(signal.SIGKILL)  # as a crash would: the kernel drops its lock, its file stays
        holder.wait()
    assert out_lock.lock_file(out).is_file()
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("".join(demo_lines(3)), encoding="utf-8")
    assert build_index(BuildOptions(corpus, out, bm25=False), encoder).passages == 3
    assert not out_lock.lock_file(out).exists()


# 4. A corpus that is not a regular file is named for what it is.

def test_a_directory_given_as_the_corpus_exits_2_saying_it_is_a_directory(tmp_path, encoder, capsys):
    folder = tmp_path / "corpus"
    folder.mkdir()
    assert cli_main(["build", "--corpus", str(folder), "--out", str(tmp_path / "out")]) == 2
    assert last_error(capsys) == f"error: corpus {folder} is a directory, not a file"
    with pytest.raises(BuildError, match="is a directory, not a file"):
        build_index(BuildOptions(folder, tmp_path / "out", bm25=False), encoder)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus"]


def test_a_fifo_given_as_the_corpus_exits_2_at_once_saying_what_it_is(tmp_path, encoder, capsys):
    fifo = tmp_path / "corpus.tsv"
    os.mkfifo(fifo)
    # Were the build to open the FIFO, it would wait for a writer for ever: this one closes at once.
    writer = threading.Thread(target=lambda: open(fifo, "wb").close(), daemon=True)
    writer.start()
    try:
        assert cli_main(["build", "--corpus", str(fifo), "--out", str(tmp_path / "out")]) == 2
        assert last_error(capsys) == f"error: corpus {fifo} is not a regular file (a FIFO)"
        with pytest.raises(BuildError, match=r"is not a regular file \(a FIFO\)"):
            build_index(BuildOptions(fifo, tmp_path / "out", bm25=False), encoder)
    finally:
        while writer.is_alive():  # nothing read the FIFO: let the writer's open return
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
            writer.join(0.1)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus.tsv"]
