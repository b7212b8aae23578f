"""Candidate structures on synthetic clustered vectors, against the flat scan measured in the same run:

    python bench/candidates.py N SIGMA      # e.g. 200000 0.1

N x 384 unit vectors around 1,000 gaussian cluster centres (noise SIGMA: 0.1 makes a query's 10th
neighbour a cosine of about 0.28 away; tighter clusters make every structure look perfect), 1,000
queries drawn alike. For binary, int8 and hnsw (retrieval.candidates, default parameters): build
seconds, then at several depths recall@10 against the exact top-10 and ms per single query, with the
ratio to the flat scan's; and hnsw's recall card as `index_builder ann` measures it.
"""
import sys
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retrieval import candidates, dense_index  # noqa: E402

N, D, CLUSTERS, Q = int(sys.argv[1]), 384, 1000, 1000
SIGMA = float(sys.argv[2])
rng = np.random.default_rng(0)
centers = rng.standard_normal((CLUSTERS, D)).astype(np.float32)
centers /= np.linalg.norm(centers, axis=1, keepdims=True)
def sample(n):
    x = centers[rng.integers(0, CLUSTERS, n)] + SIGMA * rng.standard_normal((n, D)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)
x = sample(N); queries = sample(Q)
print("mean cosine of a query to its 10th exact neighbour:", flush=True)
folder = Path(tempfile.mkdtemp())
flat = faiss.IndexFlatIP(D); flat.add(x); faiss.write_index(flat, str(folder / "index.faiss")); del flat, x
flat = dense_index.load_index(folder / "index.faiss", "cpu", mmap=True)
time.sleep(2)

def timed_single(fn, n=200):
    t = time.perf_counter()
    for q in queries[:n]:
        fn(q[None])
    return 1000 * (time.perf_counter() - t) / n

exact_scores, exact = dense_index.search(flat, queries, 10)
print(f"  {exact_scores[:, 9].mean():.3f} (1st: {exact_scores[:, 0].mean():.3f})", flush=True)
ms_exact = timed_single(lambda q: dense_index.search(flat, q, 10), 50)
print(f"flat exact: {ms_exact:.1f} ms/query (single queries), threads {faiss.omp_get_max_threads()}", flush=True)

def recall(rows):
    return np.mean([len(set(a) & set(b)) / 10 for a, b in zip(rows.tolist(), exact.tolist())])

for kind, params, depths in (("binary", {}, (400, 1000)), ("int8", {}, (100, 256)), ("hnsw", {}, (64, 128, 256))):
    t = time.perf_counter()
    s = candidates.build(flat, kind, params, progress=False)
    built = time.perf_counter() - t
    for depth in depths:
        if kind == "hnsw":
            s.params["efSearch"] = depth; s.depth = depth
        rows = candidates.search(s, flat, queries, 10, depth)[1]
        ms = timed_single(lambda q: candidates.search(s, flat, q, 10, depth))
        label = f"efSearch {depth}" if kind == "hnsw" else f"{depth} candidates"
        print(f"{kind}: build {built:.1f} s; {label}: recall@10 {recall(rows):.4f}, {ms:.2f} ms/query "
              f"({ms_exact / ms:.0f}x faster than exact)", flush=True)
    if kind == "hnsw":
        s.params["efSearch"] = 128; s.depth = 128
        card = candidates.measure_recall(s, flat)
        print(f"hnsw recall card (1000 held-out passages, self excluded, depth 128): @10 {card.recall_at_10:.4f} "
              f"@100 {card.recall_at_100:.4f}", flush=True)
