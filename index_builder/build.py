"""Build an index directory from a passage collection, resumably and atomically.

The work happens in a sibling folder `.NAME.partial/`, chunk by chunk: each
chunk's embeddings are saved (`chunks/NNNNNN.npy`), its passages committed to
SQLite, and only then is `state.json` rewritten to count it. An interrupted
build therefore restarts after its last counted chunk, seeking straight to the
byte where that chunk ended, and no passage is lost or stored twice. The
finished folder is renamed into place, so `--out` is either the old index or
the new one, never half of one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator, Protocol, Sequence

import numpy as np
from tqdm import tqdm

from index_builder.shard import Shard
from models.checkpoint import read_json
from models.encoder import EncoderSpec
from retrieval import index_writer
from retrieval.corpus import BadLine, CorpusFormat, Passage, detect_format, read_corpus
from retrieval.index_format import CorpusRecord, EncoderRecord, write_json_atomic

STATE_FILE = "state.json"
CHUNKS_DIR = "chunks"  # STATE_FILE and CHUNKS_DIR are a build's scratch, dropped once the index is in place
SHOWN_BAD_LINES = 5


class PassageEncoder(Protocol):
    """What a build asks of its encoder (`models.encoder.BiEncoder` has it all)."""

    spec: EncoderSpec
    source: str | None  # the model folder an index records, None for the packaged default
    backend: str
    export_sha256: str | None

    @property
    def dimension(self) -> int: ...

    def encode_passages(self, passages: Sequence[str], progress: tqdm | None = None) -> np.ndarray:
        """(len(passages), dimension) float32 rows in the order given; `progress` advances as they are done."""
        ...


class BuildError(Exception):
    """Bad input or a conflicting earlier build; the CLI exits 2 with this message."""


@dataclass
class BuildOptions:
    corpus: Path
    out: Path
    chunk_size: int = 2048
    skip_bad: bool = False
    overwrite: bool = False
    restart: bool = False
    bm25: bool = False  # also build a BM25 index over the same passages
    shard: Shard | None = None  # keep only this shard's records (see index_builder.shard)


@dataclass
class BuildReport:
    out: Path
    passages: int
    skipped: int
    encoded: int  # passages encoded by this run (fewer than `passages` after a resume)
    seconds: float
    resumed_chunks: int

    @property
    def passages_per_second(self) -> float:
        return self.encoded / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        resumed = f", resumed after {self.resumed_chunks} chunks" if self.resumed_chunks else ""
        return (
            f"built {self.out}: {self.passages} passages ({self.skipped} bad lines skipped{resumed}); "
            f"encoded {self.encoded} in {self.seconds:.1f} s = {self.passages_per_second:.1f} passages/s"
        )


@dataclass
class _Chunk:
    passages: list[Passage]
    bad: list[BadLine]
    end_offset: int  # byte just past the chunk's last line
    end_line: int
    sha256: str  # of the corpus bytes [0, end_offset)
    records: int  # corpus records (passages and bad lines) in [0, end_offset): where --shard resumes counting


@dataclass
class _State:
    """What `state.json` holds: the build's identity and its finished chunks."""

    identity: dict
    chunks: list[dict] = field(default_factory=list)  # each: end_offset, end_line, rows, skipped, sha256

    @property
    def rows(self) -> int:
        return sum(chunk["rows"] for chunk in self.chunks)

    def save(self, work: Path) -> None:
        write_json_atomic(work / STATE_FILE, {"identity": self.identity, "chunks": self.chunks})


def _work_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


def _open_state(work: Path, identity: dict, restart: bool) -> _State:
    saved = read_json(work / STATE_FILE)
    if saved is not None and not restart:
        if saved["identity"] != identity:
            changed = sorted(k for k in identity if saved["identity"].get(k) != identity[k])
            raise BuildError(
                f"{work} holds an interrupted build with a different {', '.join(changed)}; "
                "rerun with --restart to discard it"
            )
        return _State(identity, saved["chunks"])
    if work.exists():
        shutil.rmtree(work)
    (work / CHUNKS_DIR).mkdir(parents=True)
    state = _State(identity)
    state.save(work)
    return state


def _check_duplicates(connection: sqlite3.Connection, passages: list[Passage]) -> list[BadLine]:
    """A BadLine for each passage whose id was seen earlier in this chunk or in a stored one."""
    first_line: dict[str, int] = {}
    ids = [p.id for p in passages]
    for start in range(0, len(ids), 900):
        part = ids[start : start + 900]
        query = f"SELECT id, line FROM passages WHERE id IN ({','.join('?' * len(part))})"
        first_line.update(connection.execute(query, part).fetchall())
    bad = []
    for passage in passages:
        if passage.id in first_line:
            bad.append(BadLine(passage.line, f"duplicate id {passage.id!r} (first on line {first_line[passage.id]})"))
        else:
            first_line[passage.id] = passage.line
    return bad


class _Reporter:
    """Raises on the first bad line, or counts it and shows the first few under --skip-bad."""

    def __init__(self, corpus: Path, skip_bad: bool) -> None:
        self.corpus, self.skip_bad, self.shown = corpus, skip_bad, 0

    def __call__(self, bad: BadLine) -> None:
        message = f"{self.corpus}: line {bad.line}: {bad.reason}"
        if not self.skip_bad:
            raise BuildError(message + " (use --skip-bad to skip such lines)")
        if self.shown < SHOWN_BAD_LINES:
            tqdm.write("skipped " + message, file=sys.stderr)
            self.shown += 1


def build_index(options: BuildOptions, encoder: PassageEncoder) -> BuildReport:
    """Build (or resume building) `options.out` from `options.corpus` with `encoder`."""
    corpus, out = options.corpus, options.out
    if not corpus.is_file():
        raise BuildError(f"{corpus}: corpus file not found")
    if options.chunk_size < 1:
        raise BuildError(f"--chunk-size must be at least 1, got {options.chunk_size}")
    if out.exists() and not options.overwrite:
        raise BuildError(f"{out} already exists; pass --overwrite to replace it")
    fmt = detect_format(corpus)
    identity = {
        "corpus": str(corpus.resolve()),
        "format": fmt,
        "chunk_size": options.chunk_size,
        "skip_bad": options.skip_bad,
        # Prefixes only when set, so builds interrupted before prefixes existed still resume.
        "encoder": {name: value for name, value in encoder.spec.to_dict().items()
                    if value != "" or name not in ("query_prefix", "passage_prefix")},
    }
    if encoder.backend != "torch":  # only then, so builds interrupted before backends existed still resume
        identity["backend"] = encoder.backend
    if options.shard is not None:  # only then, so builds interrupted before --shard existed still resume
        identity["shard"] = str(options.shard)
    work = _work_dir(out)
    state = _open_state(work, identity, options.restart)
    resumed_chunks = len(state.chunks)
    last = state.chunks[-1] if state.chunks else {"end_offset": 0, "end_line": 0, "sha256": None, "records": 0}
    digest = hashlib.sha256()
    with corpus.open("rb") as handle:
        digest.update(handle.read(last["end_offset"]))
        if state.chunks and digest.hexdigest() != last["sha256"]:
            raise BuildError(f"{corpus} changed since the interrupted build in {work}; rerun with --restart")
        connection = index_writer.open_store(work)
        with connection:  # rows of a chunk that was stored but not yet counted in state.json
            connection.execute("DELETE FROM passages WHERE row >= ?", (state.rows,))
        report = _Reporter(corpus, options.skip_bad)
        started = time.perf_counter()
        encoded = 0
        size = max(corpus.stat().st_size, 1)
        with tqdm(desc="encoding", unit=" passages", initial=state.rows) as progress:
            chunks = _read_chunks(handle, fmt, last["end_offset"], last["end_line"], digest, options.chunk_size,
                                  options.shard, last.get("records", 0))
            for chunk in chunks:
                bad = sorted(chunk.bad + _check_duplicates(connection, chunk.passages), key=lambda b: b.line)
                for line in bad:
                    report(line)
                bad_lines = {line.line for line in bad}
                passages = [p for p in chunk.passages if p.line not in bad_lines]
                _commit_chunk(work, state, connection, encoder, passages, chunk, len(bad), progress)
                encoded += len(passages)
                progress.set_postfix(read=f"{100 * chunk.end_offset / size:.0f}%")
        connection.close()
    if state.rows == 0 and options.shard is None:  # a shard of a tiny corpus may rightly be empty
        raise BuildError(f"{corpus}: no passages to index")
    _finish(work, state, encoder, corpus, fmt, options.bm25, options.shard)
    index_writer.move_into_place(work, out, scratch=(CHUNKS_DIR, STATE_FILE))
    return BuildReport(
        out=out,
        passages=state.rows,
        skipped=sum(chunk["skipped"] for chunk in state.chunks),
        encoded=encoded,
        seconds=time.perf_counter() - started,
        resumed_chunks=resumed_chunks,
    )


def _read_chunks(
    handle: BinaryIO, fmt: CorpusFormat, offset: int, line: int, digest, chunk_size: int,
    shard: Shard | None = None, records: int = 0,
) -> Iterator[_Chunk]:
    """Group the corpus from `offset` into chunks of `chunk_size` well-formed passages (of `shard`'s
    records only; `records` counts those before `offset`)."""
    passages: list[Passage] = []
    bad: list[BadLine] = []
    for item, raw in read_corpus(handle, fmt, first_line=line + 1):
        offset += len(raw)
        line += 1
        digest.update(raw)
        if item is not None:
            records += 1
            if shard is not None and not shard.keeps(records - 1):
                continue
        if isinstance(item, BadLine):
            bad.append(item)
        elif item is not None:
            passages.append(item)
        if len(passages) == chunk_size:
            yield _Chunk(passages, bad, offset, line, digest.hexdigest(), records)
            passages, bad = [], []
    if passages or bad:
        yield _Chunk(passages, bad, offset, line, digest.hexdigest(), records)


def _commit_chunk(work, state: _State, connection, encoder: PassageEncoder, passages, chunk: _Chunk, skipped, progress):
    """Embeddings to disk, passages to SQLite, then count the chunk: in that order, so a crash loses nothing."""
    number = len(state.chunks)
    vectors = encoder.encode_passages([p.text for p in passages], progress=progress)
    path = work / CHUNKS_DIR / f"{number:06d}.npy"
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as handle:
        np.save(handle, vectors)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    first_row = state.rows
    index_writer.insert_passages(connection, ((first_row + i, p.id, p.text, p.line) for i, p in enumerate(passages)))
    state.chunks.append(
        {
            "end_offset": chunk.end_offset,
            "end_line": chunk.end_line,
            "rows": len(passages),
            "skipped": skipped,
            "sha256": chunk.sha256,
            "records": chunk.records,
        }
    )
    state.save(work)


def _finish(
    work: Path, state: _State, encoder: PassageEncoder, corpus: Path, fmt: CorpusFormat, bm25: bool, shard: Shard | None
) -> None:
    """FAISS index from the chunks (and BM25 from the stored passages), then the manifest."""
    chunks = (np.load(work / CHUNKS_DIR / f"{number:06d}.npy") for number in range(len(state.chunks)))
    count = index_writer.write_vectors(work, chunks, encoder.dimension)
    index_writer.write_manifest(
        work,
        encoder=EncoderRecord(path=encoder.source, backend=encoder.backend, export_sha256=encoder.export_sha256,
                              **encoder.spec.to_dict()),
        corpus=CorpusRecord(
            path=str(corpus.resolve()),
            format=fmt,
            passages=state.rows,
            skipped=sum(chunk["skipped"] for chunk in state.chunks),
        ),
        count=count,
        bm25=bm25,
        shard=str(shard) if shard is not None else None,
    )
