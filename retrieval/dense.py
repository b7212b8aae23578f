"""The dense side of one index generation: its exact vectors and what searches them (its candidate structures,
its fields' columns, the flat scan a filtered search reads), loaded once and searched through one `search`,
by the Searcher and by a shard (retrieval.sharding.ShardIndex) alike."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np

from retrieval import dense_index, filtered_search
from retrieval.candidates import structures
from retrieval.candidates.kind import Structure
from retrieval.candidates.registry import KINDS
from retrieval.index_format import INDEX_FILE, PASSAGES_FILE, IndexFormatError, Manifest, candidates_file, read_manifest
from retrieval.load_options import LoadOptions
from retrieval.passage_store import PassageStore
from retrieval.pinned import PinnedFolder
from retrieval.threads import faiss_threads, search_threads

Ranked = list[list[tuple[int, float]]]  # (row, score) per query, best first


def ranked(scores: np.ndarray, rows: np.ndarray) -> Ranked:
    """FAISS's (scores, rows) as (row, score) lists, the -1 rows past the last hit dropped."""
    return [[(r, s) for r, s in zip(row, score) if r >= 0] for row, score in zip(rows.tolist(), scores.tolist())]


def structures_served(device: str) -> bool:
    """Whether an index searched on `device` loads its candidate structures: on the CPU only, since a GPU
    scans every vector faster than a CPU structure proposes candidates. A GPU asked for that neither faiss
    nor torch can use counts as the CPU here: dense_index.load_index says so, after the manifest's checks."""
    try:
        return not dense_index.stays_on_gpu(device)
    except RuntimeError:
        return True


def read_index_manifest(index_dir: Path, load: LoadOptions) -> Manifest:
    """The index's manifest (index_format.read_manifest), with every file's checksum checked here (where
    `load.verify_checksums`) but those `DenseIndex.load` checks from the bytes it loads: index.faiss, and the
    structures loaded on `load.device`."""
    structure_files = tuple(candidates_file(kind) for kind in KINDS) if structures_served(load.device) else ()
    return read_manifest(index_dir, verify_checksums=load.verify_checksums,
                         hashed_on_load=(INDEX_FILE, *structure_files))


def check_rows(index_dir: Path, manifest: Manifest, index, passages: PassageStore) -> None:
    """IndexFormatError unless the manifest, the FAISS index and the passage store agree on the rows
    (count, and rows 0 .. count - 1) and the vectors' dimension: a mismatch would serve short lists or 500s."""
    if index.d != manifest.dimension:
        raise IndexFormatError(f"{index_dir}: {INDEX_FILE} holds {index.d}-d vectors, the manifest says "
                               f"{manifest.dimension}-d")
    stored, low, high = passages.row_range()
    if not manifest.count == index.ntotal == stored or (stored and (low, high) != (0, stored - 1)):
        raise IndexFormatError(
            f"{index_dir}: the manifest counts {manifest.count} passages, {INDEX_FILE} holds {index.ntotal} "
            f"vectors and {PASSAGES_FILE} {stored} rows ({low} .. {high}); they must agree, rows 0 .. count - 1"
        )


def pick_structure(structures: dict[str, Structure], exact: bool = False,
                   structure: str | None = None) -> Structure | None:
    """The structure a search answers through: None where `exact` or none is loaded, else `structure`'s
    kind (default: the first loaded); ValueError naming those loaded for a kind that is not."""
    if structure is not None and structure not in structures:
        raise ValueError(f"structure {structure!r} is not loaded (loaded: {', '.join(structures) or 'none'})")
    if exact or not structures:
        return None
    return structures[structure] if structure is not None else next(iter(structures.values()))


def check_candidates(depth: int | None) -> None:
    """ValueError unless `depth`, the candidates rescored per query, is None or within 1 .. MAX_CANDIDATES."""
    if depth is not None and not 1 <= depth <= structures.MAX_CANDIDATES:
        raise ValueError(f"candidates must be between 1 and {structures.MAX_CANDIDATES}, got {depth}")


class DenseIndex:
    """`index`: the exact vectors (faiss's flat index, on the CPU or a GPU, or torch's: retrieval.torch_flat);
    `structures`: the candidate structures loaded, by kind in the manifest's order (none on a GPU);
    `restrictions`: each filter's matching rows over the fields' columns (retrieval.filtered_search);
    `scan`: the flat index a filtered search scans (the vectors themselves on the CPU)."""

    def __init__(self, index, structures: dict[str, Structure],
                 restrictions: filtered_search.Restrictions, scan: faiss.IndexFlat | None, count: int,
                 pinned: PinnedFolder | None = None) -> None:
        self.index, self.structures, self.restrictions, self.scan, self.count = (
            index, structures, restrictions, scan, count)
        self.pinned = pinned  # held while the index is: the vectors' prefetch reads through it after the load

    @classmethod
    def load(cls, pinned: PinnedFolder, manifest: Manifest, passages: PassageStore, load: LoadOptions) -> "DenseIndex":
        """The dense side of the generation `pinned` holds, whose manifest `read_index_manifest` read and whose
        passages `passages` are: the rows agree (check_rows), and each structure listed is the one of these
        vectors, its file checked from the bytes read where `load.verify_checksums` (structures.load); `load`'s
        `mmap` and `fp16`: see dense_index.load_index. IndexFormatError says what is wrong."""
        records = manifest.candidates if structures_served(load.device) else []
        files, verify = manifest.files, load.verify_checksums
        index = dense_index.load_index(pinned.path(INDEX_FILE), load.device, fp16=load.fp16,
                                       mmap=load.mmap if load.mmap is not None else bool(records),
                                       expected=files[INDEX_FILE] if verify else None)
        check_rows(pinned.root, manifest, index, passages)
        loaded = {record.kind: structures.load(pinned.path(record.file), record, index,
                                               files[record.file] if verify else None)
                  for record in records}
        restrictions = filtered_search.Restrictions(passages.field_columns(manifest.fields, manifest.count))
        scan = filtered_search.scan_index(index, pinned.path(INDEX_FILE))
        return cls(index, loaded, restrictions, scan, manifest.count, pinned)

    def search(self, vectors: np.ndarray, k: int, restriction: filtered_search.Restriction | None = None,
               structure: Structure | None = None, depth: int | None = None) -> Ranked:
        """The best min(k, rows) rows per query vector with their exact scores: among the rows `restriction`
        keeps (None: all), through `structure`'s `depth` candidates (None: the exact scan; see
        retrieval.candidates.structures and retrieval.filtered_search for when a restricted search uses it)."""
        return ranked(*self.search_arrays(vectors, k, restriction, structure, depth))

    def search_arrays(self, vectors: np.ndarray, k: int, restriction: filtered_search.Restriction | None = None,
                      structure: Structure | None = None, depth: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """`search`'s answer as FAISS gives it: (scores, rows), a line per query vector, row -1 past the last hit."""
        k = min(k, self.count)
        rows_read = self.count if restriction is None else restriction.count
        with faiss_threads(search_threads(len(vectors), rows_read)):
            if restriction is not None:
                return filtered_search.search(self.index, vectors, k, restriction, structure, depth, self.scan)
            if structure is None or k == 0:
                return dense_index.search(self.index, vectors, k)
            return structures.search(structure, self.index, vectors, k, depth)
