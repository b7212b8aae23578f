"""Merge the indexes of `build --shard i/N` jobs into the index one unsharded build makes.

Each shard holds its rows in corpus line order (a build streams the file), so a
k-way merge on the corpus line stored in `passages.sqlite` restores the order
an unsharded build stores them in: the merged index equals it row for row.
The merge runs in a sibling folder `.NAME.merging/` that is renamed into place
at the end, like a build, so `--out` is always a whole index, and it holds
`--out`'s lock as a build does (`index_builder.out_lock`). Unless --no-bm25, the
merged index's BM25 is built over all the passages (its statistics are
corpus-wide, so shard BM25 indexes cannot simply be joined).
"""

from __future__ import annotations

import heapq
import shutil
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import faiss
import numpy as np
from tqdm import tqdm

from index_builder.errors import BuildError
from retrieval import out_lock
from retrieval import format_upgrade, index_writer
from retrieval.fields import merged_types
from retrieval.index_format import INDEX_FILE, PASSAGES_FILE, Manifest, read_manifest
from retrieval.sharding import check_shard_set

INSERT_BATCH = 2048


@dataclass
class MergeReport:
    out: Path
    shards: int
    passages: int
    skipped: int
    seconds: float

    def summary(self) -> str:
        return (
            f"merged {self.shards} shards into {self.out}: {self.passages} passages "
            f"({self.skipped} bad lines skipped) in {self.seconds:.1f} s"
        )


def merge_shards(directories: Sequence[Path], out: Path, overwrite: bool = False, bm25: bool = True) -> MergeReport:
    """Merge shard index directories (any order) into `out` (with `bm25`, a BM25 index over all its passages);
    BuildError says why they cannot be merged, or that another build or merge is writing `out`."""
    with out_lock.hold(out, "merge"):
        return _merge(directories, out, overwrite, bm25)


def _merge(directories: Sequence[Path], out: Path, overwrite: bool, bm25: bool) -> MergeReport:
    started = time.perf_counter()
    if out.exists() and not overwrite:
        raise BuildError(f"{out} already exists; pass --overwrite to replace it")
    index_writer.check_replaceable(out)
    shards = _check_shards(directories)
    work = out.parent / f".{out.name}.merging"
    if work.exists():  # left by a merge that crashed; a merge does not resume
        shutil.rmtree(work)
    work.mkdir(parents=True)
    try:
        count = sum(manifest.count for _, manifest in shards)
        if count == 0:
            raise BuildError("the shards hold no passages")
        with tqdm(total=count, desc="merging", unit=" passages") as progress:
            destinations = _merge_passages(shards, work, progress)
        _merge_vectors(shards, destinations, work)
        first = shards[0][1]
        index_writer.write_manifest(
            work,
            encoder=first.encoder,
            corpus=first.corpus.model_copy(
                update={"passages": count, "skipped": sum(m.corpus.skipped for _, m in shards)}
            ),
            count=count,
            bm25=bm25,
        )
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    index_writer.move_into_place(work, out)
    return MergeReport(out, len(shards), count, sum(m.corpus.skipped for _, m in shards), time.perf_counter() - started)


def _check_shards(directories: Sequence[Path]) -> list[tuple[Path, Manifest]]:
    """(directory, manifest) of each shard, ordered by shard index, once they are known to fit together
    (the check sharded serving makes too: retrieval.sharding.check_shard_set)."""
    if not directories:
        raise BuildError("no shard directories given")
    manifests = [read_manifest(directory, verify_checksums=True) for directory in directories]
    for directory, manifest in zip(directories, manifests):
        if manifest.sealed_writes:  # a merge reads the rows alone
            raise BuildError(f"{directory} holds {manifest.sealed_writes} writes over HTTP sealed beside its rows, "
                             f"which a merge of the rows would lose: python -m index_builder compact --index "
                             f"{directory} first")
    try:
        shards = check_shard_set([(str(directory), manifest) for directory, manifest in zip(directories, manifests)])
        merged_types([(str(directory), manifest.fields) for directory, manifest in zip(directories, manifests)])
    except ValueError as error:
        raise BuildError(str(error)) from None
    by_index = {shard.index: (directory, manifest) for shard, directory, manifest in zip(shards, directories, manifests)}
    return [by_index[i] for i in range(len(by_index))]


def _rows(connection: sqlite3.Connection, number: int) -> Iterator[tuple[int, int, int, str, str, str | None]]:
    """(line, shard number, row, id, text, fields) of one shard, in row order, which a build makes line order."""
    rows = connection.execute("SELECT row, id, text, line, fields FROM passages ORDER BY row")
    for row, pid, text, line, stored in rows:
        yield line, number, row, pid, text, stored


def _merge_passages(shards: list[tuple[Path, Manifest]], work: Path, progress: tqdm) -> list[np.ndarray]:
    """Every shard's passages into `work`'s store in corpus line order; per shard, the merged row of each of its rows."""
    directories = [directory for directory, _ in shards]
    connections = [sqlite3.connect(f"{(d / PASSAGES_FILE).resolve().as_uri()}?mode=ro", uri=True) for d in directories]
    for connection, (_, manifest) in zip(connections, shards):
        format_upgrade.passages(connection, manifest.format_version)
    store = index_writer.open_store(work)
    try:
        sizes = [c.execute("SELECT COUNT(*) FROM passages").fetchone()[0] for c in connections]
        destinations = [np.empty(size, dtype=np.int64) for size in sizes]
        merged = heapq.merge(*(_rows(connection, number) for number, connection in enumerate(connections)))
        batch: list[tuple[int, str, str, int, str | None]] = []
        previous = (0, 0)
        for merged_row, (line, number, row, pid, text, fields) in enumerate(merged):
            if line == previous[0]:
                raise BuildError(
                    f"line {line} is in both {directories[previous[1]]} and {directories[number]}: "
                    "shards built from different corpora?"
                )
            destinations[number][row] = merged_row
            batch.append((merged_row, pid, text, line, fields))
            previous = (line, number)
            if len(batch) == INSERT_BATCH:
                _insert(store, batch, directories, connections)
                progress.update(len(batch))
                batch = []
        _insert(store, batch, directories, connections)
        progress.update(len(batch))
        return destinations
    finally:
        store.close()
        for connection in connections:
            connection.close()


def _insert(store: sqlite3.Connection, batch: list, directories: list[Path], connections: list) -> None:
    """Add a batch of merged rows; a passage id already stored is a duplicate across shards, named with both."""
    try:
        index_writer.insert_passages(store, batch)
    except sqlite3.IntegrityError:
        for _, pid, *_ in batch:
            holders = [
                f"{directory} (line {found[0]})"
                for directory, connection in zip(directories, connections)
                if (found := connection.execute("SELECT line FROM passages WHERE id = ?", (pid,)).fetchone())
            ]
            if len(holders) > 1:
                raise BuildError(f"duplicate passage id {pid!r} in {' and '.join(holders[:2])}") from None
        raise


def _merge_vectors(shards: list[tuple[Path, Manifest]], destinations: list[np.ndarray], work: Path) -> None:
    """Scatter each shard's vectors to their merged rows (one shard in memory at a time beside the result)."""
    dimension = shards[0][1].dimension
    vectors = np.empty((sum(len(d) for d in destinations), dimension), dtype=np.float32)
    for (directory, _), destination in zip(shards, destinations):
        shard_index = faiss.read_index(str(directory / INDEX_FILE))
        if shard_index.ntotal != len(destination):
            raise BuildError(f"{directory}: {shard_index.ntotal} vectors but {len(destination)} passages")
        vectors[destination] = shard_index.reconstruct_n(0, shard_index.ntotal)
    index_writer.write_vectors(work, [vectors], dimension)
