"""Overload and soak: does the service refuse what it cannot take, quickly, and stay healthy?

    python bench/overload.py [--index indexes/demo] [--cap 64] [--clients 1000] [--seconds 20]
                             [--soak-clients 64] [--soak-seconds 120] [--device cpu] [--no-backoff | --jitter]
                             [--repeat 1] [--heap-stats]

Starts `python -m service` with SEARCH_MAX_CONCURRENT_REQUESTS=--cap, then:
1. at the cap: `--cap` clients for `--seconds`, the service's own p99 when full;
2. overload: `--clients` clients for `--seconds` (each posts /search again as soon as it is answered,
   or, told 429, after its Retry-After; `--no-backoff`: at once; `--jitter`: after Retry-After times a
   random factor in [1, 2), as client libraries with jittered backoff wait, so the clients told 429
   together do not all come back in the same instant), with one more client polling /health every 50 ms: the share answered 429 and their
   p50/p99, the accepted requests' p99 against the p99 at the cap, /health's p99, answers other than
   200 and 429, and the server's RSS before and after;
   `--repeat N`: the overload N times on the same server, each run's p99s printed with their median;
3. soak: `--soak-clients` clients for `--soak-seconds`, RSS sampled every 10 s; with `--heap-stats`
   (glibc), also the heap's memory in use and free memory it keeps, read inside the server
   (bench/heap_stats/sitecustomize.py): a leak grows the first, fragmentation the second.
Goals (issue 14): 429 p99 < 50 ms, accepted p99 < 3x the p99 at the cap, /health p99 < 100 ms,
0 errors other than 429; soak: 0 errors, RSS flat. The clients run in this process on the same
machine as the server, so on a small host they take a share of its CPU (printed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.load import QUERIES, Connection, Server, name_value, own_cpu_seconds, rss_mib  # noqa: E402
from index_builder.build import BuildOptions, build_index  # noqa: E402
from models.encoder import BiEncoder  # noqa: E402


@dataclass
class Answers:
    """Every answer of one phase: latencies by status, and failures without a status."""

    by_status: dict[int, list[float]] = field(default_factory=dict)
    failures: Counter = field(default_factory=Counter)  # exception name -> count
    seconds: float = 0.0
    later: dict[int, list[float]] = field(default_factory=dict)  # by status, those sent after `settled`
    settled: float = float("inf")  # perf_counter time from which answers also count in `later`

    def add(self, status: int, ms: float, sent: float = 0.0) -> None:
        self.by_status.setdefault(status, []).append(ms)
        if sent >= self.settled:
            self.later.setdefault(status, []).append(ms)

    def count(self, *statuses: int) -> int:
        return sum(len(self.by_status.get(status, [])) for status in statuses)

    def total(self) -> int:
        return sum(len(values) for values in self.by_status.values()) + sum(self.failures.values())

    def errors(self) -> int:
        """Answers other than 200 and 429, and requests that got no answer."""
        return self.total() - self.count(200, 429)

    def p(self, status: int, q: float, later: bool = False) -> float:
        """The q-th percentile ms of the answers with `status` (`later`: of those sent after `settled`)."""
        values = (self.later if later else self.by_status).get(status)
        return float(np.percentile(values, q)) if values else float("nan")


async def drive(base: str, clients: int, seconds: float, k: int = 10, health: Answers | None = None,
                backoff: bool = True, jitter: bool = False) -> Answers:
    """`clients` concurrent /search loops for `seconds`, each on its own keep-alive connection (opened
    before the clock starts); a client told 429 waits its Retry-After (unless not `backoff`; with
    `jitter`, times a random factor in [1, 2)); with `health`, a /health poll every 50 ms alongside."""
    answers = Answers()
    host, port = base.removeprefix("http://").split(":")
    bodies = [json.dumps({"query": query, "k": k}).encode() for query in QUERIES]
    connections = [Connection(host, int(port)) for _ in range(clients + 1)]
    await asyncio.gather(*(connection.request("GET", "/health") for connection in connections))
    deadline = time.perf_counter() + seconds
    answers.settled = deadline - seconds + 2.0  # past the first wave (all clients at once) and its retries

    async def searcher(number: int) -> None:
        i, connection = number, connections[number]
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            try:
                status, retry_after = await connection.request("POST", "/search", bodies[i % len(bodies)])
                answers.add(status, 1000 * (time.perf_counter() - started), started)
                if status == 429 and backoff:
                    wait = retry_after * (1 + random.random()) if jitter else retry_after
                    await asyncio.sleep(min(wait, max(0.0, deadline - time.perf_counter())))
            except OSError as error:
                answers.failures[type(error).__name__] += 1
            i += clients

    async def prober() -> None:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            try:
                status, _ = await connections[-1].request("GET", "/health")
                health.add(status, 1000 * (time.perf_counter() - started))
            except OSError as error:
                health.failures[type(error).__name__] += 1
            await asyncio.sleep(0.05)

    started = time.perf_counter()
    await asyncio.gather(*(searcher(n) for n in range(clients)), *([prober()] if health is not None else []))
    answers.seconds = time.perf_counter() - started
    for connection in connections:
        connection.close()
    return answers


async def soak(base: str, pid: int, clients: int, seconds: float) -> tuple[Answers, list[float]]:
    """`clients` loops for `seconds` in 10 s slices, the server's RSS after each."""
    total, rss = Answers(), [rss_mib(pid)]
    remaining = seconds
    while remaining > 0:
        part = await drive(base, clients, min(10.0, remaining))
        for status, values in part.by_status.items():
            total.by_status.setdefault(status, []).extend(values)
        total.failures.update(part.failures)
        total.seconds += part.seconds
        rss.append(rss_mib(pid))
        remaining -= 10.0
    return total, rss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", type=Path, default=ROOT / "indexes/demo")
    parser.add_argument("--cap", type=int, default=64)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--soak-clients", type=int, default=64)
    parser.add_argument("--soak-seconds", type=float, default=120.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the overload phase this many times on the same server (each with its first wave) "
                             "and print every run's p99s: on a shared host one run's p99 is noisy")
    parser.add_argument("--server-env", action="append", default=[], type=name_value, metavar="NAME=VALUE",
                        help="a variable for the server's environment only (e.g. LD_PRELOAD=... to try another "
                             "allocator, MALLOC_CONF=...); repeatable")
    parser.add_argument("--heap-stats", action="store_true",
                        help="during the soak, also print the server's heap in use and free (glibc's mallinfo2; the "
                             "server then runs on glibc's malloc: SEARCH_ALLOCATOR=system)")
    backoff = parser.add_mutually_exclusive_group()
    backoff.add_argument("--no-backoff", action="store_true",
                         help="overload clients retry at once after a 429 instead of waiting its Retry-After")
    backoff.add_argument("--jitter", action="store_true",
                         help="overload clients wait Retry-After times a random factor in [1, 2) after a 429")
    args = parser.parse_args(argv)
    for name in ("cap", "clients", "soak_clients", "seconds", "soak_seconds", "repeat"):
        if getattr(args, name) < (0 if name == "soak_seconds" else 1):
            parser.exit(2, f"error: --{name.replace('_', '-')} must be positive, got {getattr(args, name)}\n")
    if not (args.index / "manifest.json").exists():
        build_index(BuildOptions(corpus=ROOT / "data/demo/corpus.tsv", out=args.index, bm25=True),
                    BiEncoder(device=args.device))

    server_env = dict(args.server_env)
    heap_log = None
    if args.heap_stats:  # the server imports the hook at start-up from its PYTHONPATH
        server_env.setdefault("SEARCH_ALLOCATOR", "system")  # mallinfo2 reads glibc's heap: jemalloc's is not in it
        heap_log = Path(tempfile.mkdtemp()) / "heap.log"
        os.environ["HEAP_STATS_LOG"] = str(heap_log)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "bench/heap_stats"),
                                                                 os.environ.get("PYTHONPATH")]))
    with Server(args.index, args.device, server_env, max_concurrent_requests=str(args.cap)) as server:
        pid = server.process.pid
        asyncio.run(drive(server.base, args.cap, 2))  # warm-up
        rss_before = rss_mib(pid)
        at_cap = asyncio.run(drive(server.base, args.cap, args.seconds))
        repeats = []  # (429 p99, the same sent after the first 2 s, /health p99) of every run; the last printed whole
        for _ in range(args.repeat):
            health = Answers()
            cpu = own_cpu_seconds()
            over = asyncio.run(drive(server.base, args.clients, args.seconds, health=health,
                                     backoff=not args.no_backoff, jitter=args.jitter))
            client_cpu = own_cpu_seconds() - cpu
            repeats.append((over.p(429, 99), over.p(429, 99, later=True), health.p(200, 99)))
        rss_after = rss_mib(pid)
        soak_started = time.time()
        soaked, rss = asyncio.run(soak(server.base, pid, args.soak_clients, args.soak_seconds)) \
            if args.soak_seconds > 0 else (Answers(), [])

    accepted_p99, cap_p99 = over.p(200, 99), at_cap.p(200, 99)
    print(f"at the cap ({args.cap} clients, {args.seconds:g} s): {at_cap.count(200)} answered, "
          f"{at_cap.count(200) / at_cap.seconds:.1f}/s, p50 {at_cap.p(200, 50):.1f} ms, p99 {cap_p99:.1f} ms, "
          f"{at_cap.count(429)} x 429, {at_cap.errors()} errors")
    behaviour = ("retrying at once" if args.no_backoff else
                 "waiting Retry-After x [1, 2) after a 429" if args.jitter else "waiting Retry-After after a 429")
    print(f"overload ({args.clients} clients {behaviour}, {args.seconds:g} s): {over.total()} requests, "
          f"{over.count(429) / max(over.total(), 1):.1%} answered 429 (p50 {over.p(429, 50):.1f} ms, "
          f"p99 {over.p(429, 99):.1f} ms; sent after the first 2 s: p99 {over.p(429, 99, later=True):.1f} ms), "
          f"{over.count(200)} accepted ({over.count(200) / over.seconds:.1f}/s, "
          f"p50 {over.p(200, 50):.1f} ms, p99 {accepted_p99:.1f} ms = {accepted_p99 / cap_p99:.2f}x the cap's), "
          f"/health p99 {health.p(200, 99):.1f} ms over {health.count(200)} polls, "
          f"{over.errors() + health.errors()} errors {dict(over.failures + health.failures) or ''}".rstrip())
    if len(repeats) > 1:
        print(f"overload x {len(repeats)}, the last above: 429 p99 " + " ".join(f"{r[0]:.1f}" for r in repeats)
              + f" ms (median {np.median([r[0] for r in repeats]):.1f}); sent after the first 2 s: "
              + " ".join(f"{r[1]:.1f}" for r in repeats) + " ms; /health p99 " + " ".join(f"{r[2]:.1f}" for r in repeats)
              + " ms")
    print(f"server RSS {rss_before:.0f} MiB before overload, {rss_after:.0f} MiB after; "
          f"the clients used {client_cpu:.1f} CPU s in {over.seconds:.1f} s")
    if rss:
        print(f"soak ({args.soak_clients} clients, {soaked.seconds:.0f} s): {soaked.count(200)} answered, "
              f"p99 {soaked.p(200, 99):.1f} ms, {soaked.errors() + soaked.count(429)} errors; RSS MiB every 10 s: "
              + " ".join(f"{value:.0f}" for value in rss))
    if heap_log is not None:
        samples = [line.split() for line in heap_log.read_text().splitlines()] if heap_log.exists() else []
        samples = [(int(used) / 2**20, int(free) / 2**20) for at, used, free in samples if float(at) >= soak_started]
        print("soak heap (glibc), MiB every 10 s: in use " + " ".join(f"{used:.0f}" for used, _ in samples)
              + "; free but kept " + " ".join(f"{free:.0f}" for _, free in samples) if samples
              else "soak heap: no samples (the server's C library has no mallinfo2, or no soak)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
