"""Build an index directory from a passage collection, resumably and atomically.

The work happens in a sibling folder `.NAME.partial/`, chunk by chunk: each
chunk's embeddings are saved (`chunks/NNNNNN.npy`), its passages committed to
SQLite, and only then is `state.json` rewritten to count it. An interrupted
build therefore restarts after its last counted chunk, seeking straight to the
byte where that chunk ended, and no passage is lost or stored twice. The
finished folder is renamed into place, so `--out` is either the old index or
the new one, never half of one.

`--shards N` builds the whole corpus once and, at the end, writes N shard
directories `OUT/shard-i` instead of one index: shard i holds the records a
`--shard i/N` job keeps (each chunk saves which shard its passages fall to), so
they serve sharded (`python -m service --ray --shards OUT`) and merge back into
the unsharded index like the jobs' output. One difference: a passage id repeated
in two shards is a duplicate here (refused, or skipped in the later line's
shard with --skip-bad), where separate jobs keep both and `merge` refuses them.
The shards are written in a sibling `.NAME.shards/`, renamed into place whole.

A build holds `--out`'s lock (`index_builder.out_lock`) throughout, reads no corpus line longer
than `max_passage_bytes` into memory, and hashes the bytes it parses as it reads them: the corpus
is checked at the end to be those bytes still, else no index is published.
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
from typing import BinaryIO, Callable, Iterator, Mapping, Protocol, Sequence

import numpy as np
from tqdm import tqdm

from index_builder.ann import AnnOptions, AnnReport, add_in_place
from index_builder.corpus_file import check_corpus_file, check_unchanged, count_lines
from index_builder.errors import BuildError
from models.checkpoint import read_json
from models.encoder import EncoderSpec
from retrieval import out_lock
from retrieval import index_writer
from retrieval.corpus import DEFAULT_MAX_PASSAGE_BYTES, BadLine, CorpusFormat, Passage, detect_format, read_corpus
from retrieval.fields import MAX_FIELDS, FieldTypes, encode_fields
from retrieval.index_format import FORMAT_VERSION, PASSAGES_FILE, CorpusRecord, EncoderRecord, write_json_atomic
from retrieval.sharding import Shard, shard_folder

STATE_FILE = "state.json"
CHUNKS_DIR = "chunks"  # STATE_FILE and CHUNKS_DIR are a build's scratch, dropped once the index is in place
SHOWN_BAD_LINES = 5
SHARD_INSERT_BATCH = 2048
HASH_BLOCK = 1 << 22


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


@dataclass
class BuildOptions:
    corpus: Path
    out: Path
    chunk_size: int = 2048
    skip_bad: bool = False
    overwrite: bool = False
    restart: bool = False
    bm25: bool = True  # also build a BM25 index over the same passages (False: --no-bm25)
    shard: Shard | None = None  # keep only this shard's records (see retrieval.sharding)
    shards: int | None = None  # write this many shard directories (shard_folder) instead of one index
    max_passage_bytes: int = DEFAULT_MAX_PASSAGE_BYTES  # a longer corpus line (its line end aside) is a bad line
    ann: list[AnnOptions] = field(default_factory=list)  # candidate structures (index_builder.ann), in each shard
    # Called with the finished work folder just before it replaces `out` (an update counts what it dropped there).
    before_publish: Callable[[Path], None] | None = None
    max_fields: int = MAX_FIELDS  # metadata fields the index may declare; a line adding one more is a bad line
    # update --add: the index's field types and its name, which the added passages' fields must agree with.
    field_types: Mapping[str, str] = field(default_factory=dict)
    field_types_of: str = ""


@dataclass
class BuildReport:
    out: Path
    passages: int
    skipped: int
    encoded: int  # passages encoded by this run (fewer than `passages` after a resume)
    seconds: float
    resumed_chunks: int
    shards: int | None = None
    ann: list[AnnReport] = field(default_factory=list)  # the candidate structures built (one per shard)

    @property
    def passages_per_second(self) -> float:
        return self.encoded / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        resumed = f", resumed after {self.resumed_chunks} chunks" if self.resumed_chunks else ""
        split = f" in {self.shards} shards {self.out}/shard-{{0..{self.shards - 1}}}" if self.shards else ""
        return "\n".join([
            f"built {self.out}: {self.passages} passages{split} ({self.skipped} bad lines skipped{resumed}); "
            f"encoded {self.encoded} in {self.seconds:.1f} s = {self.passages_per_second:.1f} passages/s",
            *(report.summary() for report in self.ann),
        ])


@dataclass
class _Chunk:
    passages: list[Passage]
    bad: list[BadLine]
    end_offset: int  # byte just past the chunk's last line
    end_line: int
    sha256: str  # of the corpus bytes [0, end_offset)
    records: int  # corpus records (passages and bad lines) in [0, end_offset): where --shard resumes counting
    positions: dict[int, int]  # corpus line -> record position, for the chunk's passages and bad lines


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
        if _loosened(saved["identity"], identity):
            saved["identity"] = identity
        if saved["identity"] != identity:
            changed = sorted(k for k in identity.keys() | saved["identity"].keys()
                             if saved["identity"].get(k) != identity.get(k))
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


def _loosened(saved: dict, identity: dict) -> bool:
    """Whether `identity` only turns --skip-bad on or raises --max-passage-bytes over `saved`'s, as a bad
    line's message advises: such a build resumes, since without --skip-bad every chunk already committed
    was whole (a bad line stops the build), so no line was skipped and each is still accepted."""
    loosened = ("skip_bad", "max_passage_bytes")
    rest = [{k: v for k, v in ident.items() if k not in loosened} for ident in (saved, identity)]
    return (rest[0] == rest[1] and not saved["skip_bad"]
            and identity["max_passage_bytes"] >= saved["max_passage_bytes"])


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
    """Build (or resume building) `options.out` from `options.corpus` with `encoder`. BuildError for bad
    input, a corpus that changed while it was read, or an `out` another build or merge is writing."""
    check_corpus_file(options.corpus)
    if options.chunk_size < 1:
        raise BuildError(f"--chunk-size must be at least 1, got {options.chunk_size}")
    if options.max_passage_bytes < 1:
        raise BuildError(f"--max-passage-bytes must be at least 1, got {options.max_passage_bytes}")
    if options.shards is not None and (options.shards < 1 or options.shard is not None):
        raise BuildError("--shards N needs N >= 1 and no --shard (it writes every shard itself)")
    with out_lock.hold(options.out, "build"):
        return _build(options, encoder)


def encoder_record(encoder: PassageEncoder) -> EncoderRecord:
    """What a build with `encoder` writes into its manifest."""
    return EncoderRecord(path=encoder.source, backend=encoder.backend, export_sha256=encoder.export_sha256,
                         **encoder.spec.to_dict())


def _build(options: BuildOptions, encoder: PassageEncoder) -> BuildReport:
    corpus, out = options.corpus, options.out
    if out.exists() and not options.overwrite:
        raise BuildError(f"{out} already exists; pass --overwrite to replace it")
    index_writer.check_replaceable(out)
    fmt = detect_format(corpus)
    identity = {
        "corpus": str(corpus.resolve()),
        "format": fmt,
        "chunk_size": options.chunk_size,
        "skip_bad": options.skip_bad,
        "encoder": encoder.spec.to_dict(),
        "backend": encoder.backend,
        "shard": None if options.shard is None else str(options.shard),
        "shards": options.shards,
        "max_passage_bytes": options.max_passage_bytes,
        "index_format": FORMAT_VERSION,  # a work folder of another format is not resumed
    }
    work = _work_dir(out)
    state = _open_state(work, identity, options.restart)
    resumed_chunks = len(state.chunks)
    last = state.chunks[-1] if state.chunks else {"end_offset": 0, "end_line": 0, "sha256": None, "records": 0}
    digest = hashlib.sha256()
    with corpus.open("rb") as handle:
        opened = os.fstat(handle.fileno())  # what the end checks the corpus against
        left = last["end_offset"]
        while left:  # the prefix the interrupted build read, a block at a time (the corpus may be large)
            block = handle.read(min(left, HASH_BLOCK))
            if not block:
                break
            digest.update(block)
            left -= len(block)
        if state.chunks and digest.hexdigest() != last["sha256"]:
            raise BuildError(f"{corpus} changed since the interrupted build in {work}; rerun with --restart")
        connection = index_writer.open_store(work)
        with connection:  # rows of a chunk that was stored but not yet counted in state.json
            connection.execute("DELETE FROM passages WHERE row >= ?", (state.rows,))
        types = FieldTypes.of_store(connection)  # a JSONL field keeps the type it was first stored with
        types.max_fields = options.max_fields
        types.know(options.field_types, options.field_types_of)
        report = _Reporter(corpus, options.skip_bad)
        started = time.perf_counter()
        encoded = 0
        size = max(opened.st_size, 1)
        records = count_lines(corpus)
        if options.shard is not None:
            records = len(range(options.shard.index, records, options.shard.count))
        with tqdm(desc="encoding", unit=" passages", initial=state.rows, total=records) as progress:
            chunks = _read_chunks(handle, fmt, last["end_offset"], last["end_line"], digest, options.chunk_size,
                                  options.max_passage_bytes, options.shard, last.get("records", 0))
            for chunk in chunks:
                duplicates = _check_duplicates(connection, chunk.passages)
                twice = {line.line for line in duplicates}
                mistyped = [BadLine(*found) for found in types.admit(p for p in chunk.passages if p.line not in twice)]
                bad = sorted(chunk.bad + duplicates + mistyped, key=lambda b: b.line)
                for line in bad:
                    report(line)
                bad_lines = {line.line for line in bad}
                passages = [p for p in chunk.passages if p.line not in bad_lines]
                split = _split(chunk, passages, bad, options.shards) if options.shards else None
                _commit_chunk(work, state, connection, encoder, passages, chunk, len(bad), progress, split)
                encoded += len(passages)
                progress.set_postfix(read=f"{100 * chunk.end_offset / size:.0f}%")
            progress.total = progress.n  # blank lines, a header and bad lines are no passages
            progress.refresh()
        connection.close()
    check_unchanged(corpus, opened, digest.hexdigest(), work)
    if state.rows == 0 and options.shard is None:  # a shard of a tiny corpus may rightly be empty
        raise BuildError(f"{corpus}: no passages to index")
    corpus_record = CorpusRecord(path=str(corpus.resolve()), format=fmt, passages=state.rows,
                                 skipped=sum(chunk["skipped"] for chunk in state.chunks),
                                 sha256=digest.hexdigest())  # the reader has hashed the whole file by now
    if options.shards:
        # Written beside the scratch, not inside it: `out` never holds the whole store or the chunks,
        # even for a moment, and a crash before the last line leaves only the scratch to resume from.
        shards_dir = out.parent / f".{out.name}.shards"
        _finish_shards(work, shards_dir, state, encoder_record(encoder), corpus_record, options.bm25, options.shards)
        ann = [add_in_place(shard_folder(shards_dir, i), structure, published=shard_folder(out, i))
               for i in range(options.shards) for structure in options.ann]
        index_writer.move_into_place(shards_dir, out)
        shutil.rmtree(work)
    else:
        _finish(work, state, encoder_record(encoder), corpus_record, options.bm25, options.shard)
        ann = [add_in_place(work, structure, published=out) for structure in options.ann]
        if options.before_publish is not None:
            options.before_publish(work)
        index_writer.move_into_place(work, out, scratch=(CHUNKS_DIR, STATE_FILE))
    return BuildReport(
        out=out,
        passages=state.rows,
        skipped=sum(chunk["skipped"] for chunk in state.chunks),
        encoded=encoded,
        seconds=time.perf_counter() - started,
        resumed_chunks=resumed_chunks,
        shards=options.shards,
        ann=ann,
    )


def _read_chunks(
    handle: BinaryIO, fmt: CorpusFormat, offset: int, line: int, digest, chunk_size: int, max_bytes: int,
    shard: Shard | None = None, records: int = 0,
) -> Iterator[_Chunk]:
    """Group the corpus from `offset` into chunks of `chunk_size` well-formed passages (of `shard`'s
    records only; `records` counts those before `offset`), feeding `digest` every byte read."""
    passages: list[Passage] = []
    bad: list[BadLine] = []
    positions: dict[int, int] = {}
    for item, size in read_corpus(handle, fmt, first_line=line + 1, max_bytes=max_bytes, digest=digest):
        offset += size
        line += 1
        if item is not None:
            records += 1
            if shard is not None and not shard.keeps(records - 1):
                continue
            positions[item.line] = records - 1
        if isinstance(item, BadLine):
            bad.append(item)
        elif item is not None:
            passages.append(item)
        if len(passages) == chunk_size:
            yield _Chunk(passages, bad, offset, line, digest.hexdigest(), records, positions)
            passages, bad, positions = [], [], {}
    if passages or bad:
        yield _Chunk(passages, bad, offset, line, digest.hexdigest(), records, positions)


def _split(chunk: _Chunk, passages: list[Passage], bad: list[BadLine], shards: int) -> tuple[np.ndarray, list[int]]:
    """The shard of each kept passage, and the bad lines each shard counts: by record position, as --shard i/N."""
    assignment = np.array([chunk.positions[p.line] % shards for p in passages], dtype=np.int32)
    skipped = np.bincount([chunk.positions[b.line] % shards for b in bad], minlength=shards)
    return assignment, [int(n) for n in skipped]


def _chunk_file(work: Path, number: int, kind: str = "vectors") -> Path:
    """Chunk `number`'s saved vectors, or (`kind` "shards") its passages' shard numbers."""
    return work / CHUNKS_DIR / (f"{number:06d}.npy" if kind == "vectors" else f"{number:06d}.{kind}.npy")


def _save_array(path: Path, array: np.ndarray) -> None:
    """`array` to `path` durably, by rename: a crash leaves the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as handle:
        np.save(handle, array)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _commit_chunk(work, state: _State, connection, encoder: PassageEncoder, passages, chunk: _Chunk, skipped, progress,
                  split: tuple[np.ndarray, list[int]] | None = None):
    """Embeddings (and with --shards each passage's shard) to disk, passages to SQLite, then count the
    chunk: in that order, so a crash loses nothing."""
    number = len(state.chunks)
    vectors = encoder.encode_passages([p.text for p in passages], progress=progress)
    _save_array(_chunk_file(work, number), vectors)
    if split is not None:
        _save_array(_chunk_file(work, number, "shards"), split[0])
    first_row = state.rows
    index_writer.insert_passages(connection, ((first_row + i, p.id, p.text, p.line, encode_fields(p.fields))
                                              for i, p in enumerate(passages)))
    state.chunks.append(
        {
            "end_offset": chunk.end_offset,
            "end_line": chunk.end_line,
            "rows": len(passages),
            "skipped": skipped,
            "sha256": chunk.sha256,
            "records": chunk.records,
            **({"skipped_by_shard": split[1]} if split is not None else {}),
        }
    )
    state.save(work)


def _finish(work: Path, state: _State, encoder: EncoderRecord, corpus: CorpusRecord, bm25: bool,
            shard: Shard | None) -> None:
    """FAISS index from the chunks (and BM25 from the stored passages), then the manifest."""
    chunks = (np.load(_chunk_file(work, number)) for number in range(len(state.chunks)))
    count = index_writer.write_vectors(work, chunks, encoder.dimension)
    index_writer.write_manifest(work, encoder=encoder, corpus=corpus, count=count, bm25=bm25,
                                shard=str(shard) if shard is not None else None)


def _finish_shards(work: Path, target: Path, state: _State, encoder: EncoderRecord, corpus: CorpusRecord,
                   bm25: bool, shards: int) -> None:
    """`shards` whole shard indexes in a fresh `target` from `work`'s chunks and passage store, each
    written as a `--shard i/N` build writes it (rows in corpus order, its own passage count and bad
    lines). The chunks are read once; like an unsharded finish, it holds every vector in memory."""
    if target.exists():  # left by a finish that crashed: start it again
        shutil.rmtree(target)
    folders = [shard_folder(target, i) for i in range(shards)]
    for folder in folders:
        folder.mkdir(parents=True)
    parts: list[list[np.ndarray]] = [[] for _ in range(shards)]
    assignments = []
    for number in range(len(state.chunks)):
        assignment = np.load(_chunk_file(work, number, "shards"))
        vectors = np.load(_chunk_file(work, number))
        for i in range(shards):
            parts[i].append(vectors[assignment == i])
        assignments.append(assignment)
    assignment = np.concatenate(assignments or [np.empty(0, dtype=np.int32)])
    stores = [index_writer.open_store(folder) for folder in folders]
    source = sqlite3.connect(work / PASSAGES_FILE)
    try:
        rows = [0] * shards
        batches: list[list] = [[] for _ in range(shards)]
        with tqdm(total=state.rows, desc="splitting into shards", unit=" passages") as progress:
            for row, pid, text, line, fields in source.execute(
                    "SELECT row, id, text, line, fields FROM passages ORDER BY row"):
                i = int(assignment[row])
                batches[i].append((rows[i], pid, text, line, fields))
                rows[i] += 1
                if len(batches[i]) == SHARD_INSERT_BATCH:
                    index_writer.insert_passages(stores[i], batches[i])
                    progress.update(len(batches[i]))
                    batches[i] = []
            for store, batch in zip(stores, batches):
                index_writer.insert_passages(store, batch)
                progress.update(len(batch))
    finally:
        source.close()
        for store in stores:
            store.close()
    for i, folder in enumerate(folders):
        count = index_writer.write_vectors(folder, parts[i], encoder.dimension)
        parts[i] = []  # one shard's vectors freed before the next is indexed
        skipped = sum(chunk["skipped_by_shard"][i] for chunk in state.chunks)
        index_writer.write_manifest(folder, encoder=encoder, bm25=bm25, count=count, shard=f"{i}/{shards}",
                                    corpus=corpus.model_copy(update={"passages": count, "skipped": skipped}))
