"""Builder throughput against a plain encode loop, and exact-search latency against the memory bound.

    python bench/build.py [--passages 600] [--sizes 100000 1000000] [--queries 20] [--device cpu]

Part 1 encodes the same passages of the shipped demo corpus twice with the same model: once
through the index builder (length-sorted batches, chunked, stored) and once with a plain loop
(batches in file order, padded to the longest in each), and prints the ratio.
Part 2 searches k=1000 over random 384-d vectors in a FAISS flat inner-product index, one query
at a time and in batches of 64, beside the time it takes just to read the vectors once from
memory at a bandwidth measured in the same run. With `--device cuda` the encoder runs in fp16 on
the GPU and the index is sharded over every GPU as the service does (the CPU bounds are not
printed then).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from index_builder.build import BuildOptions, build_index  # noqa: E402
from models.encoder import BiEncoder  # noqa: E402
from retrieval import dense_index  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "data" / "demo" / "corpus.tsv"


def plain_encode(encoder: BiEncoder, texts: list[str], batch_size: int) -> np.ndarray:
    """The baseline: file order, each batch padded to its longest passage, same pooling."""
    out = []
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            batch = encoder.tokenizer(texts[start : start + batch_size], padding=True, truncation=True,
                                      max_length=encoder.spec.passage_max_tokens, return_tensors="pt")
            out.append(encoder._embed(batch["input_ids"], batch["attention_mask"], encoder.spec.passage_segment_id))
    return np.concatenate(out)


def bench_builder(passages: int, batch_size: int, device: str) -> None:
    encoder = BiEncoder(device=device, batch_size=batch_size)
    lines = DEMO.read_text(encoding="utf-8").splitlines()[:passages]
    texts = [line.split("\t", 1)[1] for line in lines]
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.tsv"
        corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
        plain_encode(encoder, texts[:batch_size], batch_size)  # warm-up
        started = time.perf_counter()
        plain = plain_encode(encoder, texts, batch_size)  # returns numpy: the device has finished
        plain_rate = len(texts) / (time.perf_counter() - started)
        started = time.perf_counter()
        report = build_index(BuildOptions(corpus, Path(tmp) / "index", chunk_size=1024), encoder)
        build_rate = report.passages / (time.perf_counter() - started)
    assert plain.shape == (len(texts), encoder.dimension)
    print(f"\n{'encoder':<32}{'passages/s':>12}")
    print(f"{'plain loop (file order)':<32}{plain_rate:>12.1f}")
    print(f"{'index builder (sorted, stored)':<32}{build_rate:>12.1f}")
    print(f"builder / plain = {build_rate / plain_rate:.2f}x  ({len(texts)} demo passages, batch {batch_size}, "
          f"{device_label(encoder.device)})")


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, fp16"
    return f"CPU, {torch.get_num_threads()} threads"


def read_bandwidth() -> float:
    """Bytes/s for a streaming read+write copy of 1 GiB (counts both directions), best of 3."""
    source = np.ones(1 << 28, dtype=np.float32)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - started)
    return 2 * source.nbytes / best


def matmul_flops() -> float:
    """FLOP/s of a float32 matrix product shaped like a batched search (64 x 384 by 384 x 100k)."""
    queries = np.ones((64, 384), dtype=np.float32)
    vectors = np.ones((100_000, 384), dtype=np.float32)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        queries @ vectors.T
        best = min(best, time.perf_counter() - started)
    return 2 * 64 * 384 * 100_000 / best


def bench_search(sizes: list[int], queries: int, on_gpu: bool, dimension: int = 384, k: int = 1000) -> None:
    rng = np.random.default_rng(0)
    if on_gpu:
        print(f"\nflat index sharded over {dense_index.gpu_count()} GPU(s)")
        print(f"{'vectors':>10}{'mode':>10}{'ms/query':>10}")
    else:
        bandwidth, flops = read_bandwidth(), matmul_flops()
        print(f"\nmemory bandwidth (copy, read+write): {bandwidth / 1e9:.1f} GB/s; "
              f"float32 matmul: {flops / 1e9:.1f} GFLOP/s")
        print("memory bound: every vector read once per search call; compute bound: 2*n*d FLOP per query")
        print(f"{'vectors':>10}{'mode':>10}{'ms/query':>10}{'memory bound':>14}{'compute bound':>15}"
              f"{'ratio to max':>14}")
    for size in sizes:
        index = dense_index.new_flat_index(dimension)
        for start in range(0, size, 100_000):
            index.add(rng.standard_normal((min(100_000, size - start), dimension), dtype=np.float32))
        if on_gpu:
            index = dense_index.shard_over_gpus(index)
        probe = rng.standard_normal((max(queries, 64 * 3), dimension), dtype=np.float32)
        single, batched = time_search(index, probe, queries, k)
        del index
        if on_gpu:
            print(f"{size:>10}{'single':>10}{single:>10.2f}\n{size:>10}{'batch 64':>10}{batched:>10.2f}")
            continue
        bound_ms = 1000 * size * dimension * 4 / bandwidth  # every vector read once per search call
        compute_ms = 1000 * 2 * size * dimension / flops
        for mode, ms, memory_ms in (("single", single, bound_ms), ("batch 64", batched, bound_ms / 64)):
            bound = max(memory_ms, compute_ms)
            print(f"{size:>10}{mode:>10}{ms:>10.2f}{memory_ms:>14.2f}{compute_ms:>15.2f}{ms / bound:>14.2f}")


def time_search(index, probe: np.ndarray, queries: int, k: int) -> tuple[float, float]:
    """ms/query one query per call and 64 per call (faiss returns host arrays: the search is done)."""
    dense_index.search(index, probe[:1], k)  # warm-up
    started = time.perf_counter()
    for row in probe[:queries]:
        dense_index.search(index, row[None, :], k)
    single = 1000 * (time.perf_counter() - started) / queries
    started = time.perf_counter()
    for start in range(0, 64 * 3, 64):
        dense_index.search(index, probe[start : start + 64], k)
    return single, 1000 * (time.perf_counter() - started) / (64 * 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passages", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--queries", type=int, default=20)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    bench_builder(args.passages, args.batch_size, args.device)
    bench_search(args.sizes, args.queries, on_gpu=args.device == "cuda")


if __name__ == "__main__":
    main()
