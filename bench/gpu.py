"""The torch flat scan on a GPU against the HBM bandwidth bound measured in the same run (issue 59, part 3):

    python bench/gpu.py [--rows 8841823] [--dimension 768] [--k 1000] [--queries 100] [--batches 20]
                        [--batch 64] [--passages 20000] [--seed 0]

Needs torch with CUDA and numpy, nothing else for the scan: --rows x --dimension fp16 unit vectors are made
on the GPUs (around 1,000 random centres, so the scores are not uniform noise; split evenly over every
visible GPU, as `SEARCH_DEVICE=cuda` serves an index where faiss has no GPU support), and searched exactly by
retrieval.torch_flat.TorchFlatIndex, top --k: --queries single queries, then --batches batches of --batch
queries (p50 and p99 each, after warm-up). The bound: the vectors' bytes over the device's read bandwidth,
measured on the same vectors (a read of every row, best of five). MS MARCO's 8,841,823 passages at 768
dimensions by default; the paper's figure for comparison is 80 ms a query on 5 GPUs.

Then, where transformers, sentence-transformers and the packaged encoder are installed, the builder's
passages/s (models.encoder.BiEncoder.encode_passages, fp16 on the GPU) against sentence-transformers'
encode on the same --passages synthetic passages of about 120 tokens; skipped with a line otherwise.
Within 8 minutes on one GPU; its inputs are this checkout's files.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from retrieval.torch_flat import TorchFlatIndex  # noqa: E402

PAPER_MS = 80.0  # the paper's query time over MS MARCO on 5 GPUs
CENTRES = 1000
MADE_ROWS = 1 << 20  # rows made at a time


def make_vectors(rows: int, dimension: int, device: torch.device, seed: int) -> torch.Tensor:
    """`rows` fp16 unit vectors on `device`, each a random centre plus noise, made a block at a time."""
    generator = torch.Generator(device=device).manual_seed(seed)
    centres = torch.randn((CENTRES, dimension), device=device, generator=generator)
    centres /= centres.norm(dim=1, keepdim=True)
    vectors = torch.empty((rows, dimension), dtype=torch.float16, device=device)
    for first in range(0, rows, MADE_ROWS):
        count = min(MADE_ROWS, rows - first)
        picked = torch.randint(0, CENTRES, (count,), device=device, generator=generator)
        block = centres[picked] + 0.05 * torch.randn((count, dimension), device=device, generator=generator)
        vectors[first:first + count] = (block / block.norm(dim=1, keepdim=True)).half()
    return vectors


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_seconds(shards: list[torch.Tensor]) -> float:
    """The fastest of five reads of every row on every device (a sum over the rows, fp32 accumulation: it
    reads each byte once and writes a row's worth), the devices read at once."""
    best = float("inf")
    for _ in range(5):
        for shard in shards:
            synchronize(shard.device)
        started = time.perf_counter()
        for shard in shards:
            shard.sum(dim=0, dtype=torch.float32)
        for shard in shards:
            synchronize(shard.device)
        best = min(best, time.perf_counter() - started)
    return best


def timed_searches(index: TorchFlatIndex, queries: np.ndarray, size: int, count: int, k: int) -> list[float]:
    """Milliseconds of `count` searches of `size` queries each (after three unmeasured)."""
    times = []
    for number in range(count + 3):
        batch = queries[(number * size) % len(queries):][:size]
        if len(batch) < size:
            batch = queries[:size]
        started = time.perf_counter()
        index.search(batch, k)  # its answer is copied to the host: the search has finished
        if number >= 3:
            times.append(1000 * (time.perf_counter() - started))
    return times


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def encoder_rates(passages: int) -> str:
    """The builder's and sentence-transformers' passages/s on the GPU, or why they were not measured."""
    try:
        from sentence_transformers import SentenceTransformer

        from models.encoder import BiEncoder
    except ImportError as error:
        return f"encoders: skipped ({error.name} is not installed here)"
    words = "retrieval dense passage encoder query index vector search exact score rank model".split()
    rng = np.random.default_rng(1)
    texts = [" ".join(rng.choice(words, 100)) for _ in range(passages)]
    ours = BiEncoder(device="cuda")
    theirs = SentenceTransformer(str(ours.path), device="cuda").half()
    ours.encode_passages(texts[:256])
    theirs.encode(texts[:256], batch_size=ours.batch_size)
    started = time.perf_counter()
    ours.encode_passages(texts)
    torch.cuda.synchronize()
    mine = passages / (time.perf_counter() - started)
    started = time.perf_counter()
    theirs.encode(texts, batch_size=ours.batch_size)
    torch.cuda.synchronize()
    other = passages / (time.perf_counter() - started)
    return (f"encoders ({ours.spec.name}, fp16, batch {ours.batch_size}, {passages:,} passages of 100 words): "
            f"builder {mine:,.0f} passages/s, sentence-transformers {other:,.0f} passages/s, ratio {mine / other:.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8_841_823, help="vectors in the index (MS MARCO's passages)")
    parser.add_argument("--dimension", type=int, default=768)
    parser.add_argument("--k", type=int, default=1000, help="results per query")
    parser.add_argument("--queries", type=int, default=100, help="single-query searches timed")
    parser.add_argument("--batches", type=int, default=20, help="batch searches timed")
    parser.add_argument("--batch", type=int, default=64, help="queries per batch")
    parser.add_argument("--passages", type=int, default=20_000, help="passages encoded per encoder (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke run of the script itself at small --rows (no figure to report)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "bench/gpu.py: torch sees no CUDA device\n")

    started = time.perf_counter()
    devices = ([torch.device("cuda", number) for number in range(torch.cuda.device_count())]
               if args.device == "cuda" else [torch.device("cpu")])
    bounds = np.linspace(0, args.rows, len(devices) + 1).astype(np.int64)
    shards = [make_vectors(int(end - start), args.dimension, device, args.seed + number)
              for number, (device, start, end) in enumerate(zip(devices, bounds[:-1], bounds[1:]))]
    index = TorchFlatIndex.of_tensors(shards)
    made = time.perf_counter() - started
    names = ", ".join(sorted({torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
                              for device in devices}))
    gib = args.rows * args.dimension * 2 / 2**30
    print(f"{args.rows:,} x {args.dimension} fp16 vectors ({gib:.2f} GiB) made on {len(devices)} GPU(s) ({names}) "
          f"in {made:.1f} s; torch {torch.__version__}", flush=True)

    seconds = read_seconds(shards)
    bound_ms = 1000 * seconds
    bandwidth = args.rows * args.dimension * 2 / seconds / 1e12
    print(f"bound: every row read once in {bound_ms:.2f} ms ({bandwidth:.2f} TB/s over all devices)", flush=True)

    rng = np.random.default_rng(args.seed)
    picked = rng.integers(0, args.rows, max(args.queries, args.batch * 4))
    queries = index.reconstruct_batch(picked) + 0.05 * rng.standard_normal((len(picked), args.dimension), np.float32)
    queries = (queries / np.linalg.norm(queries, axis=1, keepdims=True)).astype(np.float32)
    _, rows = index.search(queries[:8], 10)
    found = float(np.mean(rows[:, 0] == picked[:8]))
    single = timed_searches(index, queries, 1, args.queries, args.k)
    p50 = statistics.median(single)
    print(f"one query, top {args.k}: p50 {p50:.2f} ms, p99 {percentile(single, 0.99):.2f} ms, "
          f"{p50 / bound_ms:.2f}x the bound; the paper: {PAPER_MS:.0f} ms on 5 GPUs "
          f"(a query's own row first for {found:.0%} of 8 probes)", flush=True)
    batched = timed_searches(index, queries, args.batch, args.batches, args.k)
    batch_p50 = statistics.median(batched)
    print(f"batches of {args.batch}, top {args.k}: p50 {batch_p50:.2f} ms ({batch_p50 / args.batch:.3f} ms a query, "
          f"{1000 * args.batch / batch_p50:,.0f} queries/s), p99 {percentile(batched, 0.99):.2f} ms, "
          f"{batch_p50 / bound_ms:.2f}x the bound", flush=True)
    del index, shards
    if args.device == "cuda":
        torch.cuda.empty_cache()
    if args.passages and args.device == "cuda":
        print(encoder_rates(args.passages), flush=True)
    print(f"summary: one query {p50 / bound_ms:.2f}x and a batch of {args.batch} {batch_p50 / bound_ms:.2f}x the "
          f"read bound of {bound_ms:.2f} ms (goal: within 1.5x); {time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
