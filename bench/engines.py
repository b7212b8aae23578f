"""This project's retrieval against the embedded engines a user would pick instead, on the same vectors and
queries, in one run:

    python bench/engines.py [--size 200000 | --vectors INDEX] [--systems flat hnsw ivf pq usearch lancedb chroma milvus]

Vectors: --size clustered unit vectors written through the index writer with a `bucket` field drawn uniformly
from 0..999 on every passage (bench/filters.py's build). Queries: stored vectors plus noise. With --vectors, an
encoded index's own vectors (WordNet's glosses: bench/wordnet.py), --queries of them held out as the queries. Each system is built one after another from the same
vectors (its build seconds, and the process's resident memory it added once built and opened: an estimate,
in one process), then the systems answer interleaved round by round: single queries (p50, p99), batches of
64 (queries/s), recall@10 against the exact inner-product top 10, and filtered searches keeping 1% and 10% of
the passages (`bucket < 10`, `bucket < 100`: p50 and recall against the exact filtered top 10).

Systems and their settings (as close as each API allows): this project's retrieval as the service runs it
after encoding (Searcher.rank: `flat`, the exact scan; `hnsw`, `ivf`, `pq`, candidate structures at their
default parameters rescored exactly; filters exact in every case); usearch (HNSW, inner product, f32,
connectivity 32, expansion_add 200, expansion_search 64; its Python search takes no filter); LanceDB
(IVF_HNSW_SQ, dot, m 32, ef_construction 200, refine factor 10, prefiltered `where`); Chroma (HNSW, ip,
max_neighbors 32, ef_construction 200, ef_search 64, `where`); Milvus Lite (its index, IP, `filter`). A
peer whose package is not installed is skipped with a line saying so. Where a peer's recall@10 is under 0.99
its row is repeated at the setting that reaches it where its API has one (usearch's expansion_search,
LanceDB's nprobes and refine factor, Chroma's ef_search).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.filters import build as build_with_fields  # noqa: E402
from index_builder.ann import AnnOptions, add_structures  # noqa: E402
from index_builder.build import encoder_record  # noqa: E402
from models.encoder import BiEncoder  # noqa: E402
from retrieval import dense_index  # noqa: E402
from retrieval.index_format import read_manifest  # noqa: E402
from retrieval.load_options import LoadOptions  # noqa: E402
from retrieval.searcher import Searcher  # noqa: E402

K, BATCH = 10, 64
SHARES = {"1%": 10, "10%": 100}  # bucket < N keeps N/1000 of the passages
PEERS = {"usearch": "usearch", "lancedb": "lancedb", "chroma": "chromadb", "milvus": "pymilvus"}
PROJECT = ("flat", "hnsw", "ivf", "pq")


def resident_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class System:
    """One engine's answers: `single` one query's ids, `batch` each query's, `filtered` under bucket < limit."""

    name: str
    setting: str
    single: Callable[[np.ndarray], list[int]]
    batch: Callable[[np.ndarray], list[list[int]]]
    filtered: Callable[[np.ndarray, int], list[int]] | None = None
    tune: Callable[[], bool] | None = None  # raise recall one step; False where it cannot


def project(kind: str, searcher: Searcher) -> System:
    system = System()
    system.name, system.setting = f"project {kind}", "exact scan" if kind == "flat" else f"{kind}, defaults"
    options = {"exact": True} if kind == "flat" else {"structure": kind}
    plain = searcher.request(K, mode="dense", **options)
    masks = {limit: searcher.request(K, mode="dense", filter={"bucket": {"$lt": limit}}, **options)
             for limit in SHARES.values()}

    def rows(vectors: np.ndarray, request) -> list[list[int]]:
        return [[row for row, _ in ranked] for ranked in searcher.rank([""] * len(vectors), vectors, request)]

    system.single = lambda q: rows(q[None], plain)[0]
    system.batch = lambda qs: rows(qs, plain)
    system.filtered = lambda q, limit: rows(q[None], masks[limit])[0]
    return system


def usearch_system(vectors: np.ndarray, folder: Path) -> System:
    from usearch.index import Index

    index = Index(ndim=vectors.shape[1], metric="ip", dtype="f32", connectivity=32, expansion_add=200,
                  expansion_search=64)
    index.add(np.arange(len(vectors)), vectors)
    system = System()
    system.name, system.setting = "usearch", "HNSW, connectivity 32, expansion_add 200, expansion_search 64"
    system.single = lambda q: [int(key) for key in index.search(q, K, threads=1).keys]
    system.batch = lambda qs: [[int(key) for key in row] for row in index.search(qs, K).keys]

    def tune() -> bool:
        index.expansion_search *= 2
        system.setting = f"HNSW, connectivity 32, expansion_add 200, expansion_search {index.expansion_search}"
        return index.expansion_search <= 4096

    system.tune = tune
    return system


def lancedb_system(vectors: np.ndarray, buckets: np.ndarray, folder: Path) -> System:
    import lancedb
    import pyarrow as pa

    db = lancedb.connect(str(folder / "lancedb"))
    table = db.create_table("passages", pa.table({
        "id": pa.array(np.arange(len(vectors))), "bucket": pa.array(buckets.astype(np.int32)),
        "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), vectors.shape[1])}))
    table.create_index(metric="dot", index_type="IVF_HNSW_SQ", m=32, ef_construction=200)
    table.create_scalar_index("bucket")
    settings = {"nprobes": 20, "refine": 10}
    system = System()

    def query(q: np.ndarray, where: str | None = None):
        search = table.search(q).distance_type("dot").limit(K).nprobes(settings["nprobes"]).refine_factor(
            settings["refine"]).select(["id", "_distance"])  # without _distance it warns on every search
        if where:
            search = search.where(where, prefilter=True)
        return search.to_arrow()["id"].to_pylist()

    def describe() -> str:
        return f"IVF_HNSW_SQ, dot, m 32, ef_construction 200, nprobes {settings['nprobes']}, refine {settings['refine']}"

    system.name, system.setting = "LanceDB", describe()
    system.single = query
    system.batch = lambda qs: [query(q) for q in qs]  # its Python search takes one vector
    system.filtered = lambda q, limit: query(q, f"bucket < {limit}")

    def tune() -> bool:
        settings["nprobes"] *= 2
        system.setting = describe()
        return settings["nprobes"] <= 1024

    system.tune = tune
    return system


def chroma_system(vectors: np.ndarray, buckets: np.ndarray, folder: Path) -> System:
    import chromadb

    client = chromadb.PersistentClient(path=str(folder / "chroma"))
    settings = {"ef_search": 64}
    collection = client.create_collection("passages", configuration={"hnsw": {
        "space": "ip", "max_neighbors": 32, "ef_construction": 200, "ef_search": settings["ef_search"]}})
    step = client.get_max_batch_size()
    for first in range(0, len(vectors), step):
        rows = range(first, min(first + step, len(vectors)))
        collection.add(ids=[str(row) for row in rows], embeddings=vectors[first:rows.stop],
                       metadatas=[{"bucket": int(buckets[row])} for row in rows])
    system = System()

    def answer(result) -> list[list[int]]:
        return [[int(key) for key in ids] for ids in result["ids"]]

    def describe() -> str:
        return f"HNSW, ip, max_neighbors 32, ef_construction 200, ef_search {settings['ef_search']}"

    system.name, system.setting = "Chroma", describe()
    system.single = lambda q: answer(collection.query(query_embeddings=q[None], n_results=K, include=[]))[0]
    system.batch = lambda qs: answer(collection.query(query_embeddings=qs, n_results=K, include=[]))
    system.filtered = lambda q, limit: answer(collection.query(
        query_embeddings=q[None], n_results=K, include=[], where={"bucket": {"$lt": limit}}))[0]

    def tune() -> bool:
        settings["ef_search"] *= 2
        collection.modify(configuration={"hnsw": {"ef_search": settings["ef_search"]}})
        system.setting = describe()
        return settings["ef_search"] <= 4096

    system.tune = tune
    return system


def milvus_system(vectors: np.ndarray, buckets: np.ndarray, folder: Path) -> System:
    from pymilvus import DataType, MilvusClient

    client = MilvusClient(str(folder / "milvus.db"))
    schema = MilvusClient.create_schema(auto_id=False)
    schema.add_field("id", DataType.INT64, is_primary=True)
    schema.add_field("bucket", DataType.INT32)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=vectors.shape[1])
    index = client.prepare_index_params()
    index.add_index(field_name="vector", index_type="IVF_FLAT", metric_type="IP", params={"nlist": 1024})
    client.create_collection("passages", schema=schema, index_params=index)
    for first in range(0, len(vectors), 10_000):
        part = range(first, min(first + 10_000, len(vectors)))
        client.insert("passages", [{"id": row, "bucket": int(buckets[row]), "vector": vectors[row]} for row in part])
    client.load_collection("passages")
    settings = {"nprobe": 16}
    system = System()

    def query(qs: np.ndarray, where: str = "") -> list[list[int]]:
        found = client.search("passages", data=list(qs), limit=K, filter=where, output_fields=[],
                              search_params={"metric_type": "IP", "params": {"nprobe": settings["nprobe"]}})
        return [[int(hit["id"]) for hit in hits] for hits in found]

    system.name, system.setting = "Milvus Lite", f"IVF_FLAT, IP, nlist 1024, nprobe {settings['nprobe']}"
    system.single = lambda q: query(q[None])[0]
    system.batch = query
    system.filtered = lambda q, limit: query(q[None], f"bucket < {limit}")[0]

    def tune() -> bool:
        settings["nprobe"] *= 2
        system.setting = f"IVF_FLAT, IP, nlist 1024, nprobe {settings['nprobe']}"
        return settings["nprobe"] <= 1024

    system.tune = tune
    return system


def recall(found: list[list[int]], exact: np.ndarray) -> float:
    return float(np.mean([len(set(row) & set(truth.tolist())) / len(truth) for row, truth in zip(found, exact)]))


def measure(systems: list[System], queries: np.ndarray, exact: np.ndarray, exact_filtered: dict, rounds: int) -> dict:
    """Every system's figures, the systems interleaved round by round."""
    times: dict[str, dict[str, list[float]]] = {s.name: {"single": [], "batch": [], **{f: [] for f in SHARES}}
                                                for s in systems}
    found: dict[str, dict[str, list]] = {s.name: {"single": [], **{f: [] for f in SHARES}} for s in systems}
    for round_ in tqdm(range(rounds), desc="rounds", unit=" rounds", file=sys.stderr):
        query = queries[round_ % len(queries)]
        batch = queries[(round_ * BATCH) % (len(queries) - BATCH):][:BATCH]
        for system in systems:
            started = time.perf_counter()
            ids = system.single(query)
            times[system.name]["single"].append(1000 * (time.perf_counter() - started))
            if round_ < len(queries):
                found[system.name]["single"].append(ids)
            if round_ % 8 == 0:
                started = time.perf_counter()
                system.batch(batch)
                times[system.name]["batch"].append(time.perf_counter() - started)
            if system.filtered is None:
                continue
            for share, limit in SHARES.items():
                started = time.perf_counter()
                ids = system.filtered(query, limit)
                times[system.name][share].append(1000 * (time.perf_counter() - started))
                if round_ < len(queries):
                    found[system.name][share].append(ids)
    figures = {}
    for system in systems:
        spent, got = times[system.name], found[system.name]
        row = {"p50": statistics.median(spent["single"]), "p99": float(np.percentile(spent["single"], 99)),
               "qps": BATCH / statistics.median(spent["batch"]), "recall": recall(got["single"], exact)}
        for share in SHARES:
            if system.filtered is not None:
                row[f"{share} p50"] = statistics.median(spent[share])
                row[f"{share} recall"] = recall(got[share], exact_filtered[share])
        figures[system.name] = row
    return figures


def print_table(systems: list[System], figures: dict, builds: dict) -> None:
    print(f"{'system':<16}{'setting':<72}{'build s':>8}{'+MiB':>7}{'p50 ms':>8}{'p99 ms':>8}{'q/s (64)':>9}"
          f"{'R@10':>7}" + "".join(f"{share + ' p50':>9}{share + ' R@10':>9}" for share in SHARES))
    for system in systems:
        row, (seconds, mib) = figures[system.name], builds[system.name]
        filtered = "".join(f"{row[f'{s} p50']:>9.2f}{row[f'{s} recall']:>9.3f}" if f"{s} p50" in row
                           else f"{'n/a':>9}{'':>9}" for s in SHARES)
        print(f"{system.name:<16}{system.setting:<72}{seconds:>8.1f}{mib:>7.0f}{row['p50']:>8.2f}{row['p99']:>8.2f}"
              f"{row['qps']:>9.0f}{row['recall']:>7.3f}{filtered}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=200_000)
    parser.add_argument("--systems", nargs="+", default=[*PROJECT, *PEERS], choices=[*PROJECT, *PEERS])
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--sigma", type=float, default=0.05)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--vectors", type=Path, metavar="INDEX",
                        help="an index's real embeddings instead of clustered ones (--size unused), --queries of them "
                        "held out as the queries (runs/wordnet/index: bench/wordnet.py)")
    args = parser.parse_args()

    encoder = BiEncoder(device="cpu")  # the record the Searcher checks
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="engines-", dir=args.work))
    try:
        index = root / "index"
        rng = np.random.default_rng(7)
        if args.vectors is not None:  # real embeddings: some held out as the queries, the rest the collection
            given = dense_index.load_index(args.vectors / "index.faiss", "cpu")
            given = given.reconstruct_n(0, given.ntotal)
            held_out = np.zeros(len(given), dtype=bool)
            held_out[rng.choice(len(given), size=args.queries, replace=False)] = True
            queries, collection = given[held_out], np.ascontiguousarray(given[~held_out])
            built = build_with_fields(index, len(collection), collection.shape[1], read_manifest(args.vectors).encoder,
                                      0.0, vectors=collection)
            label = f"{len(collection):,} x {collection.shape[1]} vectors of {args.vectors}"
        else:
            built = build_with_fields(index, args.size, encoder.spec.dimension, encoder_record(encoder), args.sigma)
            label = f"{args.size:,} x {encoder.spec.dimension} clustered vectors (sigma {args.sigma})"
        flat = dense_index.load_index(index / "index.faiss", "cpu")
        vectors = flat.reconstruct_n(0, flat.ntotal)
        searcher = Searcher(index, encoder, load=LoadOptions(device="cpu"))
        buckets = np.asarray(searcher.restrictions.columns.columns["bucket"].data)
        if args.vectors is None:  # stored vectors moved by noise
            queries = vectors[rng.integers(0, len(vectors), size=args.queries)]
            queries = (queries + 0.05 * rng.standard_normal(queries.shape, dtype=np.float32)).astype(np.float32)
            queries /= np.linalg.norm(queries, axis=1, keepdims=True)
        exact = dense_index.search(flat, queries, K)[1]
        exact_filtered = {}
        for share, limit in SHARES.items():
            rows = np.flatnonzero(buckets < limit)
            top = np.argsort(-(queries @ vectors[rows].T), axis=1, kind="stable")[:, :K]
            exact_filtered[share] = rows[top]
        print(f"{label}; {args.queries} queries; builds one at a time, then {args.rounds} rounds interleaved",
              flush=True)

        builds: dict[str, tuple[float, float]] = {}
        for kind in [name for name in PROJECT if name in args.systems and name != "flat"]:
            before, started = resident_mib(), time.perf_counter()
            add_structures(index, AnnOptions(kind), progress=False)
            builds[f"project {kind}"] = (time.perf_counter() - started, 0.0)
        before = resident_mib()
        searcher = Searcher(index, encoder, load=LoadOptions(device="cpu"))
        systems = [project(kind, searcher) for kind in PROJECT if kind in args.systems]
        for system in systems:
            system.single(queries[0])  # warm: pages the vectors and the structure in
        opened = resident_mib() - before  # every project row shares one loaded index
        for system in systems:
            seconds = builds.get(system.name, (built, 0.0))[0]
            builds[system.name] = (seconds, opened)
        for name in [name for name in PEERS if name in args.systems]:
            if importlib.util.find_spec(PEERS[name]) is None:
                print(f"{name}: not installed (pip install {PEERS[name]}), skipped", flush=True)
                continue
            before, started = resident_mib(), time.perf_counter()
            system = {"usearch": lambda: usearch_system(vectors, root),
                      "lancedb": lambda: lancedb_system(vectors, buckets, root),
                      "chroma": lambda: chroma_system(vectors, buckets, root),
                      "milvus": lambda: milvus_system(vectors, buckets, root)}[name]()
            system.single(queries[0])  # warm
            builds[system.name] = (time.perf_counter() - started, resident_mib() - before)
            print(f"{system.name}: built in {builds[system.name][0]:.1f} s", flush=True)
            systems.append(system)
        figures = measure(systems, queries, exact, exact_filtered, args.rounds)
        print_table(systems, figures, builds)
        # A peer under 0.99 recall@10 again at the setting that reaches it, beside the project's rows again.
        tuned = [system for system in systems if system.tune is not None and figures[system.name]["recall"] < 0.99]
        for system in tuned:
            while recall([system.single(q) for q in queries], exact) < 0.99 and system.tune():
                pass
        if tuned:
            print("peers at the setting that reaches recall@10 0.99 (or their last), measured again with the project's:")
            again = [system for system in systems if system.name.startswith("project")] + tuned
            print_table(again, measure(again, queries, exact, exact_filtered, args.rounds), builds)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
