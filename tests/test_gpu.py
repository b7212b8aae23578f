"""GPU paths: the flat index sharded over every GPU, and fp16 encoding. Run with `pytest -m gpu`;
skipped where torch or faiss sees no GPU (CI never has one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.encoder import BiEncoder
from retrieval import dense_index
from retrieval.index_format import INDEX_FILE
from retrieval.load_options import LoadOptions
from retrieval.searcher import Searcher
from tests.conftest import CPU

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(dense_index.gpu_count() == 0, reason="faiss sees no GPU (faiss-cpu build or no device)"),
]


def test_sharded_gpu_index_returns_the_cpu_results():
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((50_000, 128), dtype=np.float32)
    queries = rng.standard_normal((16, 128), dtype=np.float32)
    cpu = dense_index.new_flat_index(128)
    cpu.add(vectors)
    gpu = dense_index.shard_over_gpus(cpu)
    assert gpu.ntotal == cpu.ntotal
    cpu_scores, cpu_rows = dense_index.search(cpu, queries, 1000)
    gpu_scores, gpu_rows = dense_index.search(gpu, queries, 1000)
    np.testing.assert_allclose(gpu_scores, cpu_scores, rtol=1e-4, atol=1e-3)
    assert (gpu_rows[:, :10] == cpu_rows[:, :10]).mean() > 0.99


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
def test_fp16_encoding_on_gpu_agrees_with_fp32_on_cpu():
    gpu = BiEncoder(device="cuda")
    cpu = BiEncoder(device="cpu")
    assert next(gpu.model.parameters()).dtype == torch.float16
    texts = ["Return the absolute version of a path.", "Join two or more pathname components. " * 10]
    np.testing.assert_allclose(gpu.encode_passages(texts), cpu.encode_passages(texts), atol=5e-3)


def test_searcher_on_gpu_equals_searcher_on_cpu(small_index):
    on_gpu = Searcher(small_index, load=LoadOptions(device="cuda"))
    on_cpu = Searcher(small_index, load=CPU)
    query = "Evaluate an expression node or a string containing only a Python expression."
    assert [h.id for h in on_gpu.search(query, 10)][:5] == [h.id for h in on_cpu.search(query, 10)][:5]


def test_fp16_storage_returns_the_fp32_top_10_with_scores_within_1e_3(small_index, encoder, demo_queries):
    """SEARCH_GPU_FP16 against fp32 on the CPU, for the same query vectors. Two hits whose fp32 scores
    lie closer than fp16 can tell apart may swap (measured on the CPU, rounding vectors and queries to
    fp16: scores within 1e-4, and 5 of 400 demo queries reorder such a near tie), so each hit must
    hold an fp32 score within 1e-3 of its rank's."""
    vectors = encoder.encode_queries(list(demo_queries.values()))
    exact = dense_index.load_index(small_index / INDEX_FILE, "cpu")
    scores, rows = dense_index.search(exact, vectors, 10)
    every_score = vectors @ exact.reconstruct_n(0, exact.ntotal).T
    # mmap is ignored on a GPU: the copy there reads every vector anyway
    fp16 = Searcher(small_index, encoder, load=LoadOptions(device="cuda", mmap=True, fp16=True))
    half_scores, half_rows = dense_index.search(fp16.index, vectors, 10)
    np.testing.assert_allclose(half_scores, scores, atol=1e-3)
    np.testing.assert_allclose(np.take_along_axis(every_score, half_rows, axis=1), scores, atol=1e-3)
    assert (half_rows == rows).all(axis=1).mean() >= 0.95
