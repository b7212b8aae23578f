"""What the default retrieval costs: hybrid z-score (dense + BM25, each list's top 1000 fused) against dense alone,
served, at each size of a synthetic collection whose passages are generated text (so BM25 has real postings).

    python bench/hybrid.py [--sizes 10000 1000000 5000000] [--root DIR] [--queries 200] [--clients 32] [--seconds 20]

For each size, an index of clustered unit vectors around the packaged MiniLM's demo passages and texts of 8 to 16
words drawn from the demo corpus's vocabulary (bench/scale.py's generator), written through the index writer with
the packaged MiniLM's record, then:
- BM25's build, in a fresh process over the finished passage store: seconds and the peak RSS it adds, and its
  size on disk beside the vectors'; and its load in another fresh process: seconds and the RSS it adds;
- one `python -m service` over it (SEARCH_VERIFY_CHECKSUMS false): --queries demo queries sent one at a time,
  each as a dense request and as a request naming no mode (the default: hybrid z-score), alternating, their
  round-trip p50 and p99 and the answers' retrieve p50; then --clients clients for --seconds on each, in
  alternating slices: requests/s, p50 and p99. Each ratio is hybrid over dense in the same run.
--root keeps the indexes and reuses them in a later run. The last line sums up every size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.load import QUERIES, Server, alternate  # noqa: E402
from bench.scale import build_synthetic, demo_centres, process_memory, reusable  # noqa: E402
from index_builder.build import encoder_record  # noqa: E402
from models.encoder import BiEncoder  # noqa: E402
from retrieval import index_writer  # noqa: E402
from retrieval.bm25_index import BM25_DIR  # noqa: E402
from retrieval.index_format import INDEX_FILE  # noqa: E402

MIB = 2**20
# Run by a fresh interpreter (argv: ROOT, the index folder being written, its rows): BM25 built, one JSON line.
BUILD_BM25 = """
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from retrieval import index_writer
import bm25s, Stemmer  # imported before the baseline: the peak counts what the build holds, not the imports
before = int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) * 1024
started = time.perf_counter()
files = index_writer.write_bm25(Path(sys.argv[2]), int(sys.argv[3]))
print(json.dumps({"seconds": time.perf_counter() - started, "files": files,
                  "peak_rss_added": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before}))
"""
# Run by a fresh interpreter (argv: ROOT, the BM25 folder): its load's seconds and the RSS it adds, one JSON line.
LOAD_BM25 = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
def rss():
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) * 1024
from pathlib import Path
from retrieval.bm25_index import Bm25Index
before = rss()
started = time.perf_counter()
Bm25Index(Path(sys.argv[2]))
print(json.dumps({"seconds": time.perf_counter() - started, "rss_added": rss() - before}))
"""


def child(script: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", script, str(ROOT), *args], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def build_with_bm25(out: Path, size: int, record, centres: np.ndarray) -> dict:
    """bench/scale.py's synthetic index at `out`, with BM25 built in a fresh process (timed, its peak RSS)."""
    measured: dict = {}
    writer_bm25 = index_writer.write_bm25

    def bm25_in_a_child(work: Path, rows: int) -> list[str]:
        measured.update(child(BUILD_BM25, str(work), str(rows)))
        return measured["files"]

    index_writer.write_bm25 = bm25_in_a_child  # write_manifest builds BM25 through it
    try:
        build_synthetic(out, size, record.dimension, record, centres, 0.05, bm25=True)
    finally:
        index_writer.write_bm25 = writer_bm25
    return {"build_s": measured["seconds"], "build_peak_rss_added": measured["peak_rss_added"]}


def one_at_a_time(base: str, queries: list[str]) -> dict[str, dict]:
    """Each query as a dense request and as one naming no mode, alternating: round-trip and retrieve ms."""
    bodies = {"dense": {"mode": "dense"}, "default": {}}
    times = {label: {"round_trip": [], "retrieve": [], "mode": set()} for label in bodies}
    with httpx.Client(base_url=base, timeout=600, trust_env=False) as client:
        for number, query in enumerate(queries[:5] + queries):
            for label, body in bodies.items():
                started = time.perf_counter()
                response = client.post("/search", json={"query": query, "k": 10, **body})
                elapsed = 1000 * (time.perf_counter() - started)
                response.raise_for_status()
                if number >= 5:  # the first five warm up
                    answer = response.json()
                    times[label]["round_trip"].append(elapsed)
                    times[label]["retrieve"].append(answer["latency_ms"]["retrieve"])
                    times[label]["mode"].add(f"{answer['mode']}/{answer['score_kind']}")
    return {label: {"p50": statistics.median(t["round_trip"]), "p99": float(np.percentile(t["round_trip"], 99)),
                    "retrieve_p50": statistics.median(t["retrieve"]), "mode": ", ".join(sorted(t["mode"]))}
            for label, t in times.items()}


def under_load(base: str, clients: int, seconds: float) -> dict[str, dict]:
    def request(body: dict):
        return lambda i: ("/search", {"query": QUERIES[i % len(QUERIES)], "k": 10, **body})

    loads = asyncio.run(alternate({"dense": (base, request({"mode": "dense"})), "default": (base, request({}))},
                                  clients, seconds, 4, light=True, timeout_s=600))
    return {label: load.row() for label, load in loads.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 1_000_000, 5_000_000])
    parser.add_argument("--root", type=Path, help="keep the indexes here, and reuse those an earlier run left")
    parser.add_argument("--queries", type=int, default=200, help="sequential queries per retrieval")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients for the throughput figure")
    parser.add_argument("--seconds", type=float, default=20.0, help="of load per retrieval")
    args = parser.parse_args()
    encoder = BiEncoder(device="cpu")  # the packaged MiniLM: the record the service checks
    record = encoder_record(encoder)
    centres = demo_centres(encoder, record.dimension)
    del encoder
    queries = [QUERIES[i % len(QUERIES)] for i in range(args.queries)]
    root = args.root or Path(tempfile.mkdtemp(prefix="hybrid-"))
    root.mkdir(parents=True, exist_ok=True)
    summary = []
    for size in args.sizes:
        out = root / f"synthetic-bm25-{size}"
        built = None
        if not reusable(out):
            built = build_with_bm25(out, size, record, centres)
            print(f"{size:,} passages: BM25 built in {built['build_s']:.1f} s, its peak RSS over the building "
                  f"process's own {built['build_peak_rss_added'] / MIB:,.0f} MiB")
        else:
            print(f"{size:,} passages: {out} reused (BM25 build not timed)")
        disk_bm25, disk_vectors = folder_bytes(out / BM25_DIR), (out / INDEX_FILE).stat().st_size
        loaded = child(LOAD_BM25, str(out / BM25_DIR))
        print(f"  BM25 on disk {disk_bm25 / MIB:,.0f} MiB (vectors {disk_vectors / MIB:,.0f} MiB); loaded in "
              f"{loaded['seconds']:.2f} s, adding {loaded['rss_added'] / MIB:,.0f} MiB RSS")
        with Server(out, "cpu", verify_checksums="false") as server:
            rss = process_memory(server.process.pid)["VmRSS"]
            single = one_at_a_time(server.base, queries)
            load = under_load(server.base, args.clients, args.seconds)
        dense, default = single["dense"], single["default"]
        print(f"  service RSS {rss / MIB:,.0f} MiB; one at a time ({args.queries} queries, k=10):")
        for label, row in single.items():
            print(f"    {label:8} ({row['mode']}): p50 {row['p50']:.1f} ms, p99 {row['p99']:.1f} ms, "
                  f"retrieve p50 {row['retrieve_p50']:.1f} ms")
        print(f"  {args.clients} clients, {args.seconds:g} s each in alternating slices:")
        for label, row in load.items():
            print(f"    {label:8}: {row['rps']:.1f} requests/s, p50 {row['p50']:.1f} ms, p99 {row['p99']:.1f} ms, "
                  f"{row['errors']} errors")
        ratios = (default["p50"] / dense["p50"], load["dense"]["rps"] / load["default"]["rps"])
        print(f"  hybrid/dense: p50 {ratios[0]:.2f}x, requests/s {1 / ratios[1]:.2f}x of dense's")
        summary.append(f"{size:,}: p50 {ratios[0]:.2f}x, rps {1 / ratios[1]:.2f}x")
    print("hybrid z-score against dense, served: " + "; ".join(summary))


if __name__ == "__main__":
    main()
