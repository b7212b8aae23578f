"""Writes over HTTP: upserts a second, read-after-write latency, searches during a write stream, a replica's lag,
and compaction against a full rebuild.

    python bench/writes.py [--seconds 20] [--size 100000] [--work DIR] [--only served|compaction|first-search]

Served (`python -m service`, SEARCH_WRITES=true, on a copy of an index of the demo corpus with BM25 and an int8
structure, built once into --work): upserts of generated passages (bench/scale.py's texts, 40 to 80 words) at 1,
16 and 64 a request, one client, requests back to back; read-after-write, a one-passage upsert then a dense
search for its text until it is the first hit (the time from sending the upsert); /search p50/p99 from 4
clients for --seconds idle, then as long with one more client streaming 16-passage upserts; a replica's lag,
a second service on the same folder with SEARCH_WATCH_INDEX (interval 0.5 s) while the writer compacts every 64
passages written: from the answer to the write that starts a compaction to the replica's /ready naming the new
generation. Library (`retrieval.compaction`): a synthetic --size index (bench/scale.py's clustered vectors) with BM25 and
the --structure kinds, 1,000 passages upserted (encoded) and 1,000 deleted, compacted (its peak RSS sampled);
against it, BM25 and each structure built afresh on the compacted generation (measured), and a full rebuild of
the changed collection: encoding every passage at the rate the upserts were encoded (computed, not run: at ~60
passages a second a real rebuild of 100k passages takes about half an hour on a 2-core CPU) plus those builds.
First search (library, the same synthetic --size index with BM25): a search in each mode at rest, then after
each of 30 one-passage upserts the first search in that mode (its query the written passage's first words);
p50/p99 of both, and BM25 built again from the texts against the compaction's BM25 written from terms.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.load import Server  # noqa: E402
from bench.scale import build_synthetic, demo_centres, generated_texts, vocabulary  # noqa: E402
from index_builder.ann import AnnOptions  # noqa: E402
from index_builder.build import BuildOptions, build_index, encoder_record  # noqa: E402
from models.encoder import BiEncoder  # noqa: E402
from retrieval.bm25_index import build_bm25  # noqa: E402
from retrieval import index_writer  # noqa: E402
from retrieval.compaction import compact  # noqa: E402
from retrieval.index_format import read_manifest  # noqa: E402
from retrieval.load_options import LoadOptions  # noqa: E402
from retrieval.searcher import Searcher  # noqa: E402
from retrieval.writes import Writes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SEARCH_CLIENTS = 4


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


class Texts:
    def __init__(self, seed: int) -> None:
        self.rng, self.words, self.made = np.random.default_rng(seed), vocabulary(), 0

    def passages(self, count: int) -> list[dict]:
        texts = generated_texts(self.rng, self.words, count, 40, 80)
        self.made += count
        return [{"id": f"w{self.made - count + i}", "text": text} for i, text in enumerate(texts)]


def upserts_a_second(client: httpx.Client, texts: Texts, per_request: int, seconds: float) -> str:
    latencies, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.perf_counter()
        client.post("/passages", json={"passages": texts.passages(per_request)}).raise_for_status()
        latencies.append(time.perf_counter() - started)
    total = sum(latencies)
    return (f"| {per_request} | {len(latencies) / total:.1f} | {per_request * len(latencies) / total:.1f} | "
            f"{1000 * percentile(latencies, 50):.0f} | {1000 * percentile(latencies, 99):.0f} |")


def read_after_write(client: httpx.Client, texts: Texts, trials: int) -> list[float]:
    seen = []
    for _ in range(trials):
        (passage,) = texts.passages(1)
        started = time.perf_counter()
        client.post("/passages", json={"passages": [passage]}).raise_for_status()
        while client.post("/search", json={"query": passage["text"], "k": 1}).json()["results"][0]["id"] != passage["id"]:
            pass
        seen.append(time.perf_counter() - started)
    return seen


def searches_during(base: str, seconds: float, writing: bool, texts: Texts) -> list[float]:
    latencies, stop = [], threading.Event()

    def search(number: int) -> None:
        with httpx.Client(base_url=base, timeout=60, trust_env=False) as client:
            queries = generated_texts(np.random.default_rng(number), texts.words, 200, 4, 10)
            for i in range(10**9):
                if stop.is_set():
                    return
                started = time.perf_counter()
                client.post("/search", json={"query": queries[i % len(queries)], "k": 10}).raise_for_status()
                latencies.append(time.perf_counter() - started)

    def write() -> None:
        with httpx.Client(base_url=base, timeout=60, trust_env=False) as client:
            while not stop.is_set():
                client.post("/passages", json={"passages": texts.passages(16)}).raise_for_status()

    threads = [threading.Thread(target=search, args=(i,)) for i in range(SEARCH_CLIENTS)]
    threads += [threading.Thread(target=write)] if writing else []
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    return latencies


def replica_lag(writer: httpx.Client, replica: httpx.Client, texts: Texts, rounds: int) -> list[float]:
    lags = []
    for _ in range(rounds):
        before = writer.get("/ready").json()["index"]["generation"]
        for _ in range(3):
            writer.post("/passages", json={"passages": texts.passages(16)}).raise_for_status()
        started = time.perf_counter()
        writer.post("/passages", json={"passages": texts.passages(16)}).raise_for_status()  # the 64th: compaction
        while (generation := writer.get("/ready").json()["index"]["generation"]) == before:
            time.sleep(0.05)
        while replica.get("/ready").json()["index"]["generation"] != generation:
            time.sleep(0.05)
        lags.append(time.perf_counter() - started)
    return lags


def served(args: argparse.Namespace, encoder: BiEncoder) -> None:
    built = args.work / "demo-index"
    if not built.exists():
        build_index(BuildOptions(ROOT / "data" / "demo" / "corpus.tsv", built, bm25=True,
                                 ann=[AnnOptions("int8")]), encoder)
    index = args.work / "served"
    shutil.rmtree(index, ignore_errors=True)
    shutil.copytree(built, index)
    texts = Texts(1)
    with Server(index, "cpu", writes="true", compact_passages="1000000") as server, \
            httpx.Client(base_url=server.base, timeout=120, trust_env=False) as client:
        print(f"Upserts to a {3000:,}-passage index (one client, requests back to back, {args.seconds:.0f} s each):\n")
        print("| passages a request | requests/s | passages/s | p50 ms | p99 ms |\n|---|---|---|---|---|")
        for per_request in (1, 16, 64):
            print(upserts_a_second(client, texts, per_request, args.seconds))
        seen = read_after_write(client, texts, 50)
        print(f"\nread-after-write (upsert sent -> a search's first hit), 50 writes: p50 "
              f"{1000 * percentile(seen, 50):.0f} ms, p99 {1000 * percentile(seen, 99):.0f} ms")
        idle = searches_during(server.base, args.seconds, False, texts)
        busy = searches_during(server.base, args.seconds, True, texts)
        print(f"/search from {SEARCH_CLIENTS} clients: idle p50 {1000 * percentile(idle, 50):.0f} ms, p99 "
              f"{1000 * percentile(idle, 99):.0f} ms ({len(idle)} searches); during a stream of 16-passage upserts "
              f"p50 {1000 * percentile(busy, 50):.0f} ms, p99 {1000 * percentile(busy, 99):.0f} ms ({len(busy)}); "
              f"p99 ratio {percentile(busy, 99) / percentile(idle, 99):.2f}")
    shutil.rmtree(index)
    shutil.copytree(built, index)
    with Server(index, "cpu", writes="true", compact_passages="64") as writer_server, \
            Server(index, "cpu", watch_index="true", watch_interval_s="0.5") as replica_server, \
            httpx.Client(base_url=writer_server.base, timeout=120, trust_env=False) as writer, \
            httpx.Client(base_url=replica_server.base, timeout=120, trust_env=False) as replica:
        lags = replica_lag(writer, replica, texts, 5)
        print(f"replica lag (the 64th passage's write answered -> the replica's /ready names the compacted "
              f"generation), 5 compactions: median {statistics.median(lags):.1f} s, max {max(lags):.1f} s")


def compaction(args: argparse.Namespace, encoder: BiEncoder) -> None:
    out = args.work / f"synthetic-{args.size}-{'-'.join(args.structure) or 'flat'}"
    record = encoder_record(encoder)
    if not out.exists():
        build_synthetic(out, args.size, record.dimension, record, demo_centres(encoder, record.dimension), 0.35,
                        bm25=True)
        for kind in args.structure:
            index_writer.write_candidates(out, kind)
    index = args.work / "compacted"
    shutil.rmtree(index, ignore_errors=True)
    shutil.copytree(out, index)
    writes = Writes.open(Searcher(index, encoder, LoadOptions(device="cpu")))
    texts = Texts(2)
    passages = texts.passages(1000)
    started = time.perf_counter()
    vectors = encoder.encode_passages([passage["text"] for passage in passages])
    rate = len(passages) / (time.perf_counter() - started)
    for first in range(0, len(passages), 100):
        writes.upsert(passages[first:first + 100], vectors[first:first + 100])
    writes.delete(ids=[f"p{i}" for i in range(0, args.size, args.size // 1000)][:1000])
    rss = Rss()
    with rss:
        report = compact(writes, progress=True)
    writes.close()
    cards = {c.kind: (c.recall_at_10, c.seconds) for c in read_manifest(index).candidates}
    started = time.perf_counter()
    build_bm25(Searcher(index, encoder, LoadOptions(device="cpu")).passages.texts(), report.count,
               args.work / "bm25-again")
    bm25_again = time.perf_counter() - started
    built = {}
    for kind in args.structure:
        started = time.perf_counter()
        index_writer.write_candidates(index, kind, progress=False)
        built[kind] = time.perf_counter() - started
    rebuild = report.count / rate + bm25_again + sum(built.values())
    print(f"\ncompaction at {args.size:,} passages with BM25 and {', '.join(args.structure) or 'no structure'} "
          f"(1,000 upserted, 1,000 deleted): {report.seconds:.1f} s, peak RSS {rss.peak_gib:.2f} GiB; "
          + "; ".join(f"{kind} extended or rebuilt in {cards[kind][1]:.1f} s (recall@10 {cards[kind][0]}), "
                      f"built afresh {built[kind]:.1f} s" for kind in args.structure)
          + f"; BM25 built again from the texts {bm25_again:.1f} s; a full rebuild {rebuild:,.0f} s (encoding at "
          f"{rate:.0f} passages/s, computed, plus BM25 and the structures built): {rebuild / report.seconds:.0f}x "
          "the compaction")


class Rss:
    """The process's peak resident memory while the block runs (sampled every 50 ms), in GiB."""

    def __enter__(self) -> "Rss":
        self.peak, self.done = 0, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.done.wait(0.05):
            with open("/proc/self/statm") as statm:
                self.peak = max(self.peak, int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()

    @property
    def peak_gib(self) -> float:
        return self.peak / 2**30


MODES = {"hybrid (default)": {}, "bm25": {"mode": "bm25"}, "dense": {"mode": "dense"}}


def first_search(args: argparse.Namespace, encoder: BiEncoder) -> None:
    out = args.work / f"synthetic-bm25-{args.size}"
    record = encoder_record(encoder)
    if not out.exists():
        seconds = build_synthetic(out, args.size, record.dimension, record, demo_centres(encoder, record.dimension),
                                  0.35, bm25=True)
        print(f"built {args.size:,} passages with BM25: {seconds}")
    work = args.work / "first-search"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(out, work)
    writes = Writes.open(Searcher(work, encoder, LoadOptions(device="cpu")))
    texts, rounds = Texts(3), 30
    queries = [" ".join(p["text"].split()[:6]) for p in texts.passages(rounds)]
    print(f"\nFirst search after a one-passage write, {args.size:,} passages ({rounds} writes, exact dense):\n")
    print("| mode | at rest p50 ms | p99 ms | first after a write p50 ms | p99 ms | p50 ratio |")
    print("|---|---|---|---|---|---|")
    for name, options in MODES.items():
        rest = []
        for query in queries:
            started = time.perf_counter()
            writes.searcher.search(query, 10, exact=True, **options)
            rest.append(time.perf_counter() - started)
        after = []
        for passage in texts.passages(rounds):
            writes.upsert([passage])
            started = time.perf_counter()
            writes.searcher.search(" ".join(passage["text"].split()[:6]), 10, exact=True, **options)
            after.append(time.perf_counter() - started)
            found = writes.searcher.search(passage["text"], 1, exact=True, **options)  # seen at once
            assert found[0].id == passage["id"], (name, passage["id"], found)
        print(f"| {name} | {1000 * percentile(rest, 50):.1f} | {1000 * percentile(rest, 99):.1f} | "
              f"{1000 * percentile(after, 50):.1f} | {1000 * percentile(after, 99):.1f} | "
              f"{percentile(after, 50) / percentile(rest, 50):.2f} |")
    report = compact(writes)
    print(f"\n{report.summary()}")
    writes.close()
    store = args.work / "bm25-rebuilt"
    shutil.rmtree(store, ignore_errors=True)
    started = time.perf_counter()
    searcher = Searcher(work, encoder, LoadOptions(device="cpu"))
    build_bm25(searcher.passages.texts(), searcher.count, store)
    print(f"BM25 built again from the {searcher.count:,} texts: {time.perf_counter() - started:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--work", type=Path, default=None, help="where the indexes are kept (default: a temporary folder)")
    parser.add_argument("--structure", nargs="*", default=["int8"],
                        help="candidate structures on the compaction part's index (default: int8)")
    parser.add_argument("--only", choices=["served", "compaction", "first-search"], help="run one of the parts")
    args = parser.parse_args()
    temporary = None
    if args.work is None:
        temporary = tempfile.TemporaryDirectory()
        args.work = Path(temporary.name)
    args.work.mkdir(parents=True, exist_ok=True)
    encoder = BiEncoder(device="cpu")
    try:
        if args.only in (None, "served"):
            served(args, encoder)
        if args.only in (None, "compaction"):
            compaction(args, encoder)
        if args.only in (None, "first-search"):
            first_search(args, encoder)
    finally:
        if temporary is not None:
            temporary.cleanup()


if __name__ == "__main__":
    main()
