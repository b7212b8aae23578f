"""Candidate structures against the flat scan measured in the same run, on synthetic or real vectors:

    python bench/candidates.py N SIGMA                 # synthetic, e.g. 200000 0.1
    python bench/candidates.py --index runs/wordnet/index [--ef-construction 40 200]

Synthetic: N x 384 unit vectors around 1,000 gaussian cluster centres (noise SIGMA: 0.1 makes a query's
10th neighbour a cosine of about 0.28 away; tighter clusters make every structure look perfect), 1,000
queries drawn alike, recall@10 against their exact top 10.
--index: an index's own stored vectors (real embeddings: bench/wordnet.py makes one of 117k passages), 1,000
held-out passages as queries, each searched with itself excluded (as `index_builder ann`'s recall card is).
For each kind (retrieval/candidates/; hnsw once per --ef-construction): build seconds, then at several depths
(ivf: several nprobe) recall@10 and @100 and ms per single query, with the ratio to the flat scan's.
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retrieval import dense_index  # noqa: E402
from retrieval.candidates import recall, structures  # noqa: E402
from retrieval.candidates.kind import SEED, Structure  # noqa: E402
from retrieval.candidates.registry import KINDS  # noqa: E402
from retrieval.index_format import INDEX_FILE  # noqa: E402

D, CLUSTERS, Q = 384, 1000, 1000


def synthetic(n: int, sigma: float):
    """A memory-mapped flat index of n clustered vectors, and Q queries drawn alike."""
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((CLUSTERS, D)).astype(np.float32)
    centers /= np.linalg.norm(centers, axis=1, keepdims=True)

    def sample(count):
        x = centers[rng.integers(0, CLUSTERS, count)] + sigma * rng.standard_normal((count, D)).astype(np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    x, queries = sample(n), sample(Q)
    folder = Path(tempfile.mkdtemp())
    flat = faiss.IndexFlatIP(D)
    flat.add(x)
    faiss.write_index(flat, str(folder / INDEX_FILE))
    del flat, x
    return dense_index.load_index(folder / INDEX_FILE, "cpu", mmap=True), queries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("synthetic", nargs="*", help="N SIGMA")
    parser.add_argument("--index", type=Path, help="an index directory: its stored vectors, held-out queries")
    parser.add_argument("--ef-construction", type=int, nargs="+",
                        default=[KINDS["hnsw"].params["efConstruction"].default])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    args = parser.parse_args()
    if (args.index is None) == (len(args.synthetic) != 2):
        parser.error("give N SIGMA or --index DIR")
    if args.index is not None:
        flat = dense_index.load_index(args.index / INDEX_FILE, "cpu", mmap=True)
        own = np.sort(np.random.default_rng(SEED).choice(flat.ntotal, Q, replace=False))
        queries = flat.reconstruct_batch(own)
        label = f"{args.index}: {flat.ntotal:,} x {flat.d} stored vectors, {Q} held-out passages as queries"
    else:
        flat, queries = synthetic(int(args.synthetic[0]), float(args.synthetic[1]))
        own = None
        label = f"{flat.ntotal:,} x {D} clustered synthetic vectors (sigma {args.synthetic[1]}), {Q} queries"
    print(label, flush=True)

    def timed_single(fn, n=200):
        fn(queries[:1])
        started = time.perf_counter()
        for q in queries[:n]:
            fn(q[None])
        return 1000 * (time.perf_counter() - started) / n

    exact_scores = dense_index.search(flat, queries, 11)[0]
    tenth = exact_scores[:, 10 if own is not None else 9].mean()
    print(f"mean cosine of a query to its 10th exact neighbour: {tenth:.3f}", flush=True)
    ms_exact = timed_single(lambda q: dense_index.search(flat, q, 10), 50)
    print(f"flat exact: {ms_exact:.2f} ms/query (single queries), threads {faiss.omp_get_max_threads()}", flush=True)

    def card(structure: Structure) -> recall.RecallCard:
        if own is not None:
            return recall.measure_recall(structure, flat)  # held-out, self excluded: the card's own measure
        return recall.measure_recall(structure, flat, queries, queries="synthetic queries")

    plans = [("binary", {}, (400, 1000, 4000)), ("int8", {}, (100, 256, 1000))]
    plans += [("hnsw", {"efConstruction": ef}, (64, 128, 256, 512)) for ef in args.ef_construction]
    plans += [("ivf", {}, (16, 32, 64, 128, 256))]  # nprobe, at the default depth
    plans += [("pq", {}, (128, 256, 512, 1024))]
    for kind, params, depths in plans:
        if kind not in args.kinds:
            continue
        started = time.perf_counter()
        structure = structures.build(flat, kind, params, progress=False)
        built = time.perf_counter() - started
        for depth in depths:
            if kind == "ivf":
                structure.params["nprobe"], depth = depth, structure.depth
            structure.depth = depth
            if kind == "hnsw":
                structure.params["efSearch"] = depth
            found = card(structure)
            ms = timed_single(lambda q: structures.search(structure, flat, q, 10, depth))
            setting = f"{depth} candidates"
            if kind == "hnsw":
                setting = f"efConstruction {params['efConstruction']}, efSearch {depth}"
            elif kind in ("ivf", "pq"):
                setting = f"nlist {structure.params['nlist']}, nprobe {structure.params['nprobe']}, {setting}"
            print(f"{kind} (built in {built:.1f} s): {setting}: recall@10 {found.recall_at_10:.4f}, @100 "
                  f"{found.recall_at_100:.4f}; {ms:.2f} ms/query ({ms_exact / ms:.0f}x the flat scan's speed)",
                  flush=True)


if __name__ == "__main__":
    main()
