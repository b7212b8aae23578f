"""Dense search among the rows a filter matches (retrieval.filters), exactly: the top k of the matching
passages, ranked as the flat search ranks every passage (score, then row), never the top k of everything
then filtered.

How, by the share of the rows the filter matches (a `Restriction`):
- at least POSTFILTER_SHARE of them: the unfiltered exact search read deeper (k / share x POSTFILTER_DEPTH
  rows, in the flat search's order, ties resolved), its matching rows kept; those are the first matching
  rows of the whole ranking, so where k of them are found the answer is exact. A query that finds fewer
  (its best passages are the ones the filter drops) is answered as below. The scan costs what the
  unfiltered one does, where scanning half the rows one by one would cost more than all of them at once.
- fewer: FAISS's own search over the matching rows only (`SearchParameters(sel=IDSelectorArray)`: only
  their vectors are read), faster the fewer they are. A GPU's flat index takes no ID selector: there the
  matching rows are searched on the CPU, in index.faiss memory-mapped when the index loaded (`scan_index`).
- with a candidate structure (retrieval.candidates): where at least STRUCTURE_MIN_SHARE of the rows and
  more than STRUCTURE_MIN_ROWS match, the structure searches with the filter as its ID selector (HNSW skips
  the other rows as results while it walks the graph; the scans skip their codes) and its candidates are
  rescored exactly; a query it finds fewer than k matching rows for is answered exactly. A more selective
  filter is answered exactly: a graph walked with few rows allowed loses recall (HNSW's recall@10 fell
  to 0.7 at 5% on clustered vectors), while the scan of so few rows is cheap.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np

from retrieval import dense_index
from retrieval.candidates import structures
from retrieval.candidates.kind import Structure
from retrieval.fields import FieldColumns
from retrieval.filters import Filter, evaluate

POSTFILTER_SHARE = 0.3
POSTFILTER_DEPTH = 2.0
STRUCTURE_MIN_SHARE = 0.2
STRUCTURE_MIN_ROWS = 20_000
CACHED_FILTERS = 16  # masks kept per index, so a filter repeated (and a plan's answered_by) is not evaluated again


@dataclass
class Restriction:
    """The rows a filter matches: `mask` over every row, `rows` the matching ones, ascending."""

    mask: np.ndarray
    rows: np.ndarray = field(init=False)
    _bitmap: np.ndarray | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.rows = np.flatnonzero(self.mask).astype(np.int64)

    @property
    def count(self) -> int:
        return len(self.rows)

    @property
    def total(self) -> int:
        return len(self.mask)

    @property
    def share(self) -> float:
        return self.count / self.total if self.total else 0.0

    def bitmap(self) -> np.ndarray:
        """The mask as FAISS's IDSelectorBitmap reads it (bit i of byte i // 8, lowest first)."""
        if self._bitmap is None:
            self._bitmap = np.packbits(self.mask, bitorder="little")
        return self._bitmap


class Restrictions:
    """The Restriction of each filter over an index's columns, the last CACHED_FILTERS kept (thread-safe)."""

    def __init__(self, columns: FieldColumns) -> None:
        self.columns = columns
        self._cache: OrderedDict[Filter, Restriction] = OrderedDict()
        self._lock = threading.Lock()

    def of(self, filter: Filter) -> Restriction:
        with self._lock:
            found = self._cache.get(filter)
            if found is not None:
                self._cache.move_to_end(filter)
                return found
        restriction = Restriction(evaluate(filter, self.columns))
        with self._lock:
            self._cache[filter] = restriction
            while len(self._cache) > CACHED_FILTERS:
                self._cache.popitem(last=False)
        return restriction


def scan_index(index: faiss.Index, path: Path) -> faiss.IndexFlat:
    """The flat index whose matching rows a filtered search scans: `index` itself on the CPU; for a GPU index
    (which takes no ID selector) the same file, `path`, memory-mapped now, as it loads, so it holds the very
    vectors served (a file swapped in later is another). Every index has one: rows hidden by writes over HTTP
    (retrieval.segment) restrict a search as a filter does, fields or none."""
    if isinstance(index, faiss.IndexFlat):
        return index
    return faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC)


def through_structure(restriction: Restriction, structure: Structure | None) -> bool:
    """Whether a filtered search with `structure` asked for goes through it (else: exactly)."""
    return (structure is not None and restriction.count > STRUCTURE_MIN_ROWS
            and restriction.share >= STRUCTURE_MIN_SHARE)


def search(index: faiss.Index, vectors: np.ndarray, k: int, restriction: Restriction,
           structure: Structure | None = None, depth: int | None = None,
           scan: faiss.IndexFlat | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(scores, rows), each (len(vectors), min(k, matching rows)): the best matching rows by score, then row.
    Exact unless `through_structure`, where scores are still exact and only recall is approximate. `scan`:
    `scan_index`'s, for a GPU `index`."""
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    k = min(k, restriction.count)
    if k == 0 or len(vectors) == 0:
        return np.zeros((len(vectors), k), dtype=np.float32), np.full((len(vectors), k), -1, dtype=np.int64)
    if through_structure(restriction, structure):
        return _through_structure(structure, index, vectors, k, restriction, depth)
    return exact(index, vectors, k, restriction, scan)


def exact(index: faiss.Index, vectors: np.ndarray, k: int, restriction: Restriction,
          scan: faiss.IndexFlat | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The exact answer (k at most the matching rows): read deeper and filtered where most rows match, else
    (and for a query that found too few that way) a search of the matching rows only."""
    if restriction.count == restriction.total:  # every row matches: the unfiltered search
        return dense_index.search(index, vectors, k)
    scores = np.full((len(vectors), k), -np.inf, dtype=np.float32)
    rows = np.full((len(vectors), k), -1, dtype=np.int64)
    short = np.ones(len(vectors), dtype=bool)
    if restriction.share >= POSTFILTER_SHARE and k < restriction.count:
        fetch = min(restriction.total, math.ceil(k * POSTFILTER_DEPTH / restriction.share) + 16)
        if not isinstance(index, faiss.IndexFlat):
            fetch = min(fetch, dense_index.GPU_MAX_K)
        found_scores, found_rows = dense_index.search(index, vectors, fetch)
        for query, (row_list, score_list) in enumerate(zip(found_rows, found_scores)):
            keep = (row_list >= 0) & restriction.mask[np.maximum(row_list, 0)]
            if np.count_nonzero(keep) >= k:
                rows[query], scores[query] = row_list[keep][:k], score_list[keep][:k]
                short[query] = False
    if np.any(short):
        scores[short], rows[short] = _among(index if scan is None else scan, vectors[short], k, restriction)
    return scores, rows


def _among(index: faiss.IndexFlat, vectors: np.ndarray, k: int,
           restriction: Restriction) -> tuple[np.ndarray, np.ndarray]:
    """The search of the matching rows only (k at most their count), on the CPU."""
    selector = faiss.IDSelectorArray(restriction.count, faiss.swig_ptr(restriction.rows))
    params = faiss.SearchParameters(sel=selector)
    return dense_index.search(index, vectors, k, params=params, allowed=restriction.count)


def _through_structure(structure: Structure, index: faiss.Index, vectors: np.ndarray, k: int,
                       restriction: Restriction, depth: int | None) -> tuple[np.ndarray, np.ndarray]:
    bitmap = restriction.bitmap()
    selector = faiss.IDSelectorBitmap(restriction.total, faiss.swig_ptr(bitmap))
    depth = min(max(k, depth or structure.depth), restriction.count)
    proposed = structures.candidates(structure, vectors, depth, selector=selector)
    proposed[(proposed >= 0) & ~restriction.mask[np.maximum(proposed, 0)]] = -1  # a selector keeps none; to be sure
    scores, rows = structures.rescore(index, vectors, proposed, k)
    short = np.any(rows < 0, axis=1)  # fewer than k matching rows found: exactly, then
    if np.any(short):
        scores[short], rows[short] = exact(index, vectors[short], k, restriction)
    return scores, rows
