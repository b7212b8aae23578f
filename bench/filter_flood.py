"""A flood of costly filters against plain searches and /health, on `python -m service` (issue 54, finding 5):

    python bench/filter_flood.py [--size 100000] [--clauses 20000 1023] [--flooders 15] [--seconds 20]
                                 [--checkout DIR] [--nice-clients N]

An index of --size passages with fields (bench/filters.py's synthetic one: clustered vectors, a `bucket` number
on each passage) is served by `python -m service` from this checkout, or from --checkout DIR (another checkout's
code over the same index: main before a change, say). For each --clauses N: first --seconds of one plain client
(`/search`, no filter, k=10, one request at a time) beside a /health prober (every 50 ms), then --seconds of the
same with --flooders clients each sending, one request at a time, a `/search` whose filter is an `$or` of N
`{"bucket": value}` clauses (each client cycling through 40 distinct ones, 2 past 5,000 clauses, made before the
phase; so filters are rarely served from the service's cache of 16). One line
per phase: the plain client's p50 and p99, /health's p50 and p99, and the flood's answers by status with their
median time, and the cores the server used (its CPU time over the phase's: the clients share the machine, and
what the server does not use they do). A last line: the plain p50 and /health p99 under the flood as ratios to
the quiet phase.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.filters import build  # noqa: E402
from bench.load import QUERIES, Process  # noqa: E402
from bench.ports import unclaimed_ports  # noqa: E402
from index_builder.build import encoder_record  # noqa: E402
from models.encoder import BiEncoder  # noqa: E402

HEALTH_EVERY_S = 0.05
VARIANTS = 40  # distinct filters a flooder cycles through: more than the service caches (CACHED_FILTERS, 16)


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else float("nan")


async def plain_client(base: str, stop: asyncio.Event, times: list[float], statuses: collections.Counter) -> None:
    async with httpx.AsyncClient(base_url=base, trust_env=False, timeout=120) as http:
        position = 0
        while not stop.is_set():
            started = time.perf_counter()
            answer = await http.post("/search", json={"query": QUERIES[position % len(QUERIES)], "k": 10})
            times.append(1000 * (time.perf_counter() - started))
            statuses[answer.status_code] += 1
            position += 1


async def health_prober(base: str, stop: asyncio.Event, times: list[float]) -> None:
    async with httpx.AsyncClient(base_url=base, trust_env=False, timeout=120) as http:
        while not stop.is_set():
            started = time.perf_counter()
            await http.get("/health")
            times.append(1000 * (time.perf_counter() - started))
            await asyncio.sleep(HEALTH_EVERY_S)


async def flooder(base: str, stop: asyncio.Event, clauses: int, seed: int, times: list[float],
                  statuses: collections.Counter) -> None:
    # Made before the phase, so the clients' own work (they share the machine) is small beside the server's.
    bodies = [json.dumps({"query": "flood", "k": 10, "filter": {"$or": [
        {"bucket": (seed * VARIANTS + variant) * clauses + n} for n in range(clauses)]}}).encode()
        for variant in range(VARIANTS if clauses <= 5000 else 2)]
    async with httpx.AsyncClient(base_url=base, trust_env=False, timeout=300) as http:
        sent = 0
        while not stop.is_set():
            started = time.perf_counter()
            answer = await http.post("/search", content=bodies[sent % len(bodies)],
                                     headers={"content-type": "application/json"})
            times.append(1000 * (time.perf_counter() - started))
            statuses[answer.status_code] += 1
            sent += 1


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process `pid` and its threads so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def phase(base: str, seconds: float, flooders: int, clauses: int, pid: int) -> dict:
    used = cpu_seconds(pid), time.perf_counter()
    stop = asyncio.Event()
    plain, health, flood = [], [], []
    plain_statuses, flood_statuses = collections.Counter(), collections.Counter()
    tasks = [asyncio.create_task(plain_client(base, stop, plain, plain_statuses)),
             asyncio.create_task(health_prober(base, stop, health))]
    tasks += [asyncio.create_task(flooder(base, stop, clauses, seed, flood, flood_statuses)) for seed in range(flooders)]
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*tasks)
    cores = (cpu_seconds(pid) - used[0]) / (time.perf_counter() - used[1])
    return {"plain": plain, "health": health, "flood": flood, "plain_statuses": plain_statuses,
            "flood_statuses": flood_statuses, "cores": cores}


def line(name: str, found: dict) -> str:
    flood = (f"; flood: {dict(found['flood_statuses'])} answers, median {statistics.median(found['flood']):.0f} ms"
             if found["flood"] else "")
    return (f"{name}: plain /search p50 {percentile(found['plain'], 0.5):.1f} ms, p99 "
            f"{percentile(found['plain'], 0.99):.1f} ms ({sum(found['plain_statuses'].values())} answers, "
            f"{dict(found['plain_statuses'])}); /health p50 {percentile(found['health'], 0.5):.1f} ms, p99 "
            f"{percentile(found['health'], 0.99):.1f} ms{flood}; the server used {found['cores']:.2f} of "
            f"{os.cpu_count()} cores")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=100_000, help="passages in the synthetic index")
    parser.add_argument("--clauses", type=int, nargs="+", default=[20_000, 1023], help="clauses of each flood filter")
    parser.add_argument("--flooders", type=int, default=15, help="clients sending costly filters")
    parser.add_argument("--seconds", type=float, default=20, help="length of each phase")
    parser.add_argument("--checkout", type=Path, default=ROOT, help="the checkout whose service is measured")
    parser.add_argument("--nice-clients", type=int, default=0, metavar="N",
                        help="raise the clients' nice value by N once the server has started (the server keeps its "
                        "own), so on a small machine they take only what the server leaves")
    args = parser.parse_args(argv)

    encoder = BiEncoder(device="cpu")
    record = encoder_record(encoder)
    root = Path(tempfile.mkdtemp(prefix="filter-flood-"))
    try:
        built = build(root / "index", args.size, encoder.spec.dimension, record, 0.05)
        print(f"{args.size:,} passages with fields built in {built:.1f} s; service from {args.checkout}", flush=True)
        [port] = unclaimed_ports(1)
        env = {**os.environ, "SEARCH_INDEX_DIR": str(root / "index"), "SEARCH_PORT": str(port),
               "SEARCH_DEVICE": "cpu", "PYTHONPATH": str(args.checkout)}
        with Process([sys.executable, "-m", "service"], env, port, cwd=args.checkout) as server:
            pid = server.process.pid
            os.nice(args.nice_clients)
            quiet = asyncio.run(phase(server.base, args.seconds, 0, 0, pid))
            print(line("quiet", quiet), flush=True)
            for clauses in args.clauses:
                flooded = asyncio.run(phase(server.base, args.seconds, args.flooders, clauses, pid))
                print(line(f"{args.flooders} clients flooding {clauses}-clause filters", flooded), flush=True)
                print(f"summary at {clauses} clauses: plain p50 x{percentile(flooded['plain'], 0.5) / percentile(quiet['plain'], 0.5):.2f}"
                      f", /health p99 x{percentile(flooded['health'], 0.99) / percentile(quiet['health'], 0.99):.2f}"
                      " against the quiet phase", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
