"""The torch flat scan (retrieval.torch_flat), the GPU path that needs no faiss-gpu wheel, answers as the
FAISS flat scan does: the same rows, the same scores within 1e-5, equal scores ordered by row, over any
split of the rows between devices and chunks. Run here on the CPU device; tests/test_gpu.py runs it on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retrieval import dense_index, index_writer
from retrieval.index_format import INDEX_FILE
from retrieval.load_options import LoadOptions
from retrieval.searcher import Searcher
from retrieval.torch_flat import TorchFlatIndex
from tests.conftest import CPU


def clustered(rng: np.random.Generator, rows: int, dimension: int) -> np.ndarray:
    centres = rng.standard_normal((20, dimension), dtype=np.float32)
    vectors = centres[rng.integers(0, 20, rows)] + 0.3 * rng.standard_normal((rows, dimension), dtype=np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def vectors() -> np.ndarray:
    rng = np.random.default_rng(3)
    found = clustered(rng, 6000, 48)
    found[4000:4050] = found[17]  # duplicates of row 17: equal scores, whose order is the rows'
    return found


@pytest.fixture(scope="module")
def flat(vectors):
    index = dense_index.new_flat_index(vectors.shape[1])
    index.add(vectors)
    return index


@pytest.mark.parametrize("devices, budget", [
    (["cpu"], 1 << 30),  # one device, one chunk
    (["cpu", "cpu", "cpu"], 4 * 8 * 700),  # three shards, chunks of 700 rows for 8 queries
])
@pytest.mark.parametrize("k", [1, 10, 60, 1000, 6000, 7000])
def test_the_torch_scan_returns_the_faiss_flat_scans_rows_and_scores(vectors, flat, devices, budget, k):
    index = TorchFlatIndex.of(vectors, devices, score_budget_bytes=budget)
    queries = np.concatenate([vectors[[17, 3, 999]], clustered(np.random.default_rng(9), 5, vectors.shape[1])])
    expected_scores, expected_rows = dense_index.search(flat, queries, k)
    scores, rows = dense_index.search(index, queries, k)
    assert (index.ntotal, index.d) == (flat.ntotal, flat.d)
    assert_same_ranking(scores, rows, expected_scores, expected_rows)


def assert_same_ranking(scores, rows, expected_scores, expected_rows, rounding: float = 1e-6) -> None:
    """The same rows in the same places with scores within 1e-5, but where two rows' scores are closer than
    the two libraries' rounding (a different summation order moves the last bits): there, either order."""
    np.testing.assert_allclose(scores, expected_scores, rtol=0, atol=1e-5)
    for found, expected, expected_at in zip(rows, expected_rows, expected_scores):
        where = {row: position for position, row in enumerate(expected)}
        for position, row in enumerate(found):
            if row != expected[position]:
                other = where.get(row)
                swapped_with = expected_at[other] if other is not None else expected_at[-1]  # past the k-th: a tie there
                assert abs(swapped_with - expected_at[position]) <= rounding, (position, row, expected[position])


def test_equal_scores_are_ordered_by_row_even_where_they_cross_the_kth_place(vectors):
    index = TorchFlatIndex.of(vectors, ["cpu", "cpu"], score_budget_bytes=4 * 1000)
    _, rows = dense_index.search(index, vectors[17][None], 30)
    assert rows[0].tolist() == [17, *range(4000, 4029)]


def test_a_written_index_file_loads_into_the_torch_scan_with_the_same_answers(tmp_path, vectors, flat):
    index_writer.write_vectors(tmp_path, [vectors[:2500], vectors[2500:]], vectors.shape[1])
    loaded = TorchFlatIndex.from_file(tmp_path / INDEX_FILE, ["cpu", "cpu"])
    np.testing.assert_array_equal(loaded.reconstruct_n(2990, 20), vectors[2990:3010])
    assert_same_ranking(*dense_index.search(loaded, vectors[:4], 50), *dense_index.search(flat, vectors[:4], 50))


def test_fp16_rows_keep_the_ranking_within_fp16s_precision(vectors, flat):
    index = TorchFlatIndex.of(vectors, ["cpu"], fp16=True)
    scores, rows = dense_index.search(index, vectors[:8], 10)
    expected_scores, _ = dense_index.search(flat, vectors[:8], 10)
    assert scores.dtype == np.float32
    np.testing.assert_allclose(scores, expected_scores, rtol=0, atol=2e-3)
    assert rows[:, 0].tolist() == list(range(8))


def test_search_parameters_are_refused_since_filters_scan_on_the_cpu(vectors):
    with pytest.raises(ValueError, match="no search parameters"):
        TorchFlatIndex.of(vectors[:10], ["cpu"]).search(vectors[:1], 3, params=object())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
def test_an_index_served_on_cuda_answers_as_on_the_cpu_whatever_faiss_build_is_here(small_index, encoder):
    on_gpu = Searcher(small_index, encoder, load=LoadOptions(device="cuda"))
    on_cpu = Searcher(small_index, encoder, load=CPU)
    queries = ["join two paths", "read a file line by line", "sort a list in place"]
    for gpu_hits, cpu_hits in zip(on_gpu.batch_search(queries, 100), on_cpu.batch_search(queries, 100)):
        assert [hit.id for hit in gpu_hits] == [hit.id for hit in cpu_hits]
        np.testing.assert_allclose([hit.score for hit in gpu_hits], [hit.score for hit in cpu_hits], atol=1e-5)
    if dense_index.gpu_count() == 0:
        assert isinstance(on_gpu.index, TorchFlatIndex)
