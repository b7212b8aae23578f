"""Scale: synthetic collections far past the demo's, on the CPU and on a GPU.

    python bench/scale.py [--sizes 1000000 5000000] [--dimension 384] [--queries 200] [--repeats 3] [--work DIR] [--keep]
    python bench/scale.py --structures hnsw ivf binary int8 [--no-loads] [--ef-construction N] [--clients 32] [--seconds 20]
                          [--root DIR [--no-serve]]
    python bench/scale.py --device cuda [--sizes 8841823] [--dimension 768] [--passages 20000] [--batch-size 256]

CPU (the default), for each size: an index directory of clustered unit vectors (around the packaged
MiniLM's vectors of the demo passages, gaussian noise --sigma a dimension: real embeddings' structure
without encoding millions of texts; uniform noise has none, and no structure works on it) and short generated
texts, written in chunks through the index writer (retrieval/index_writer.py) with the encoder
record of the packaged MiniLM, so the service serves it with the real encoder (the HTTP figures
need --dimension 384, MiniLM's). Then one line per figure:
- build time without the model: passages into SQLite, vectors into FAISS, the manifest's checksums
  (the writer holds the flat index in memory while it writes it: the build's peak RSS is printed);
- load time of `dense_index.load_index`, memory-mapped and read, each in a fresh process: cold (this
  file's pages first dropped from the page cache with posix_fadvise DONTNEED; other files untouched)
  and warm (the median of --repeats loads after that one), with the RSS after the load, private
  (RssAnon) and file-backed (RssFile, shared through the page cache), and the first search's time
  (a mapped index reads its pages then, not at load);
- /search p50 over HTTP against `python -m service` (SEARCH_INDEX_MMAP true, then false;
  SEARCH_VERIFY_CHECKSUMS false, so start-up does not read the whole file for its sha256), --queries
  sequential demo queries at k=10 and k=1000, beside the service's own retrieve p50 and its RSS.
With --structures, for each size (and for a --reference-size index, 10k by default): the index served
as it is (the flat scan) and then with each candidate structure (`python -m index_builder ann`, timed, on
a generation of hard links beside it), one service at a time: its RSS after load, single-query /search p50
and p99 (round trip and the service's `latency_ms.retrieve`), throughput of --clients clients for
--seconds, recall@10 of its answers against the flat scan's on the same queries, and its recall card
(held-out passages); each a ratio against the flat scan measured in the same run. hnsw or ivf under
--target-recall on the queries is served again with twice the candidates (SEARCH_CANDIDATES: hnsw's search
twice as wide, ivf's twice the lists), up to 4,096.
--root keeps the indexes and reuses them: `--no-serve` builds them while the machine is busy, a later run
serves them alone.

With `--device cuda` (a GPU that torch sees; otherwise a one-line error, exit 2; where faiss sees
none, a faiss-cpu build, the flat-search part is skipped saying so and the encoders still run):
- the HBM bandwidth measured in the same run (a sum over, and a device-to-device copy of, a tensor
  as big as the index, or 40% of the free memory if less), and the bound it gives a flat search,
  which reads every vector once per call: index bytes / read bandwidth;
- flat search over --sizes random unit vectors (default 8,841,823 x 768, MS MARCO's passages),
  placed as the service places an index with device cuda (dense_index.shard_over_gpus), in fp32
  and with fp16 storage: one query and batches of 64, at k=10 and k=1000, each against the bound;
- encoding --passages generated passages with the packaged MiniLM in fp16: the builder's encoder
  (index_builder's BiEncoder, fp16=True) and the whole builder (build_index, encode + store +
  write), against sentence-transformers' `SentenceTransformer(path).encode(..., batch_size=...)`
  in fp16 on the same GPU (imported only here: `pip install sentence-transformers` if missing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from index_builder.build import BuildOptions, build_index, encoder_record  # noqa: E402
from models.encoder import BiEncoder, default_model_path  # noqa: E402
from retrieval import dense_index, index_writer  # noqa: E402
from retrieval.candidates.registry import KINDS  # noqa: E402
from retrieval.index_format import INDEX_FILE, MANIFEST_FILE, CorpusRecord, EncoderRecord, read_manifest  # noqa: E402

DEMO_CORPUS = ROOT / "data" / "demo" / "corpus.tsv"
CHUNK = 100_000  # rows generated and written at a time
MIB = 2**20

# Run by a fresh interpreter per load (argv: ROOT, index file, "1" to memory-map): one JSON line.
LOADER = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
from retrieval import dense_index

def memory():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {name: int(fields[name].split()[0]) * 1024 for name in ("VmRSS", "RssAnon", "RssFile")}

before = memory()
started = time.perf_counter()
index = dense_index.load_index(sys.argv[2], "cpu", mmap=sys.argv[3] == "1")
loaded = time.perf_counter()
after_load = memory()
dense_index.search(index, np.random.default_rng(0).standard_normal((1, index.d), dtype=np.float32), 10)
searched = time.perf_counter()
print(json.dumps({"load_s": loaded - started, "first_search_s": searched - loaded, "before": before,
                  "after_load": after_load, "after_search": memory()}))
"""


def vocabulary() -> np.ndarray:
    """The demo corpus's distinct lower-case words: generated texts tokenize like English."""
    return np.array(sorted(set(re.findall(r"[a-z]{2,}", DEMO_CORPUS.read_text(encoding="utf-8").lower()))))


def generated_texts(rng: np.random.Generator, words: np.ndarray, count: int, low: int, high: int) -> list[str]:
    """`count` texts of `low` to `high` words drawn from `words`."""
    lengths = rng.integers(low, high + 1, size=count)
    drawn = words[rng.integers(0, len(words), size=int(lengths.sum()))]
    ends = np.cumsum(lengths)
    return [" ".join(drawn[end - length : end]) for end, length in zip(ends, lengths)]


def unit_vectors(rng: np.random.Generator, count: int, dimension: int) -> np.ndarray:
    vectors = rng.standard_normal((count, dimension), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors


def demo_centres(encoder: BiEncoder, dimension: int) -> np.ndarray:
    """Cluster centres: the encoder's vectors of the demo passages where it is `dimension`-d (the
    demo queries then land near clusters, as real queries near real passages), else random ones."""
    if encoder.spec.dimension != dimension:
        return unit_vectors(np.random.default_rng(1), 3000, dimension)
    texts = [line.split("\t", 1)[1] for line in DEMO_CORPUS.read_text(encoding="utf-8").splitlines() if "\t" in line]
    return np.asarray(encoder.encode_passages(texts), dtype=np.float32)


def clustered_vectors(rng: np.random.Generator, centres: np.ndarray, count: int, sigma: float) -> np.ndarray:
    """`count` unit vectors, each a random centre plus gaussian noise `sigma` a dimension, normalised."""
    vectors = centres[rng.integers(0, len(centres), size=count)]
    vectors += sigma * rng.standard_normal(vectors.shape, dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors


def mib(value: float) -> str:
    return f"{value / MIB:,.0f} MiB"


# ---------------------------------------------------------------- CPU: build, load, serve


def reusable(index: Path) -> bool:
    """Whether `index` is a whole index a --root run left (the writer moves a finished one into place)."""
    return (index / MANIFEST_FILE).is_file()


def build_synthetic(out: Path, size: int, dimension: int, record: EncoderRecord, centres: np.ndarray,
                    sigma: float, bm25: bool = False) -> dict[str, float]:
    """An index directory at `out` of `size` clustered unit vectors and short texts (with `bm25`, a BM25 index of
    them); seconds per step."""
    rng = np.random.default_rng(size)
    words = vocabulary()
    work = out.parent / f".{out.name}.partial"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    seconds = {}
    started = time.perf_counter()
    connection = index_writer.open_store(work)
    with tqdm(total=size, desc=f"{size:,} passages", unit=" passages", file=sys.stderr) as progress:
        for first in range(0, size, CHUNK):
            texts = generated_texts(rng, words, min(CHUNK, size - first), 8, 16)
            index_writer.insert_passages(
                connection, ((first + i, f"p{first + i}", text, first + i + 1) for i, text in enumerate(texts)))
            progress.update(len(texts))
    connection.close()
    seconds["passages"] = time.perf_counter() - started

    def parts():
        with tqdm(total=size, desc=f"{size:,} vectors", unit=" vectors", file=sys.stderr) as progress:
            for first in range(0, size, CHUNK):
                part = clustered_vectors(rng, centres, min(CHUNK, size - first), sigma)
                progress.update(len(part))
                yield part

    started = time.perf_counter()
    count = index_writer.write_vectors(work, parts(), dimension)
    seconds["vectors"] = time.perf_counter() - started
    started = time.perf_counter()
    corpus = CorpusRecord(path=f"synthetic:{size}x{dimension}", format="tsv", passages=count, skipped=0, sha256=None)
    index_writer.write_manifest(work, encoder=record, corpus=corpus, count=count, bm25=bm25)
    index_writer.move_into_place(work, out)
    seconds["manifest"] = time.perf_counter() - started
    return seconds


def drop_from_page_cache(path: Path) -> None:
    """Ask the kernel to drop this one file's cached pages (clean, unmapped ones; it may keep some)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


def load_in_fresh_process(path: Path, mmap: bool) -> dict:
    done = subprocess.run([sys.executable, "-c", LOADER, str(ROOT), str(path), "1" if mmap else "0"],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_loads(path: Path, repeats: int) -> dict[str, dict]:
    """Per mode: the cold load, then the median warm load (the cold one warmed the cache)."""
    results = {}
    for label, mmap in (("mmap", True), ("read", False)):
        drop_from_page_cache(path)
        cold = load_in_fresh_process(path, mmap)
        warm = [load_in_fresh_process(path, mmap) for _ in range(repeats)]
        middle = sorted(warm, key=lambda run: run["load_s"])[len(warm) // 2]
        results[label] = {"cold": cold, "warm": middle}
    return results


def process_memory(pid: int) -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {name: int(fields[name].split()[0]) * 1024 for name in ("VmRSS", "RssAnon", "RssFile")}


def maps_file(pid: int, path: Path) -> bool:
    """Whether process `pid` has `path` memory-mapped."""
    return str(path.resolve()) in Path(f"/proc/{pid}/maps").read_text()


def bench_http(index: Path, queries: list[str], ks: tuple[int, ...], blocks: int = 10) -> dict[str, dict]:
    """Per mode (SEARCH_INDEX_MMAP true and false, both services up at once): p50 ms per k of `queries`
    sent one at a time (client round trip, and the service's own retrieve), in alternating blocks so
    that a shared host whose speed drifts weighs on both alike; then the service's memory and whether
    it maps the index file."""
    from bench.load import Server  # the service stack: needed for the HTTP figures alone

    modes = ("mmap", "read")
    results: dict[str, dict] = {label: {} for label in modes}
    with (Server(index, "cpu", index_mmap="true", verify_checksums="false") as mapped,
          Server(index, "cpu", index_mmap="false", verify_checksums="false") as read):
        servers = {"mmap": mapped, "read": read}
        clients = {label: httpx.Client(base_url=server.base, timeout=60, trust_env=False)
                   for label, server in servers.items()}

        def send(label: str, part: list[str], k: int, into: tuple[list[float], list[float]] | None = None) -> None:
            for query in part:
                started = time.perf_counter()
                response = clients[label].post("/search", json={"query": query, "k": k})
                elapsed = 1000 * (time.perf_counter() - started)
                response.raise_for_status()
                if into is not None:
                    into[0].append(elapsed)
                    into[1].append(response.json()["latency_ms"]["retrieve"])

        try:
            for k in ks:
                times: dict[str, tuple[list[float], list[float]]] = {label: ([], []) for label in modes}
                for label in modes:
                    send(label, queries[:5], k)  # warm-up
                size = max(1, len(queries) // blocks)
                for number, first in enumerate(range(0, len(queries), size)):
                    for label in (modes if number % 2 == 0 else reversed(modes)):
                        send(label, queries[first : first + size], k, times[label])
                for label, (round_trips, retrieves) in times.items():
                    results[label][k] = (statistics.median(round_trips), statistics.median(retrieves))
            for label, server in servers.items():
                results[label]["memory"] = process_memory(server.process.pid)
                results[label]["maps"] = maps_file(server.process.pid, index / INDEX_FILE)
        finally:
            for client in clients.values():
                client.close()
    return results


def structure_variant(base: Path, kind: str, ef_construction: int | None) -> tuple[Path, float]:
    """A generation of `base` (hard links; the manifest copied) with a `kind` structure added by
    `python -m index_builder ann`, and that command's seconds (the build, the recall card, the checksums).
    One a --root run left is reused (its seconds: the structure's build as its manifest records it)."""
    variant = base.parent / f"{base.name}-{kind}"
    if reusable(variant) and [record.kind for record in read_manifest(variant).candidates] == [kind]:
        print(f"  {variant}: reused", flush=True)
        return variant, read_manifest(variant).candidates[0].seconds
    if variant.exists():
        shutil.rmtree(variant)
    variant.mkdir()
    for entry in base.iterdir():
        if entry.name == MANIFEST_FILE:
            shutil.copy2(entry, variant / entry.name)
        elif entry.is_file():
            os.link(entry, variant / entry.name)
    command = [sys.executable, "-m", "index_builder", "ann", "--index", str(variant), "--kind", kind]
    if kind == "hnsw" and ef_construction is not None:
        command += ["--ef-construction", str(ef_construction)]
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT)
    return variant, time.perf_counter() - started


def serve_figures(index: Path, queries: list[str], clients: int, seconds: float, **settings: str) -> dict:
    """One service over `index` (SEARCH_VERIFY_CHECKSUMS false; its default memory mapping): RSS after
    load, then `queries` sent one at a time at k=10 (round trip and retrieve ms, the ids found, how each
    was answered), then --clients clients for --seconds (requests/s, p50, p99, errors)."""
    from bench.load import Server, alternate, search_request  # the service stack: needed for these figures alone

    with Server(index, "cpu", verify_checksums="false", **settings) as server:
        loaded = process_memory(server.process.pid)
        round_trips, retrieves, found, searched = [], [], [], set()
        with httpx.Client(base_url=server.base, timeout=300, trust_env=False) as client:
            for number, query in enumerate(queries[:5] + queries):
                started = time.perf_counter()
                response = client.post("/search", json={"query": query, "k": 10})
                elapsed = 1000 * (time.perf_counter() - started)
                response.raise_for_status()
                if number >= 5:  # the first five warm up
                    answer = response.json()
                    round_trips.append(elapsed)
                    retrieves.append(answer["latency_ms"]["retrieve"])
                    found.append([hit["id"] for hit in answer["results"]])
                    searched.add(answer["search"])
        load = asyncio.run(alternate({"load": (server.base, search_request(10))}, clients, seconds, 1, light=True,
                                     timeout_s=600))["load"].row()
        served = process_memory(server.process.pid)
    return {"rss_loaded": loaded["VmRSS"], "rss_anon": loaded["RssAnon"], "rss_served": served["VmRSS"],
            "p50": statistics.median(round_trips), "p99": float(np.percentile(round_trips, 99)),
            "retrieve_p50": statistics.median(retrieves), "retrieve_p99": float(np.percentile(retrieves, 99)),
            "found": found, "searched": sorted(searched), "load": load}


def overlap_at_10(found: list[list[str]], exact: list[list[str]]) -> float:
    """The mean share of the exact top 10 that `found`'s top 10 holds, query by query."""
    return float(np.mean([len(set(a[:10]) & set(b[:10])) / max(1, len(b[:10])) for a, b in zip(found, exact)]))


def bench_structures(base: Path, kinds: list[str], args: argparse.Namespace, queries: list[str]) -> dict[str, dict]:
    """The flat scan, then each structure, one service at a time; see the module's docstring."""
    rows = {"flat": serve_figures(base, queries, args.clients, args.seconds)}
    flat = rows["flat"]
    print(f"  flat: RSS after load {mib(flat['rss_loaded'])}; /search p50 {flat['p50']:.1f} ms, p99 "
          f"{flat['p99']:.1f} ms; retrieve p50 {flat['retrieve_p50']:.2f} ms; {flat['load']['rps']:.1f} requests/s "
          f"under {args.clients} clients (p50 {flat['load']['p50']:.0f} ms, errors {flat['load']['errors']}); "
          f"answered {', '.join(flat['searched'])}", flush=True)
    for kind in kinds:
        variant, built = structure_variant(base, kind, args.ef_construction)
        record = read_manifest(variant).candidates[0]
        depth = record.depth
        while True:
            settings = {} if depth == record.depth else {"candidates": str(depth)}
            row = serve_figures(variant, queries, args.clients, args.seconds, **settings)
            row.update(build_s=built, record=record, bytes=(variant / record.file).stat().st_size,
                       recall=overlap_at_10(row["found"], flat["found"]))
            print_structure_row(kind, row, flat, depth, args, len(queries))
            rows[kind if depth == record.depth else f"{kind}@{depth}"] = row
            if row["recall"] >= args.target_recall or kind not in ("hnsw", "ivf") or depth >= 4096:
                break
            depth *= 2  # under the target: the same graph searched wider, or twice the lists (SEARCH_CANDIDATES)
        if not args.keep and args.root is None:
            shutil.rmtree(variant)
    return rows


def print_structure_row(kind: str, row: dict, flat: dict, depth: int, args: argparse.Namespace, queries: int) -> None:
    """One line of a structure's figures, each against the flat scan's (`flat`)."""
    record, size = row["record"], args.current_size
    print(f"  {kind} {dict(record.params) or ''} depth {depth}: built in {row['build_s']:.0f} s "
          f"(`ann`, recall card included), {row['bytes'] / max(size, 1):.0f} bytes a passage; RSS after load "
          f"{mib(row['rss_loaded'])} ({row['rss_loaded'] / flat['rss_loaded']:.2f}x flat's); /search p50 "
          f"{row['p50']:.1f} ms ({flat['p50'] / row['p50']:.1f}x faster), p99 {row['p99']:.1f} ms; retrieve p50 "
          f"{row['retrieve_p50']:.2f} ms ({flat['retrieve_p50'] / row['retrieve_p50']:.0f}x faster), p99 "
          f"{row['retrieve_p99']:.2f} ms; {row['load']['rps']:.1f} requests/s under {args.clients} clients "
          f"({row['load']['rps'] / flat['load']['rps']:.1f}x; p50 {row['load']['p50']:.0f} ms, errors "
          f"{row['load']['errors']}); recall@10 {row['recall']:.4f} on the {queries} queries, card "
          f"{record.recall_at_10:.4f} ({record.sample} {record.recall_queries}); answered "
          f"{', '.join(row['searched'])}", flush=True)


def run_cpu(args: argparse.Namespace, sizes: list[int], dimension: int) -> str:
    from bench.load import QUERIES

    encoder = BiEncoder(device="cpu")  # the packaged MiniLM: the record the service will check
    spec = encoder.spec
    record = encoder_record(encoder).model_copy(update={"dimension": dimension})
    centres = demo_centres(encoder, dimension)
    del encoder
    serve = dimension == spec.dimension
    queries = [QUERIES[i % len(QUERIES)] for i in range(args.queries)]
    root = args.root or Path(tempfile.mkdtemp(prefix="scale-", dir=args.work))
    root.mkdir(parents=True, exist_ok=True)
    keep = args.keep or args.root is not None
    structures = args.structures if serve else []
    if args.structures and not serve:
        print(f"--structures skipped: the service's encoder (MiniLM) is {spec.dimension}-d, these vectors {dimension}-d")
    reference = [args.reference_size] if structures and args.reference_size not in sizes else []
    summary, served = [], {}
    try:
        for size in reference + sizes:
            out = root / f"synthetic-{size}"
            if args.root is not None and reusable(out):
                print(f"\n{out}: reused")
                steps = {"passages": 0.0, "vectors": 0.0, "manifest": 0.0}
            else:
                steps = build_synthetic(out, size, dimension, record, centres, args.sigma)
            index_file = out / INDEX_FILE
            vector_bytes = size * dimension * 4
            print(f"\n{size:,} passages x {dimension}-d ({mib(vector_bytes)} of vectors, index folder {out})")
            print(f"build without the model: {sum(steps.values()):.1f} s (passages {steps['passages']:.1f} s, "
                  f"vectors {steps['vectors']:.1f} s, manifest checksums {steps['manifest']:.1f} s)")
            print(f"build peak RSS (this process so far): {mib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}")
            line = f"{size:,}:"
            if args.loads and size not in reference:
                loads = bench_loads(index_file, args.repeats)
                for label, runs in loads.items():
                    for state, run in runs.items():
                        grown = run["after_load"]["RssAnon"] - run["before"]["RssAnon"]
                        print(f"load {label}, {state}: {run['load_s']:.3f} s, first search {run['first_search_s']:.3f} s; "
                              f"RSS after load {mib(run['after_load']['VmRSS'])} (private +{mib(grown)}), "
                              f"after the first search {mib(run['after_search']['VmRSS'])} "
                              f"(file-backed {mib(run['after_search']['RssFile'])})")
                mapped, read = loads["mmap"]["warm"], loads["read"]["warm"]
                print(f"warm load read / mmap = {read['load_s'] / max(mapped['load_s'], 1e-6):.0f}x; private RSS growth "
                      f"mmap {mib(mapped['after_load']['RssAnon'] - mapped['before']['RssAnon'])} against read "
                      f"{mib(read['after_load']['RssAnon'] - read['before']['RssAnon'])}")
                line = (f"{size:,}: warm load mmap {mapped['load_s']:.3f} s / read {read['load_s']:.2f} s, "
                        f"RSS {mib(mapped['after_load']['VmRSS'])} / {mib(read['after_load']['VmRSS'])}")
                if not serve:
                    print(f"/search over HTTP skipped: the service's encoder (MiniLM) is {spec.dimension}-d, "
                          f"these vectors {dimension}-d")
                else:
                    p50 = {}
                    for label, figures in bench_http(out, queries, (10, 1000)).items():
                        memory, maps = figures.pop("memory"), figures.pop("maps")
                        for k, (round_trip, retrieve) in figures.items():
                            p50[label, k] = round_trip
                            print(f"/search {label}, k={k}: p50 {round_trip:.1f} ms over {len(queries)} sequential "
                                  f"queries (the service's retrieve p50 {retrieve:.1f} ms)")
                        print(f"service RSS {label}, after the queries: {mib(memory['VmRSS'])} (private "
                              f"{mib(memory['RssAnon'])}, file-backed {mib(memory['RssFile'])}); "
                              f"{INDEX_FILE} {'memory-mapped' if maps else 'not mapped'}")
                        if maps != (label == "mmap"):
                            print(f"WARNING: SEARCH_INDEX_MMAP={str(label == 'mmap').lower()} was not honoured by the "
                                  "service: these two rows do not compare mmap with read")
                    print("/search p50 mmap / read = " + ", ".join(
                        f"{p50['mmap', k] / p50['read', k]:.2f}x at k={k}" for k in (10, 1000)))
                    line += f", /search p50 k=10 {p50['mmap', 10]:.1f} / {p50['read', 10]:.1f} ms"
            if structures and not args.serve:
                for kind in structures:
                    variant, built = structure_variant(out, kind, args.ef_construction)
                    print(f"  {kind}: `ann` {built:.0f} s, {read_manifest(variant).candidates[0]}", flush=True)
            elif structures:
                print(f"structures over {size:,} passages, one service at a time ({args.queries} sequential queries "
                      f"at k=10, then {args.clients} clients for {args.seconds:.0f} s):", flush=True)
                args.current_size = size
                served[size] = bench_structures(out, structures, args, queries)
                rows = served[size]
                line += " " + ", ".join(
                    f"{kind} retrieve p50 {row['retrieve_p50']:.2f} ms ({rows['flat']['retrieve_p50'] / row['retrieve_p50']:.0f}x)"
                    + (f" recall@10 {row['recall']:.4f}" if kind != "flat" else "") for kind, row in rows.items())
            if size not in reference:
                summary.append(line)
            if not keep:
                shutil.rmtree(out)
        for size in sizes if structures and args.serve else []:
            if size == args.reference_size:
                continue
            small = served[args.reference_size]
            ratios = ", ".join(f"{kind} {row['p50'] / small[kind]['p50']:.2f}x" for kind, row in served[size].items()
                               if kind in small)
            print(f"/search p50 at {size:,} against {args.reference_size:,} passages, same kind: {ratios}")
            summary.append(f"/search p50 {size:,} / {args.reference_size:,}: {ratios}")
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    return "; ".join(summary) + ("" if not keep else f" (indexes kept in {root})")


# ---------------------------------------------------------------- GPU: flat search, encoders


def gpu_problem() -> str | None:
    """Why `--device cuda` cannot run here at all, or None."""
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (no GPU, or a CPU build of torch)"
    return None


def faiss_gpu_problem() -> str | None:
    """Why the flat-search part cannot run (the encoders still can), or None."""
    if dense_index.gpu_count() == 0:
        return "faiss sees no GPU (a faiss-cpu build: install faiss-gpu 1.15 or later)"
    return None


def cuda_seconds(operation, repeats: int = 5) -> float:
    """Best time of `operation` on the current stream, by CUDA events, after one warm-up."""
    operation()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        operation()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return best


def hbm_bandwidth(nbytes: int) -> tuple[float, float, int]:
    """(read bytes/s of a sum over a tensor of `nbytes`, or 40% of free memory if less; read+write
    bytes/s of a device-to-device copy of it; the bytes used)."""
    free, _ = torch.cuda.mem_get_info()
    nbytes = min(nbytes, int(0.4 * free)) // 4 * 4
    tensors = {"source": torch.rand(nbytes // 4, device="cuda")}
    read = nbytes / cuda_seconds(lambda: tensors["source"].sum())
    tensors["target"] = torch.empty_like(tensors["source"])
    copy = 2 * nbytes / cuda_seconds(lambda: tensors["target"].copy_(tensors["source"]))
    tensors.clear()
    torch.cuda.empty_cache()
    return read, copy, nbytes


def random_flat_index(size: int, dimension: int):
    """A CPU flat index of `size` random unit vectors, drawn on the GPU in chunks."""
    generator = torch.Generator(device="cuda").manual_seed(size)
    index = dense_index.new_flat_index(dimension)
    with tqdm(total=size, desc=f"{size:,} vectors", unit=" vectors", file=sys.stderr) as progress:
        for first in range(0, size, 4 * CHUNK):
            rows = min(4 * CHUNK, size - first)
            part = torch.randn(rows, dimension, device="cuda", generator=generator)
            index.add(torch.nn.functional.normalize(part, dim=1).cpu().numpy())
            progress.update(rows)
    return index


def time_search(index, probe: np.ndarray, k: int, singles: int = 50, batches: int = 10) -> tuple[float, float]:
    """p50 ms of one query per call and of 64 per call (faiss returns host arrays: the GPU is done)."""
    dense_index.search(index, probe[:64], k)  # warm-up
    single, batched = [], []
    for row in range(singles):
        started = time.perf_counter()
        dense_index.search(index, probe[row : row + 1], k)
        single.append(1000 * (time.perf_counter() - started))
    for number in range(batches):
        started = time.perf_counter()
        dense_index.search(index, probe[64 * number : 64 * (number + 1)], k)
        batched.append(1000 * (time.perf_counter() - started))
    return statistics.median(single), statistics.median(batched)


def bench_gpu_search(size: int, dimension: int) -> str:
    read, copy, used = hbm_bandwidth(size * dimension * 4)
    print(f"\n{torch.cuda.get_device_name()}: HBM read {read / 1e9:,.0f} GB/s (a sum over {mib(used)}), "
          f"copy {copy / 1e9:,.0f} GB/s (read + write)")
    cpu_index = random_flat_index(size, dimension)
    probe = np.random.default_rng(1).standard_normal((640, dimension), dtype=np.float32)
    probe /= np.linalg.norm(probe, axis=1, keepdims=True)
    ratios = []
    for label, fp16, width in (("fp32", False, 4), ("fp16 storage", True, 2)):
        index = dense_index.shard_over_gpus(cpu_index, fp16=fp16)
        bound = 1000 * size * dimension * width / read
        print(f"{size:,} x {dimension} {label} ({mib(size * dimension * width)}): bound (every vector read once "
              f"per call) {bound:.2f} ms")
        for k in (10, 1000):
            single, batched = time_search(index, probe, k)
            print(f"{label}, k={k}: one query p50 {single:.2f} ms ({single / bound:.2f}x the bound); batch of 64 "
                  f"p50 {batched:.2f} ms ({batched / bound:.2f}x the bound, {batched / 64:.3f} ms/query)")
            ratios.append(f"{label} k={k} {single / bound:.2f}x")
        del index
        torch.cuda.empty_cache()
    del cpu_index
    return f"{size:,} x {dimension}: one query / bound " + ", ".join(ratios)


def bench_encoders(passages: int, batch_size: int, device: str = "cuda", fp16: bool = True) -> str:
    """Passages/s of the builder's encoder, the whole builder, and sentence-transformers' encode."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print("encoders skipped: sentence-transformers is not installed (pip install sentence-transformers)")
        return "encoders skipped"
    texts = generated_texts(np.random.default_rng(2), vocabulary(), passages, 20, 120)  # MS MARCO-like lengths
    builder = BiEncoder(device=device, batch_size=batch_size, fp16=fp16)
    reference = SentenceTransformer(str(default_model_path()), device=device)
    reference.max_seq_length = builder.spec.passage_max_tokens  # both cut passages alike (256 for MiniLM)
    if fp16:
        reference.half()
    encoders = {  # each returns numpy: the device has finished
        "builder encoder": lambda part: builder.encode_passages(part),
        "sentence-transformers": lambda part: reference.encode(part, batch_size=batch_size, convert_to_numpy=True,
                                                               show_progress_bar=False),
    }
    best, vectors = {label: float("inf") for label in encoders}, {}
    for encode in encoders.values():
        encode(texts[: 2 * batch_size])  # warm-up: kernels, allocator
    for _ in range(2):  # alternating, best of two each
        for label, encode in encoders.items():
            started = time.perf_counter()
            vectors[label] = encode(texts)
            best[label] = min(best[label], time.perf_counter() - started)
    agreement = float(np.mean(np.sum(vectors["builder encoder"] * vectors["sentence-transformers"], axis=1)))
    with tempfile.TemporaryDirectory() as folder:
        corpus = Path(folder) / "corpus.tsv"
        corpus.write_text("".join(f"p{i}\t{text}\n" for i, text in enumerate(texts)), encoding="utf-8")
        report = build_index(BuildOptions(corpus, Path(folder) / "index"), builder)
    rates = {label: passages / seconds for label, seconds in best.items()}
    rates["whole builder"] = report.passages_per_second
    where = f"{torch.cuda.get_device_name()}" if device.startswith("cuda") else "CPU"
    print(f"\nencoding {passages:,} generated passages (20 to 120 words), MiniLM {'fp16' if fp16 else 'fp32'}, "
          f"batch {batch_size}, {where}; mean cosine of the two encoders' vectors {agreement:.4f}")
    for label, rate in rates.items():
        print(f"{label}: {rate:,.0f} passages/s")
    ratios = {label: rates[label] / rates["sentence-transformers"] for label in ("builder encoder", "whole builder")}
    print("against sentence-transformers: " + ", ".join(f"{label} {ratio:.2f}x" for label, ratio in ratios.items()))
    return f"builder encoder {ratios['builder encoder']:.2f}x sentence-transformers"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--sizes", type=int, nargs="+", help="passages (default: 1000000 5000000; 8841823 on cuda)")
    parser.add_argument("--dimension", type=int, help="of the vectors (default: 384; 768 on cuda)")
    parser.add_argument("--queries", type=int, default=200, help="sequential /search queries per k and mode")
    parser.add_argument("--repeats", type=int, default=3, help="warm loads per mode (the median is printed)")
    parser.add_argument("--work", type=Path, help="folder for the indexes (default: the system's temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the indexes built")
    parser.add_argument("--sigma", type=float, default=0.05, help="noise a dimension around each cluster centre")
    parser.add_argument("--structures", nargs="+", choices=list(KINDS), default=[],
                        help="candidate structures served, each against the flat scan (CPU)")
    parser.add_argument("--ef-construction", type=int, help="hnsw's, passed to `index_builder ann` (default its own)")
    parser.add_argument("--root", type=Path, help="keep the indexes here, and reuse those an earlier run left")
    parser.add_argument("--no-serve", dest="serve", action="store_false",
                        help="with --structures: build the indexes and structures only (serve them in a later run)")
    parser.add_argument("--target-recall", type=float, default=0.99,
                        help="hnsw or ivf served again with twice the candidates while its recall@10 is under this")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients for the throughput figure")
    parser.add_argument("--seconds", type=float, default=20.0, help="of load per service for the throughput figure")
    parser.add_argument("--reference-size", type=int, default=10_000,
                        help="a small index served alike, whose /search p50 the large ones are compared with")
    parser.add_argument("--no-loads", dest="loads", action="store_false",
                        help="skip the load figures (memory-mapped against read, cold and warm)")
    parser.add_argument("--passages", type=int, default=20_000, help="generated passages encoded (cuda)")
    parser.add_argument("--batch-size", type=int, default=256, help="encoding batch (cuda)")
    args = parser.parse_args()
    on_gpu = args.device == "cuda"
    sizes = args.sizes or ([8_841_823] if on_gpu else [1_000_000, 5_000_000])
    dimension = args.dimension or (768 if on_gpu else 384)
    if min(sizes) < 1 or dimension < 1 or args.queries < 1 or args.repeats < 1 or args.passages < 1:
        parser.error("--sizes, --dimension, --queries, --repeats and --passages must be at least 1")
    if on_gpu and (problem := gpu_problem()):
        print(f"bench/scale.py: --device cuda: {problem}", file=sys.stderr)
        sys.exit(2)
    started = time.perf_counter()
    if on_gpu:
        if problem := faiss_gpu_problem():
            print(f"flat search skipped: {problem}")
            parts = [f"flat search skipped ({problem})"]
        else:
            parts = [bench_gpu_search(size, dimension) for size in sizes]
        parts.append(bench_encoders(args.passages, args.batch_size))
        summary = "; ".join(parts)
    else:
        summary = run_cpu(args, sorted(sizes), dimension)
    print(f"\nscale ({args.device}) in {time.perf_counter() - started:.0f} s: {summary}")


if __name__ == "__main__":
    main()
