"""How many OpenMP threads one FAISS search runs on, chosen per call: a single query or a small batch runs on
one, since on a busy host waiting for a second thread to be scheduled costs more than the work it takes
over; a batch big enough to share runs on every core. OpenMP's thread count is the calling thread's own, so
concurrent searches on other threads (the service's model thread, a shard's actor) each choose theirs. The
crossovers (each candidate kind's `one_thread_queries`, ONE_THREAD_PRODUCTS) are bench/threads.py's
(docs/benchmarks.md#threads-faiss-threads-per-search)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import faiss

from retrieval.candidates.registry import KINDS

# A flat scan (and a structure's exact rescoring) of fewer query x row products than this runs on one thread.
ONE_THREAD_PRODUCTS = 4_000_000

CORES = faiss.omp_get_max_threads()  # read at import: the process's own setting (OMP_NUM_THREADS)


def search_threads(queries: int, rows: int, kind: str | None = None) -> int:
    """The threads a search of `queries` vectors over `rows` rows takes, through structure `kind` (None: the
    flat scan)."""
    if kind is None:
        return 1 if queries * rows < ONE_THREAD_PRODUCTS else CORES
    return 1 if queries <= KINDS[kind].one_thread_queries else CORES


@contextmanager
def faiss_threads(threads: int) -> Iterator[None]:
    """FAISS's searches on this thread run on `threads` OpenMP threads inside the block."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(max(1, min(threads, CORES)))
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)
