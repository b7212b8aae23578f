"""Memory-mapped CPU indexes (SEARCH_INDEX_MMAP): the same answers as an index read into memory,
without a copy of the vectors in the process."""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import faiss
import numpy as np
import pytest

from retrieval import dense_index
from retrieval.index_format import INDEX_FILE
from retrieval.load_options import LoadOptions
from retrieval.searcher import Searcher
from tests.conftest import CPU


def private_resident_bytes() -> int:
    """The process's private resident memory (Linux's RssAnon): the pages of a file mapped from the
    page cache count as RssFile instead, shared with every process that maps the same file.

    glibc's free heap is handed back first (malloc_trim): freed memory that earlier tests left resident
    would otherwise take a new copy without RssAnon growing (seen after the SmolLM2 test)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.fixture(scope="module")
def query_vectors(encoder, demo_queries) -> np.ndarray:
    return encoder.encode_queries(list(demo_queries.values()))


def test_memory_mapped_index_answers_exactly_as_an_in_memory_one(small_index, encoder, demo_queries, query_vectors):
    in_memory = Searcher(small_index, encoder, load=CPU)
    mapped = Searcher(small_index, encoder, load=LoadOptions(device="cpu", mmap=True))
    queries = list(demo_queries.values())
    for k in (10, mapped.count):  # k = all: every passage ranked, so every stored vector is compared
        expected = in_memory.hits(in_memory.rank(queries, query_vectors, in_memory.request(k)))
        assert mapped.hits(mapped.rank(queries, query_vectors, mapped.request(k))) == expected  # ids, texts, ranks, scores
        for exact, got in zip(dense_index.search(in_memory.index, query_vectors, k),
                              dense_index.search(mapped.index, query_vectors, k)):
            assert np.array_equal(exact, got)  # scores bit for bit, rows in the same order


def test_memory_mapped_index_keeps_its_vectors_in_the_file_not_the_process(tmp_path):
    rows, dimension = 65_536, 384
    vector_bytes = rows * dimension * 4  # 96 MiB
    written = dense_index.new_flat_index(dimension)
    written.add(np.random.default_rng(0).standard_normal((rows, dimension), dtype=np.float32))
    path = tmp_path / INDEX_FILE
    faiss.write_index(written, str(path))
    del written
    probe = np.random.default_rng(1).standard_normal((8, dimension), dtype=np.float32)

    before = private_resident_bytes()
    mapped = dense_index.load_index(path, "cpu", mmap=True)
    dense_index.search(mapped, probe, 100)  # touches every vector
    mapped_growth = private_resident_bytes() - before

    before = private_resident_bytes()
    loaded = dense_index.load_index(path, "cpu")
    loaded_growth = private_resident_bytes() - before

    assert not mapped.codes.is_owned and loaded.codes.is_owned  # a view of the mapping, against a copy
    assert loaded_growth > 0.9 * vector_bytes  # the measure sees a copy where there is one
    assert mapped_growth < 0.1 * vector_bytes, f"mapping grew private memory by {mapped_growth / 2**20:.0f} MiB"
    assert np.array_equal(dense_index.search(mapped, probe, 100)[1], dense_index.search(loaded, probe, 100)[1])


def read_syscall_bytes() -> int:
    """Bytes this process has read through read() calls (rchar), page cache hits included."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_a_mapped_index_is_read_once_in_the_background_so_first_searches_do_not_fault_it_in(tmp_path):
    path = tmp_path / INDEX_FILE
    written = dense_index.new_flat_index(64)
    written.add(np.random.default_rng(0).standard_normal((40_000, 64), dtype=np.float32))  # 10 MiB
    faiss.write_index(written, str(path))
    prefetching = [thread for thread in threading.enumerate() if thread.name == "index-prefetch"]
    for thread in prefetching:  # other tests' mapped indexes: done before this one is measured
        thread.join(timeout=60)
    before = read_syscall_bytes()
    dense_index.load_index(path, "cpu", mmap=True)
    for thread in threading.enumerate():
        if thread.name == "index-prefetch" and thread not in prefetching:
            thread.join(timeout=60)
    assert read_syscall_bytes() - before >= path.stat().st_size  # faiss alone reads ~100 bytes of a mapped file
    assert dense_index.prefetch(path) is True
    assert dense_index.prefetch(tmp_path / "missing.faiss") is False  # only a speed-up: never an error


def test_fp16_is_ignored_on_the_cpu(small_index, query_vectors):
    plain = dense_index.load_index(small_index / INDEX_FILE, "cpu")
    fp16 = dense_index.load_index(small_index / INDEX_FILE, "cpu", fp16=True)  # GPU storage only
    for exact, got in zip(dense_index.search(plain, query_vectors, 10), dense_index.search(fp16, query_vectors, 10)):
        assert np.array_equal(exact, got)
