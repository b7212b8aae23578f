"""FAISS threads chosen per search: a single query or a small batch runs on one OpenMP thread, a big batch on
every core, and the choice is the calling thread's alone, so concurrent searches do not change each other's."""

from __future__ import annotations

import threading

import faiss
import pytest

from retrieval.candidates.registry import KINDS
from retrieval.threads import CORES, ONE_THREAD_PRODUCTS, faiss_threads, search_threads


def test_a_single_query_through_any_structure_runs_on_one_thread():
    for kind in KINDS:
        assert search_threads(1, 5_000_000, kind) == 1


def test_a_batch_of_64_through_a_structure_runs_on_every_core():
    for kind in KINDS:
        assert search_threads(64, 5_000_000, kind) == CORES


def test_the_flat_scan_runs_on_one_thread_below_its_work_threshold_and_on_every_core_above():
    assert search_threads(1, ONE_THREAD_PRODUCTS - 1) == 1
    assert search_threads(64, ONE_THREAD_PRODUCTS) == CORES


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
