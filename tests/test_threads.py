"""FAISS threads chosen per search: a single query or a small batch runs on one OpenMP thread, a big batch on
every core, and the choice is the calling thread's alone, so concurrent searches do not change each other's."""

from __future__ import annotations

import threading

import faiss
import pytest

from retrieval.threads import CORES, ONE_THREAD_PRODUCTS, faiss_threads, search_threads


def test_a_single_query_runs_on_one_thread_however_large_the_index():
    assert search_threads(1, 100_000_000) == 1


def test_a_batch_runs_on_every_core_unless_too_small_to_share():
    assert search_threads(2, 5_000_000) == CORES
    assert search_threads(64, ONE_THREAD_PRODUCTS // 64 - 1) == 1  # a batch over a tiny index


def test_the_thread_count_is_the_calling_threads_own_and_restored_after_the_block():
    before = faiss.omp_get_max_threads()
    seen = {}

    def other() -> None:
        seen["other"] = faiss.omp_get_max_threads()

    with faiss_threads(1):
        assert faiss.omp_get_max_threads() == 1
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
    assert seen["other"] == before and faiss.omp_get_max_threads() == before
    with pytest.raises(RuntimeError), faiss_threads(1):
        raise RuntimeError("a failed search")
    assert faiss.omp_get_max_threads() == before


def test_a_caller_that_set_fewer_threads_keeps_its_cap():
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        with faiss_threads(CORES):
            assert faiss.omp_get_max_threads() == 1
    finally:
        faiss.omp_set_num_threads(before)
