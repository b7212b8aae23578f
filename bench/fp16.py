"""fp16 vector storage against exact fp32 search, on real collections: what `SEARCH_GPU_FP16` costs.

    python bench/fp16.py --collection NAME INDEX QUERIES QRELS [--collection ...] [--k 1000] [--device cpu|cuda]

e.g. the Cranfield index of `convert-cranfield` + `build`, and SciFact's dev split of scripts/scifact.sh:

    python bench/fp16.py --collection cranfield runs/cranfield/index runs/cranfield/queries.tsv runs/cranfield/qrels.txt \
        --collection scifact-dev runs/scifact/index runs/scifact/split/queries-dev.tsv runs/scifact/split/qrels-dev.txt

Each collection's queries are encoded once, by the encoder its manifest names, and searched at `--k`
by the same `Searcher` (ids, ranking) over the index's own vectors in fp32 (the exact reference) and
in fp16, with one line per fp16 variant: the mean share of the reference's top 10 and top k that it
returns, the share of queries whose top 10 is in the same order, the largest score difference on a
passage both return, and nDCG@10, MRR@10 and Recall@1000 beside the reference's (ir-measures).

The fp16 variants:
- `fp16 storage, fp32 queries`: FAISS's own fp16 store on the CPU (IndexScalarQuantizer QT_fp16,
  exhaustive, vectors decoded to fp32 before the inner product);
- `fp16 vectors and queries`: both sides rounded to fp16, products summed in fp32: what a GPU flat
  index with `useFloat16` computes (fp16 GEMM inputs, fp32 accumulation; a product of two fp16
  values is exact in fp32), up to the order of the sums. Emulated on the CPU;
- with `--device cuda` (a GPU faiss sees, else exit 2), `GPU useFloat16`: the index placed as the
  service places it with SEARCH_GPU_FP16 (dense_index.shard_over_gpus(fp16=True)), and the same
  placement in fp32 as a check that the GPU's fp32 search is the reference's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import faiss
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from retrieval.evaluation import as_run, metrics  # noqa: E402
from retrieval import dense_index  # noqa: E402
from retrieval.load_options import LoadOptions  # noqa: E402
from retrieval.readers import read_qrels, read_queries  # noqa: E402
from retrieval.searcher import Searcher  # noqa: E402

MEASURES = ("nDCG@10", "MRR@10", "Recall@1000")


def rounded(array: np.ndarray) -> np.ndarray:
    """`array` through fp16 and back: the values an fp16 store holds, as fp32."""
    return np.ascontiguousarray(array.astype(np.float16).astype(np.float32))


def flat_ip(vectors: np.ndarray) -> faiss.Index:
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    return index


def fp16_store(vectors: np.ndarray) -> faiss.Index:
    index = faiss.IndexScalarQuantizer(vectors.shape[1], faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
    index.add(vectors)  # QT_fp16 needs no training
    return index


def ranked(searcher: Searcher, index: faiss.Index, vectors: np.ndarray, k: int) -> list:
    """Each vector's dense hits through `searcher` (rows to ids and order as served), `index` in place of its own."""
    searcher.index = index
    return searcher.hits(searcher.rank([""] * len(vectors), vectors, searcher.request(k)))


def compare(reference: dict, other: dict, k: int) -> dict[str, float]:
    """Agreement of `other`'s hits with `reference`'s, query by query."""
    top10, topk, same_order, worst = [], [], 0, 0.0
    for qid, exact in reference.items():
        found = other[qid]
        ids = [hit.id for hit in found]
        exact_ids = [hit.id for hit in exact]
        top10.append(len(set(ids[:10]) & set(exact_ids[:10])) / max(1, min(10, len(exact_ids))))
        topk.append(len(set(ids[:k]) & set(exact_ids[:k])) / max(1, len(exact_ids[:k])))
        same_order += ids[:10] == exact_ids[:10]
        scores = {hit.id: hit.score for hit in found}
        worst = max([worst] + [abs(scores[hit.id] - hit.score) for hit in exact if hit.id in scores])
    return {"top10": float(np.mean(top10)), "topk": float(np.mean(topk)),
            "same_order": same_order / len(reference), "max_diff": worst}


def bench_collection(name: str, index_dir: Path, queries_file: Path, qrels_file: Path, k: int, device: str) -> None:
    queries = read_queries(queries_file)
    qrels = read_qrels(qrels_file)
    searcher = Searcher(index_dir, load=LoadOptions(device="cpu"))
    k = min(k, searcher.count)
    ids = list(queries)
    started = time.perf_counter()
    vectors = np.concatenate([searcher.encode([queries[q] for q in ids[i:i + 64]]) for i in range(0, len(ids), 64)])
    encode_s = time.perf_counter() - started
    stored = searcher.index.reconstruct_n(0, searcher.index.ntotal)

    def run(index: faiss.Index, query_vectors: np.ndarray) -> dict:
        return dict(zip(ids, ranked(searcher, index, query_vectors, k)))

    exact_index = flat_ip(stored)
    reference = run(exact_index, vectors)
    variants = {
        "fp16 storage, fp32 queries (faiss, CPU)": run(fp16_store(stored), vectors),
        "fp16 vectors and queries (GPU useFloat16, emulated)": run(flat_ip(rounded(stored)), rounded(vectors)),
    }
    if device == "cuda":
        variants["GPU fp32 (check)"] = run(dense_index.shard_over_gpus(exact_index, fp16=False), vectors)
        variants["GPU useFloat16"] = run(dense_index.shard_over_gpus(exact_index, fp16=True), vectors)
    exact = metrics(qrels, as_run(reference))
    print(f"\n{name}: {searcher.count:,} passages x {stored.shape[1]}, {len(ids)} queries (encoded in "
          f"{encode_s:.1f} s), k={k}; fp32: " + ", ".join(f"{m} {exact[m]:.4f}" for m in MEASURES))
    print(f"{'variant':<52} {'top-10':>7} {f'top-{k}':>9} {'same top-10 order':>18} {'max |d score|':>14}  "
          + "  ".join(f"{m + ' (change)':>21}" for m in MEASURES))
    for label, hits in variants.items():
        agree = compare(reference, hits, k)
        values = metrics(qrels, as_run(hits))
        print(f"{label:<52} {agree['top10']:>7.4f} {agree['topk']:>9.4f} {agree['same_order']:>18.4f} "
              f"{agree['max_diff']:>14.2e}  "
              + "  ".join(f"{values[m]:>11.4f} ({values[m] - exact[m]:+.4f})" for m in MEASURES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--collection", nargs=4, action="append", required=True,
                        metavar=("NAME", "INDEX", "QUERIES", "QRELS"), help="a collection to measure (repeatable)")
    parser.add_argument("--k", type=int, default=1000, help="depth of the compared runs (default 1000)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    if args.k < 10:
        parser.exit(2, "error: --k must be at least 10\n")
    for name, index, queries, qrels in args.collection:
        for path in (index, queries, qrels):
            if not Path(path).exists():
                parser.exit(2, f"error: {name}: {path} does not exist\n")
    if args.device == "cuda" and dense_index.gpu_count() == 0:
        parser.exit(2, "error: --device cuda, but faiss sees no GPU\n")
    started = time.perf_counter()
    for name, index, queries, qrels in args.collection:
        bench_collection(name, Path(index), Path(queries), Path(qrels), args.k, args.device)
    print(f"\nfp16 against fp32 on {len(args.collection)} collections in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
