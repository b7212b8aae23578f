"""Compaction: the writes over HTTP held in a segment (retrieval.writes) folded into a new generation of the index,
swapped in at its folder, after which the writer serves the new generation with only the later writes beside it
and the log drops the folded ones. Read-only replicas watching the folder follow the new generation.

A compaction seals or merges. While the segment (the writes sealed before and the new ones) holds less than
`merge_share` of the generation's rows, in a whole index of format 2 or later, it seals, as Lucene's refresh or a
sealed segment of Qdrant and Milvus: the new generation links every file of the old one and adds the writes
themselves, the old generation's sealed writes then the log's new ones, as `sealed-writes.log`
(retrieval.index_format.SEALED_WRITES_FILE), which every load replays as the segment the writer searched
(retrieval.searcher.Searcher.with_writes): its cost follows the writes, not the collection. Otherwise it merges: the
new generation holds the collection the writer searched: the old generation's live rows in their order, then the
live written passages in write order (retrieval.segment), each with its vector as searched (nothing is encoded
again); BM25 is written from the terms the generation and the segment hold (retrieval.bm25_changes: no passage
tokenized again, each score as a build's), each candidate structure extended (its removed rows dropped, or in a
graph (hnsw) kept as paths never proposed; the written ones added, trained as before) or, past REBUILD_SHARE of the
rows changed (or a graph's own share of deleted nodes), built again with the old one's parameters, its recall card
measured again either way. Either way the manifest records the last write folded in (`write_sequence`), and every
search answers as before it. It is written in `.NAME.compacting` beside the folder while writes go on; a kill leaves
the old generation and the log, which replays every write again. A compaction that fails (a full disk) leaves the
served generation and the log as they were.
"""

from __future__ import annotations

import itertools
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from retrieval import bm25_changes, format_upgrade, index_writer
from retrieval.bm25_index import BM25_DIR
from retrieval.candidates import structures
from retrieval.fields import encode_fields
from retrieval.index_format import (
    INDEX_FILE,
    MANIFEST_FILE,
    SEALED_WRITES_FILE,
    SEALED_WRITES_FORMAT,
    file_record,
    generation_id,
    sealed,
    write_json_atomic,
)
from retrieval.pinned import replaced
from retrieval.searcher import Searcher
from retrieval.write_log import Record, write_records
from retrieval.writes import Writes

BLOCK = 65_536  # rows read and written at a time
# Past this share of the generation's rows changed (removed and added), a structure is trained and built again;
# below it, the one served is extended (rows removed, the written ones added: candidates.kind.Kind.extended).
REBUILD_SHARE = 0.2

_compacting = threading.Lock()  # one compaction at a time in a process


class FolderReplaced(RuntimeError):
    """The index folder at the writer's path is no longer the generation it serves (removed, or another copied
    there): a compaction would read a folder that is gone and swap its result over another's. It stays so until
    the writer is restarted."""


@dataclass(frozen=True)
class CompactionReport:
    index_dir: Path
    folded: int  # the last write folded in
    written: int  # live written passages moved into the generation
    removed: int  # rows of the old generation deleted or replaced
    count: int
    generation: str
    seconds: float
    merged: bool  # the writes merged into the rows, or sealed beside them

    def summary(self) -> str:
        how = "merged" if self.merged else "sealed"
        return (f"{how} writes 1..{self.folded} into {self.index_dir} (generation {self.generation}): "
                f"{self.written} written passages in, {self.removed} old rows out, {self.count} passages, "
                f"in {self.seconds:.1f} s")


def compact(writes: Writes, progress: bool = False, merge_share: float = 0.0) -> CompactionReport | None:
    """Folds the writes' current segment into a new generation and serves it (see the module): sealed beside the
    rows while it holds less than `merge_share` of them (0: merged always), merged otherwise; None where the
    segment changes nothing. Writes go on meanwhile; those after the segment stay in the new one's segment."""
    with _compacting:
        started = time.perf_counter()
        searcher = writes.searcher
        segment = searcher.segment
        if not segment.changes:
            return None
        index_dir = searcher.index_dir
        _refuse_replaced(searcher)
        work = index_dir.parent / f".{index_dir.name}.compacting"
        if work.exists():  # left by a compaction that was killed: written again
            shutil.rmtree(work)
        work.mkdir()
        manifest = searcher.manifest
        # A format-1 folder or a shard is merged whatever its writes: sealing keeps the folder's format and its
        # shard record, and neither a format-1 reader nor `merge` of shards would see the writes.
        merged = (segment.size >= merge_share * manifest.count or manifest.format_version == format_upgrade.OLDEST
                  or manifest.shard is not None)
        try:
            if merged:
                count = _write(work, searcher, progress)
            else:
                count = _seal(work, searcher, writes.log.records)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        index_writer.move_into_place(work, index_dir)
        fresh = Searcher(index_dir, searcher.encoder, searcher.load)
        writes.rebase(fresh)
        return CompactionReport(index_dir, segment.seq, segment.written, segment.hidden_count, count,
                                generation_id(fresh.manifest), time.perf_counter() - started, merged)


def _refuse_replaced(searcher: Searcher) -> None:
    """FolderReplaced where `searcher`'s folder (held open: retrieval.pinned) is not the one at its path."""
    if replaced(os.stat(searcher.dense.pinned.root), searcher.index_dir):
        raise FolderReplaced(f"{searcher.index_dir} is no longer the folder this writer loaded (removed or replaced "
                             "under it): nothing compacted; restart the writer")


def _seal(work: Path, searcher: Searcher, logged: list[Record]) -> int:
    """The new generation in `work`: the served one's files linked (retrieval.index_writer.link_generation), its
    sealed writes followed by the `logged` records its segment added (those after its write_sequence, up to the
    segment's), and the manifest listing them; its passage count."""
    segment, manifest, pinned = searcher.segment, searcher.manifest, searcher.dense.pinned
    added = [record for record in logged if manifest.write_sequence < record.seq <= segment.seq]
    if [record.seq for record in added] != list(range(manifest.write_sequence + 1, segment.seq + 1)):
        raise RuntimeError(f"the log holds writes {[record.seq for record in added]}, not every one after "
                           f"{manifest.write_sequence} up to {segment.seq}: nothing sealed")
    index_writer.link_generation(pinned.root, work)
    earlier = pinned.path(SEALED_WRITES_FILE) if manifest.sealed_writes else None
    write_records(work / SEALED_WRITES_FILE, added, after=earlier)
    update = {"files": {**manifest.files, SEALED_WRITES_FILE: file_record(work / SEALED_WRITES_FILE)},
              "sealed_writes": manifest.sealed_writes + len(added), "write_sequence": segment.seq,
              "format_version": SEALED_WRITES_FORMAT, "built_at": index_writer.now()}
    write_json_atomic(work / MANIFEST_FILE, sealed(manifest.model_copy(update=update)))
    return segment.count


def _write(work: Path, searcher: Searcher, progress: bool) -> int:
    """The new generation in `work`: passages, vectors, the manifest, the structures; its passage count."""
    segment, manifest = searcher.segment, searcher.manifest
    base, written = segment.collection()
    store = index_writer.open_store(work)
    try:
        for start in range(0, len(base), BLOCK):
            rows = base[start:start + BLOCK].tolist()
            index_writer.insert_passages(store, [
                (start + i, pid, text, line, encode_fields(fields)) for i, ((pid, text, line), fields)
                in enumerate(zip(searcher.passages.records(rows), searcher.passages.fields(rows)))])
        index_writer.insert_passages(store, [
            (len(base) + i, passage.id, passage.text, 0, encode_fields(passage.fields))  # line 0: from no corpus
            for i, passage in enumerate(segment.passages[position] for position in written)])
    finally:
        store.close()
    stored = faiss.read_index(str(searcher.dense.pinned.path(INDEX_FILE)), faiss.IO_FLAG_MMAP_IFC)
    parts = (stored.reconstruct_batch(base[start:start + BLOCK]) for start in range(0, len(base), BLOCK))
    if len(written):
        parts = itertools.chain(parts, [segment.vectors[written]])
    count = index_writer.write_vectors(work, parts, manifest.dimension)
    corpus = manifest.corpus.model_copy(update={"passages": count, "sha256": None})  # no longer one file's
    bm25_from = None
    if manifest.bm25 is not None:  # from the terms held: no passage tokenized again
        base_terms, source = searcher.base_terms(), searcher.dense.pinned.path(BM25_DIR)
        bm25_from = lambda folder: bm25_changes.write_compacted(base_terms, segment, source, folder)  # noqa: E731
    index_writer.write_manifest(work, encoder=manifest.encoder, corpus=corpus, count=count,
                                bm25=manifest.bm25 is not None, write_sequence=segment.seq, bm25_from=bm25_from)
    removed = np.zeros(0, dtype=np.int64) if segment.hidden is None else np.flatnonzero(segment.hidden)
    added = segment.vectors[written] if len(written) else np.zeros((0, manifest.dimension), dtype=np.float32)
    rebuild = len(removed) + len(added) > REBUILD_SHARE * max(manifest.count, 1)
    for record in manifest.candidates:
        loaded = searcher.structures.get(record.kind)
        started = time.perf_counter()
        extended = None if rebuild or loaded is None else structures.extended(loaded, removed, added)
        if extended is None:
            index_writer.write_candidates(work, record.kind, record.params, depth=record.depth, sample=record.sample,
                                          progress=progress)
        else:
            index_writer.write_structure(work, extended, time.perf_counter() - started, sample=record.sample)
    return count
