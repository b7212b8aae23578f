"""Loading one generation of an index folder, as the Searcher and a shard (retrieval.sharding.ShardIndex) both
do: the folder pinned (retrieval.pinned), its manifest read and checked, then its passages, its dense side,
where asked its BM25 index, and the writes sealed beside its rows, every file opened through the pin while it
loads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from retrieval.bm25_index import BM25_DIR, Bm25Index
from retrieval.dense import DenseIndex, read_index_manifest
from retrieval.index_format import PASSAGES_FILE, SEALED_WRITES_FILE, IndexFormatError, Manifest, generation_id
from retrieval.load_options import LoadOptions
from retrieval.passage_store import PassageStore
from retrieval.pinned import PinnedFolder
from retrieval.write_log import LogCorrupt, Record, read


@dataclass(frozen=True)
class Generation:
    manifest: Manifest
    passages: PassageStore
    dense: DenseIndex
    bm25: Bm25Index | None
    sealed: list[Record]  # the writes sealed beside its rows (Manifest.sealed_writes), in order

    @property
    def generation_id(self) -> str:
        return generation_id(self.manifest)


def load_generation(index_dir: Path, load: LoadOptions, *, before_vectors: Callable[[Manifest], None] | None = None,
                    bm25: bool = False) -> Generation:
    """The generation `index_dir` holds now; `before_vectors` sees its manifest before the vectors load (to refuse
    a foreign encoder without reading them); `bm25`: load its BM25 index, where it has one."""
    pinned = PinnedFolder(index_dir)
    with pinned.reading():
        manifest = read_index_manifest(pinned.root, load)
        if before_vectors is not None:
            before_vectors(manifest)
        passages = PassageStore(pinned.path(PASSAGES_FILE), manifest.format_version)
        dense = DenseIndex.load(pinned, manifest, passages, load)
        lexical = Bm25Index(pinned.path(BM25_DIR)) if bm25 and manifest.bm25 is not None else None
        sealed = _sealed_writes(pinned.path(SEALED_WRITES_FILE), manifest) if manifest.sealed_writes else []
    return Generation(manifest, passages, dense, lexical, sealed)


def _sealed_writes(path: Path, manifest: Manifest) -> list[Record]:
    """The records of `path`, which must be whole and be the manifest's sealed writes: as many, the last its
    write_sequence."""
    try:
        records, end = read(path)
    except LogCorrupt as error:
        raise IndexFormatError(str(error)) from None
    last = records[-1].seq if records else None
    if end != path.stat().st_size or len(records) != manifest.sealed_writes or last != manifest.write_sequence:
        raise IndexFormatError(f"{path}: {len(records)} whole records ending at byte {end} of {path.stat().st_size}, "
                               f"the last write {last}; the manifest says {manifest.sealed_writes} sealed writes "
                               f"through write {manifest.write_sequence}")
    return records
