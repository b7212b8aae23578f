"""Writes over HTTP: upserts a second, read-after-write latency, searches during a write stream, a replica's lag,
and compaction against a full rebuild.

    python bench/writes.py [--seconds 20] [--size 100000] [--work DIR] [--only served|stream|compaction|first-search]

Served (`python -m service`, SEARCH_WRITES=true, on a copy of an index of the demo corpus with BM25 and an int8
structure, built once into --work): upserts of generated passages (bench/scale.py's texts, 40 to 80 words) at 1,
16 and 64 a request, one client, requests back to back; read-after-write, a one-passage upsert then a dense
search for its text until it is the first hit (the time from sending the upsert); /search p50/p99 from 4
clients for --seconds idle and as long with one more client streaming 16-passage upserts (alternating in 4
parts); a replica's lag,
a second service on the same folder with SEARCH_WATCH_INDEX (interval 0.5 s) while the writer compacts every 64
passages written: from the answer to the write that starts a compaction to the replica's /ready naming the new
generation. Stream (`--only stream`): /search from 4 clients idle and during a stream of 16-passage upserts,
alternating, on a fresh writer for each of --write-shares (SEARCH_WRITE_SHARE), and the passages the stream wrote
a second. Library: a synthetic --size index (bench/scale.py's clustered vectors and short texts) with BM25 and the
--structure kinds, built once into --work. Compaction: 1,000 passages upserted (encoded) and 1,000 deleted,
compacted in this process (its peak RSS sampled) while a replica (`python -m service`, SEARCH_WATCH_INDEX, interval
0.5 s) follows the folder: from the compaction's start to the replica's /ready naming the new generation; first
sealed, as the service compacts them (below SEARCH_MERGE_SHARE), then merged into the rows. Against the merge,
BM25 built again from the texts (measured) and each structure's build (its card's seconds, from the build of the
index compacted), and a full rebuild of the changed collection: encoding every passage at the rate the upserts
were encoded (computed, not run: at ~60 passages a second a real rebuild of 100k passages takes about half an
hour on a 2-core CPU) plus those builds. First search (the same index): a search in each mode at rest, then after
each of 30 one-passage upserts the first search in that mode (its query the written passage's first words, dense
through the structure where there is one), p50/p99 of both, and read-after-write (the upsert, its passage
encoded, then that search).
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
from service.settings import ServiceSettings  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MERGE_SHARE = ServiceSettings.model_fields["merge_share"].default  # the service's: below it, a compaction seals
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


def searches_during(base: str, seconds: float, writing: bool, texts: Texts) -> tuple[list[float], int]:
    """The /search latencies of SEARCH_CLIENTS clients for `seconds`, with one more client streaming 16-passage
    upserts where `writing`; and the passages those upserts wrote."""
    latencies, stop, written = [], threading.Event(), [0]

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
                written[0] += 16

    threads = [threading.Thread(target=search, args=(i,)) for i in range(SEARCH_CLIENTS)]
    threads += [threading.Thread(target=write)] if writing else []
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    return latencies, written[0]


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
    built = demo_index(args, encoder)
    index = fresh_copy(built, args.work / "served")
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
        print(f"/search from {SEARCH_CLIENTS} clients, idle and during a stream of 16-passage upserts:\n")
        print(STREAM_HEADER)
        print(stream_row(server.base, args.seconds, texts, "default"))
    fresh_copy(built, index)
    with Server(index, "cpu", writes="true", compact_passages="64") as writer_server, \
            Server(index, "cpu", watch_index="true", watch_interval_s="0.5") as replica_server, \
            httpx.Client(base_url=writer_server.base, timeout=120, trust_env=False) as writer, \
            httpx.Client(base_url=replica_server.base, timeout=120, trust_env=False) as replica:
        lags = replica_lag(writer, replica, texts, 5)
        print(f"replica lag (the 64th passage's write answered -> the replica's /ready names the compacted "
              f"generation), 5 compactions: median {statistics.median(lags):.1f} s, max {max(lags):.1f} s")


STREAM_HEADER = ("| SEARCH_WRITE_SHARE | idle p50 / p99 ms | during writes p50 / p99 ms | p99 ratio "
                 "| written passages/s |\n|---|---|---|---|---|")


def stream_row(base: str, seconds: float, texts: Texts, share: str, rounds: int = 4) -> str:
    """Idle and busy `seconds` each, in `rounds` alternating parts (a machine shared with other tenants drifts:
    alternating gives both the same conditions)."""
    idle, busy, written = [], [], 0
    for _ in range(rounds):
        idle += searches_during(base, seconds / rounds, False, texts)[0]
        latencies, count = searches_during(base, seconds / rounds, True, texts)
        busy, written = busy + latencies, written + count
    return (f"| {share} | {1000 * percentile(idle, 50):.0f} / {1000 * percentile(idle, 99):.0f} | "
            f"{1000 * percentile(busy, 50):.0f} / {1000 * percentile(busy, 99):.0f} | "
            f"{percentile(busy, 99) / percentile(idle, 99):.2f} | {written / seconds:.1f} |")


def stream(args: argparse.Namespace, encoder: BiEncoder) -> None:
    """/search idle and under a stream of upserts, a fresh writer over the demo index for each --write-shares."""
    built = demo_index(args, encoder)
    index = args.work / "served"
    texts = Texts(4)
    print(f"/search from {SEARCH_CLIENTS} clients ({args.seconds:.0f} s idle and as long during a stream of "
          "16-passage upserts, alternating in 4 parts), by the writes' share of the model thread:\n")
    print(STREAM_HEADER)
    for share in args.write_shares:
        fresh_copy(built, index)
        with Server(index, "cpu", writes="true", compact_passages="1000000", write_share=share) as server:
            print(stream_row(server.base, args.seconds, texts, share), flush=True)


def fresh_copy(built: Path, index: Path) -> Path:
    """`index`, a copy of `built` in place of whatever was there (a part writes to the index it serves)."""
    shutil.rmtree(index, ignore_errors=True)
    shutil.copytree(built, index)
    return index


def demo_index(args: argparse.Namespace, encoder: BiEncoder) -> Path:
    """The demo corpus's index with BM25 and int8, built once into --work."""
    built = args.work / "demo-index"
    if not built.exists():
        build_index(BuildOptions(ROOT / "data" / "demo" / "corpus.tsv", built, bm25=True,
                                 ann=[AnnOptions("int8")]), encoder)
    return built


def synthetic_index(args: argparse.Namespace, encoder: BiEncoder) -> Path:
    """A synthetic --size index (bench/scale.py's clustered vectors and short texts) with BM25 and the --structure
    kinds, built once into --work; each structure's card keeps the seconds its build took."""
    out = args.work / f"synthetic-{args.size}-{'-'.join(args.structure) or 'flat'}"
    if not out.exists():
        record = encoder_record(encoder)
        seconds = build_synthetic(out, args.size, record.dimension, record, demo_centres(encoder, record.dimension),
                                  0.35, bm25=True)
        print(f"built {args.size:,} passages with BM25: {seconds}")
        for kind in args.structure:
            index_writer.write_candidates(out, kind)
    return out


def generation(client: httpx.Client) -> str:
    return client.get("/ready").json()["index"]["generation"]


def compaction(args: argparse.Namespace, encoder: BiEncoder) -> None:
    out = synthetic_index(args, encoder)
    index = fresh_copy(out, args.work / "compacted")
    writes = Writes.open(Searcher(index, encoder, LoadOptions(device="cpu")))
    texts = Texts(2)
    passages = texts.passages(1000)
    started = time.perf_counter()
    vectors = encoder.encode_passages([passage["text"] for passage in passages])
    rate = len(passages) / (time.perf_counter() - started)
    for first in range(0, len(passages), 100):
        writes.upsert(passages[first:first + 100], vectors[first:first + 100])
    writes.delete(ids=[f"p{i}" for i in range(0, args.size, args.size // 1000)][:1000])
    # A replica following the folder, as `python -m service` with SEARCH_WATCH_INDEX serves it.
    replica_server = Server(index, "cpu", watch_index="true", watch_interval_s="0.5")
    replica_server.startup_s = 900  # a million passages load in minutes on this CPU
    with replica_server, httpx.Client(base_url=replica_server.base, timeout=120, trust_env=False) as replica:
        # First as the service compacts them (sealed, below SEARCH_MERGE_SHARE), then merged into the rows.
        sealing, seal_lag, seal_rss = followed(replica, lambda: compact(writes, merge_share=MERGE_SHARE))
        report, lag, rss = followed(replica, lambda: compact(writes, progress=True))
    writes.close()
    print(f"\nsealed at {args.size:,} passages (1,000 upserted, 1,000 deleted; SEARCH_MERGE_SHARE {MERGE_SHARE}): "
          f"{sealing.seconds:.2f} s, peak RSS {seal_rss.peak_gib:.2f} GiB; a replica (SEARCH_WATCH_INDEX, interval "
          f"0.5 s) served the new generation {seal_lag:.1f} s after the compaction started")
    cards = {c.kind: (c.recall_at_10, c.seconds) for c in read_manifest(index).candidates}
    fresh = {c.kind: c.seconds for c in read_manifest(out).candidates}  # this machine's build of the index compacted
    started = time.perf_counter()
    build_bm25(Searcher(index, encoder, LoadOptions(device="cpu")).passages.texts(), report.count,
               args.work / "bm25-again")
    bm25_again = time.perf_counter() - started
    rebuild = report.count / rate + bm25_again + sum(fresh.values())
    print(f"\nmerged at {args.size:,} passages with BM25 and {', '.join(args.structure) or 'no structure'} "
          f"(1,000 upserted, 1,000 deleted): {report.seconds:.1f} s, peak RSS {rss.peak_gib:.2f} GiB; a replica "
          f"(SEARCH_WATCH_INDEX, interval 0.5 s) served the new generation {lag:.1f} s after the compaction started; "
          + "; ".join(f"{kind} extended or rebuilt in {cards[kind][1]:.1f} s (recall@10 {cards[kind][0]}), its "
                      f"build {fresh[kind]:.1f} s" for kind in args.structure)
          + f"; BM25 built again from the texts {bm25_again:.1f} s: the compaction is "
          f"{100 * report.seconds / (bm25_again + sum(fresh.values())):.1f}% of BM25 and the structures built; "
          f"a full rebuild {rebuild:,.0f} s (encoding at {rate:.0f} passages/s, computed, plus those builds): "
          f"{rebuild / report.seconds:.0f}x the compaction")


def followed(replica: httpx.Client, compaction) -> tuple:
    """`compaction()`'s report, the seconds from its start to `replica`'s /ready naming a new generation, and the
    process's peak RSS while it ran."""
    before, rss = generation(replica), Rss()
    started = time.perf_counter()
    with rss:
        report = compaction()
    while generation(replica) == before:
        time.sleep(0.05)
    return report, time.perf_counter() - started, rss


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
    writes = Writes.open(Searcher(fresh_copy(synthetic_index(args, encoder), args.work / "first-search"), encoder,
                                  LoadOptions(device="cpu")))
    texts, rounds = Texts(3), 30
    queries = [" ".join(p["text"].split()[:6]) for p in texts.passages(rounds)]
    served = f"through {', '.join(args.structure)}" if args.structure else "exact"
    print(f"\nFirst search after a one-passage write, {args.size:,} passages ({rounds} writes; dense {served}; "
          "read-after-write: the upsert, its passage encoded, then that first search):\n")
    print("| mode | at rest p50 ms | p99 ms | first after a write p50 ms | p99 ms | p50 ratio "
          "| read-after-write p50 / p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for name, options in MODES.items():
        rest = []
        for query in queries:
            started = time.perf_counter()
            writes.searcher.search(query, 10, **options)
            rest.append(time.perf_counter() - started)
        after, read = [], []
        for passage in texts.passages(rounds):
            written = time.perf_counter()
            writes.upsert([passage])
            started = time.perf_counter()
            writes.searcher.search(" ".join(passage["text"].split()[:6]), 10, **options)
            after.append(time.perf_counter() - started)
            read.append(time.perf_counter() - written)
            found = writes.searcher.search(passage["text"], 1, exact=True, **options)  # seen at once
            assert found[0].id == passage["id"], (name, passage["id"], found)
        print(f"| {name} | {1000 * percentile(rest, 50):.1f} | {1000 * percentile(rest, 99):.1f} | "
              f"{1000 * percentile(after, 50):.1f} | {1000 * percentile(after, 99):.1f} | "
              f"{percentile(after, 50) / percentile(rest, 50):.2f} | "
              f"{1000 * percentile(read, 50):.0f} / {1000 * percentile(read, 99):.0f} |")
    report = compact(writes)
    print(f"\n{report.summary()}")
    writes.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--work", type=Path, default=None, help="where the indexes are kept (default: a temporary folder)")
    parser.add_argument("--structure", nargs="*", default=["int8"],
                        help="candidate structures on the compaction part's index (default: int8)")
    parser.add_argument("--only", choices=["served", "stream", "compaction", "first-search"],
                        help="run one of the parts")
    parser.add_argument("--write-shares", nargs="+", default=["1", "0.5", "0.25", "0.1"],
                        help="the stream part's SEARCH_WRITE_SHARE values, each on a fresh writer")
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
        if args.only == "stream":
            stream(args, encoder)
        if args.only in (None, "compaction"):
            compaction(args, encoder)
        if args.only in (None, "first-search"):
            first_search(args, encoder)
    finally:
        if temporary is not None:
            temporary.cleanup()


if __name__ == "__main__":
    main()
