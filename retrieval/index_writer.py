"""The one writer of index directories: `index_builder.build` and `index_builder.merge` both go through it.

An index is written inside a work folder beside its destination (passages, then vectors, then
BM25, then the manifest, which marks it finished) and moved into place by rename, so a reader
of the destination sees the old index or the new one, never half of one. A candidate structure
(retrieval.candidates) is added to a finished index in its work folder, or in a new generation of
a published one (`link_generation`: its files hard-linked, never rewritten), moved into place the same way.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sqlite3
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, Sequence

import faiss
import numpy as np

from retrieval import dense_index
from retrieval.bm25_index import BM25_DIR, bm25_record, build_bm25
from retrieval.candidates import recall, structures
from retrieval.candidates.kind import Structure
from retrieval.fields import stored_types
from retrieval.index_format import (
    INDEX_FILE,
    MANIFEST_FILE,
    PASSAGES_FILE,
    CandidateRecord,
    CorpusRecord,
    EncoderRecord,
    Manifest,
    candidates_file,
    file_record,
    read_manifest,
    sealed,
    write_json_atomic,
)
from retrieval.passage_store import SCHEMA
from retrieval.sharding import shard_folder
from retrieval.text_hashes import write_text_hashes

_LIBC = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>
INSERT = "INSERT INTO passages (row, id, text, line, fields) VALUES (?, ?, ?, ?, ?)"
# (row, id, text, corpus line), and optionally the passage's metadata fields as stored (fields.encode_fields)
PassageRow = tuple[int, str, str, int] | tuple[int, str, str, int, str | None]


def open_store(work: Path) -> sqlite3.Connection:
    """The passage store being written in `work` (created if new)."""
    connection = sqlite3.connect(work / PASSAGES_FILE)
    connection.executescript(SCHEMA)
    return connection


def insert_passages(connection: sqlite3.Connection, rows: Iterable[PassageRow]) -> None:
    """Adds rows in one transaction: all of them or none. sqlite3.IntegrityError for an id already stored."""
    with connection:
        connection.executemany(INSERT, (row if len(row) == 5 else (*row, None) for row in rows))


def write_vectors(work: Path, parts: Iterable[np.ndarray], dimension: int) -> int:
    """The flat inner-product index of `parts` (row blocks, in row order) as `work/index.faiss`; its row count."""
    index = dense_index.new_flat_index(dimension)
    for part in parts:
        index.add(np.ascontiguousarray(part, dtype=np.float32))
    tmp = work / (INDEX_FILE + ".tmp")
    try:
        faiss.write_index(index, str(tmp))
    except RuntimeError as error:  # FAISS reports a failed write (a full disk) as RuntimeError
        raise OSError(f"{tmp}: {str(error).strip().splitlines()[-1]}") from None
    # FAISS only prints a failed final flush (its writer's fclose), so the size is checked, after fsync
    # makes the file durable: a short file would otherwise be sealed into the manifest as whole.
    expected = len(faiss.serialize_index(dense_index.new_flat_index(dimension))) + index.ntotal * index.code_size
    _fsync(tmp)
    if tmp.stat().st_size != expected:
        raise OSError(f"{tmp}: {tmp.stat().st_size} bytes written of {expected} (is the disk full?)")
    os.replace(tmp, work / INDEX_FILE)
    return index.ntotal


def _fsync(path: Path) -> None:
    """`path` (a file, or a folder's entries) to disk; a write error the writer missed surfaces as OSError."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_bm25(work: Path, rows: int, write: Callable[[Path], None] | None = None) -> list[str]:
    """BM25 over the passages stored in `work` (row order); returns its files relative to `work`.
    Built from the final store, never merged, because BM25's statistics belong to the whole corpus; `write`:
    writes the folder instead from terms already held (a compaction's: retrieval.bm25_changes)."""
    folder = work / BM25_DIR
    if folder.exists():
        shutil.rmtree(folder)
    if write is not None:
        write(folder)
    else:
        connection = sqlite3.connect(work / PASSAGES_FILE)
        try:
            build_bm25((text for (text,) in connection.execute("SELECT text FROM passages ORDER BY row")), rows,
                       folder)
        finally:
            connection.close()
    for path in [*folder.iterdir(), folder]:
        _fsync(path)
    return sorted(str(path.relative_to(work)) for path in folder.iterdir())


def write_manifest(work: Path, *, encoder: EncoderRecord, corpus: CorpusRecord, count: int, bm25: bool,
                   shard: str | None = None, write_sequence: int = 0,
                   bm25_from: Callable[[Path], None] | None = None) -> Manifest:
    """Builds BM25 where asked (`bm25_from`: write_bm25's `write`) and the passages' content hashes
    (retrieval.text_hashes, which an update matches unchanged passages by), then writes the manifest (last: it
    marks `work` a finished index), listing the stored passages' metadata fields with their types (ValueError for
    a field stored with two)."""
    fields = _field_types(work)
    files = [INDEX_FILE, PASSAGES_FILE, write_text_hashes(work)] + (write_bm25(work, count, bm25_from) if bm25 else [])
    manifest = Manifest(
        encoder=encoder,
        count=count,
        built_at=now(),
        corpus=corpus,
        files={name: file_record(work / name) for name in files},
        bm25=bm25_record() if bm25 else None,
        shard=shard,
        fields=fields,
        write_sequence=write_sequence,
    )
    write_json_atomic(work / MANIFEST_FILE, sealed(manifest))
    return manifest


def _field_types(work: Path) -> dict[str, str]:
    connection = sqlite3.connect(work / PASSAGES_FILE)
    try:
        return stored_types(connection)
    finally:
        connection.close()


def checkpoint_file(kind: str) -> str:
    """Where a structure build in a work folder keeps its resumable progress (removed once it is written)."""
    return candidates_file(kind) + ".partial"


def write_candidates(work: Path, kind: str, params: dict[str, int] | None = None, *, depth: int | None = None,
                     query_vectors: np.ndarray | None = None, queries: str = recall.HELD_OUT,
                     sample: int = recall.RECALL_SAMPLE, progress: bool = True) -> CandidateRecord:
    """Builds a `kind` structure over the finished index in `work` (see retrieval.candidates.structures.build; resumed
    from its checkpoint there), writes it as `candidates-KIND.faiss`, measures its recall card
    (recall.measure_recall: `query_vectors` named `queries`, else `sample` held-out passages), and
    reseals the manifest listing it with its checksum, in place of a structure of the same kind."""
    manifest = read_manifest(work)
    flat = dense_index.load_index(work / INDEX_FILE, "cpu", mmap=True)
    checkpoint = work / checkpoint_file(kind)
    started = time.perf_counter()
    structure = structures.build(flat, kind, params, depth=depth, progress=progress, checkpoint=checkpoint,
                                 identity=manifest.files[INDEX_FILE].sha256)
    record = write_structure(work, structure, time.perf_counter() - started, query_vectors, queries, sample)
    for path in (checkpoint, checkpoint.with_name(checkpoint.name + ".json")):
        path.unlink(missing_ok=True)
    return record


def write_structure(work: Path, structure: Structure, seconds: float, query_vectors: np.ndarray | None = None,
                    queries: str = recall.HELD_OUT, sample: int = recall.RECALL_SAMPLE) -> CandidateRecord:
    """`structure` (over the finished index in `work`: built, or extended by a compaction in `seconds`) written as
    `candidates-KIND.faiss`, its recall card measured against `work`'s vectors, and the manifest resealed listing
    it in place of a structure of the same kind."""
    manifest = read_manifest(work)
    flat = dense_index.load_index(work / INDEX_FILE, "cpu", mmap=True)
    kind = structure.kind
    structures.kind(kind).attach(structure.index, flat)
    name = candidates_file(kind)
    tmp = work / (name + ".tmp")
    structures.write(structure, tmp)
    os.replace(tmp, work / name)
    card = recall.measure_recall(structure, flat, query_vectors, queries=queries, sample=sample)
    record = CandidateRecord(kind=kind, file=name, params=structure.params, depth=structure.depth,
                             recall_at_10=round(card.recall_at_10, 4), recall_at_100=round(card.recall_at_100, 4),
                             recall_queries=card.queries, sample=card.sample, seconds=round(seconds, 2),
                             library=f"faiss {faiss.__version__}")
    update = {"files": {**manifest.files, name: file_record(work / name)},
              "candidates": [*(c for c in manifest.candidates if c.kind != kind), record]}
    _fsync(work)
    write_json_atomic(work / MANIFEST_FILE, sealed(manifest.model_copy(update=update)))
    return record


def link_generation(out: Path, work: Path, keep: Sequence[str] = ()) -> Manifest:
    """`work` made a new generation of the finished index at `out`: a hard link to each file its manifest
    lists (a copy where the file system cannot link) and a copy of the manifest, to be changed there and
    moved into place. The generations share those files, which no writer changes in place (each writes a
    new file and renames it). What an earlier `work` holds is dropped but for `keep` (a build's checkpoint)."""
    manifest = read_manifest(out)
    work.mkdir(exist_ok=True)
    for entry in work.iterdir():
        if entry.name not in keep:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    for name in manifest.files:
        target = work / name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(out / name, target)
        except OSError:  # EXDEV, EPERM (a file system without hard links), EMLINK
            shutil.copy2(out / name, target)
            _fsync(target)
    shutil.copy2(out / MANIFEST_FILE, work / MANIFEST_FILE)
    _fsync(work / MANIFEST_FILE)
    for folder in {(work / name).parent for name in manifest.files} | {work}:
        _fsync(folder)
    return manifest


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 with RENAME_EXCHANGE); False where the system or
    the file system cannot."""
    renameat2 = getattr(_LIBC, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(AT_FDCWD, os.fsencode(first), AT_FDCWD, os.fsencode(second), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(second))


def check_replaceable(out: Path) -> None:
    """ValueError, before any work, for an `out` that `move_into_place` must not replace: a symbolic link
    (the swap would move the link, not the index), or an existing file or non-empty folder that is not an
    index (a mistyped --out with --overwrite would otherwise be deleted, whatever it holds)."""
    if out.is_symlink():
        raise ValueError(f"{out} is a symbolic link; give the folder it points to ({out.resolve()})")
    if not out.exists():
        return
    if not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST_FILE).is_file()
                            and not shard_folder(out, 0).is_dir()):
        raise ValueError(f"{out} is not an index (no {MANIFEST_FILE}) and --overwrite replaces only an index; "
                         "choose another --out")


def now() -> str:
    """A manifest's `built_at`: UTC, to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def move_into_place(work: Path, out: Path, scratch: Sequence[str] = ()) -> None:
    """Put the finished `work` folder at `out`, then drop the old index and the writer's `scratch`
    entries (files or folders inside the new index that are not part of it). An index already at
    `out` is swapped out in one step, so a reader of `out` always finds a whole index, old or new;
    where the system cannot swap, two renames leave a moment with nothing at `out`."""
    old = out.parent / f".{out.name}.old"
    check_replaceable(out)
    _fsync(work)  # the names inside it (a manifest renamed into place last) before it is named `out`
    if old.exists():
        shutil.rmtree(old)
    if out.exists() and _exchange(work, out):
        os.replace(work, old)  # `work` now names the old index
    else:
        if out.exists():
            os.replace(out, old)
        os.replace(work, out)
    _fsync(out.parent)  # the renames themselves, before the old index goes
    for name in scratch:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    if old.exists():
        shutil.rmtree(old)
