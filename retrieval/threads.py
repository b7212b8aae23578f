"""How many OpenMP threads one FAISS search runs on, chosen per call: a single query (or a batch too small to
share) runs on one, since a second thread does not speed one query up and, on a busy host, waiting for it to be
scheduled costs several times the work (bench/threads.py, docs/benchmarks.md#threads-faiss-threads-per-search:
at 200k vectors a batch of two already gains from a second core, through every structure and the flat scan).
OpenMP's thread count is the calling thread's own, so concurrent searches on other threads (the service's model
thread, a shard's actor) each choose theirs."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import faiss

# A search of fewer query x row products than this runs on one thread whatever its batch (a few milliseconds
# of a flat scan on one core; a structure reads fewer rows than its index holds).
ONE_THREAD_PRODUCTS = 1_000_000

CORES = faiss.omp_get_max_threads()  # read at import: the process's own setting (OMP_NUM_THREADS)


def search_threads(queries: int, rows: int) -> int:
    """The threads a search of `queries` vectors over an index of `rows` rows takes, flat or through a structure."""
    return 1 if queries == 1 or queries * rows < ONE_THREAD_PRODUCTS else CORES


@contextmanager
def faiss_threads(threads: int) -> Iterator[None]:
    """FAISS's searches on this thread run on `threads` OpenMP threads inside the block (never more than the
    thread's count outside it: a caller that set fewer keeps its cap)."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(max(1, min(threads, before)))
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)
