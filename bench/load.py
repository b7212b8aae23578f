"""HTTP load on 127.0.0.1: micro-batching on against off, and HTTP against in-process latency.

    python bench/load.py [--index indexes/demo] [--clients 32] [--seconds 30] [--device cpu]

Starts `python -m service` twice on a free loopback port (SEARCH_MICROBATCH=true, then false),
drives each with `--clients` concurrent httpx clients for `--seconds` (bounded: every client
stops at the deadline), and prints throughput, p50/p99 and errors with the on/off ratio.
Then, one request at a time, compares the HTTP round trip (micro-batching on and off; httpx,
and the standard library's client to show the client's own share) with `SearchEngine.search`
in this process for the same queries. Builds the demo index first if `--index` does not exist.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from http.client import HTTPConnection
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from index_builder.build import BuildOptions, build_index  # noqa: E402
from models.encoder import BiEncoder  # noqa: E402
from service.engine import SearchEngine  # noqa: E402

QUERIES = [line.split("\t", 1)[1].strip() for line in (ROOT / "data/demo/queries.tsv").read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`python -m service` on a loopback port, stopped on exit."""

    def __init__(self, index: Path, device: str, **env: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        variables = {**os.environ, "SEARCH_INDEX_DIR": str(index), "SEARCH_PORT": str(self.port), "SEARCH_DEVICE": device}
        variables.update({f"SEARCH_{k.upper()}": v for k, v in env.items()})
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen([sys.executable, "-m", "service"], cwd=ROOT, env=variables,
                                        stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self) -> "Server":
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base}/ready", timeout=2, trust_env=False).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        self.log.seek(0)
        tail = self.log.read().decode(errors="replace")[-3000:]
        self.__exit__()
        raise RuntimeError(f"service did not become ready in 120 s; its output ended:\n{tail}")

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self.log.close()


async def load(base: str, clients: int, seconds: float, k: int) -> dict:
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds

    async def client(number: int) -> None:
        nonlocal errors
        async with httpx.AsyncClient(base_url=base, timeout=30, trust_env=False) as http:
            i = number
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                try:
                    response = await http.post("/search", json={"query": QUERIES[i % len(QUERIES)], "k": k})
                    ok = response.status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    latencies.append(1000 * (time.perf_counter() - started))
                else:
                    errors += 1
                i += clients

    started = time.perf_counter()
    await asyncio.gather(*(client(n) for n in range(clients)))
    elapsed = time.perf_counter() - started
    p50, p99 = np.percentile(latencies, [50, 99]) if latencies else (float("nan"), float("nan"))
    return {"requests": len(latencies), "rps": len(latencies) / elapsed, "p50": p50, "p99": p99, "errors": errors}


def timed(call, items) -> list[float]:
    """Milliseconds of `call(item)` for each item."""
    times = []
    for item in items:
        started = time.perf_counter()
        call(item)
        times.append(1000 * (time.perf_counter() - started))
    return times


def timed_ms(call, items) -> float:
    """p50 milliseconds of `call(item)` over the items, after a warm-up on the first five."""
    for item in items[:5]:
        call(item)
    return statistics.median(timed(call, items))


def http_vs_engine(index: Path, device: str, rounds: int, k: int, blocks: int = 10) -> dict[str, float]:
    """p50 ms of one request at a time: the HTTP round trip with micro-batching on (the default)
    and off, the server's own engine time for those requests, the same request through the
    standard library's http.client (what the httpx client itself costs), HTTP round trips that
    do no work (/health), and the engine in this process. All are timed in alternating blocks of
    the same queries, so a machine whose speed drifts (a shared host) weighs on them alike."""
    queries = QUERIES[:rounds]
    server_ms: list[float] = []  # the batching-off server's own engine time (on, it would include queueing)

    def post(http, query, server_times=None):
        response = http.post("/search", json={"query": query, "k": k})
        response.raise_for_status()
        total = response.json()["latency_ms"]["total"]
        if server_times is not None:
            server_times.append(total)

    def post_stdlib(connection, query):
        body = json.dumps({"query": query, "k": k})
        connection.request("POST", "/search", body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        payload = response.read()
        if response.status != 200:
            raise RuntimeError(f"/search answered {response.status}: {payload[:200]!r}")
        json.loads(payload)

    def get_stdlib(connection, path):
        connection.request("GET", path)
        connection.getresponse().read()

    engine = SearchEngine.open(index, device=device)
    with (Server(index, device, microbatch="true") as batched, Server(index, device, microbatch="false") as server,
          httpx.Client(base_url=batched.base, timeout=30, trust_env=False) as http_batched,
          httpx.Client(base_url=server.base, timeout=30, trust_env=False) as http,
          closing(HTTPConnection("127.0.0.1", server.port, timeout=30)) as stdlib):
        calls = {
            "HTTP, batching on": lambda q: post(http_batched, q),
            "HTTP, batching off": lambda q: post(http, q, server_ms),
            "HTTP, stdlib client": lambda q: post_stdlib(stdlib, q),
            "/health": lambda _: http.get("/health"),
            "/health, stdlib": lambda _: get_stdlib(stdlib, "/health"),
            "in-process engine": lambda q: engine.search(q, k),
        }
        times: dict[str, list[float]] = {label: [] for label in calls}
        for call in calls.values():
            for query in queries[:5]:  # warm-up
                call(query)
        server_ms.clear()
        size = max(1, len(queries) // blocks)
        for start in range(0, len(queries), size):
            for label, call in calls.items():
                times[label].extend(timed(call, queries[start : start + size]))
    p50 = {label: statistics.median(values) for label, values in times.items()}
    return {**p50, "server engine (off)": statistics.median(server_ms)}


def batching_ceiling(index: Path, device: str, k: int) -> tuple[float, float]:
    """Queries/s of the engine in this process, one query per call and 32 per call: the most
    micro-batching can gain on this machine before any HTTP cost."""
    engine = SearchEngine.open(index, device=device)
    queries = QUERIES[:128]
    single = timed_ms(lambda q: engine.search(q, k), queries)
    batches = [queries[i : i + 32] for i in range(0, len(queries), 32)]
    batched = timed_ms(lambda b: engine.search_batch(b, k), batches + batches)
    return 1000 / single, 32 * 1000 / batched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", type=Path, default=ROOT / "indexes/demo")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=200, help="sequential queries for HTTP vs in-process")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="the service's and the engine's")
    args = parser.parse_args()
    if not (args.index / "manifest.json").is_file():
        encoder = BiEncoder(device=args.device)
        print(build_index(BuildOptions(ROOT / "data/demo/corpus.tsv", args.index), encoder).summary())

    rows = {}
    for label, microbatch in (("micro-batching on", "true"), ("micro-batching off", "false")):
        with Server(args.index, args.device, microbatch=microbatch) as server:
            asyncio.run(load(server.base, args.clients, 2, args.k))  # warm-up
            rows[label] = asyncio.run(load(server.base, args.clients, args.seconds, args.k))
    print(f"\n{args.clients} clients x {args.seconds:.0f} s, k={args.k}, index {args.index}, device {args.device}")
    print(f"{'':<20}{'requests':>10}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'errors':>8}")
    for label, r in rows.items():
        print(f"{label:<20}{r['requests']:>10}{r['rps']:>10.1f}{r['p50']:>10.1f}{r['p99']:>10.1f}{r['errors']:>8}")
    ratio = rows["micro-batching on"]["rps"] / rows["micro-batching off"]["rps"]
    print(f"throughput on / off = {ratio:.2f}x")

    single_qps, batched_qps = batching_ceiling(args.index, args.device, args.k)
    print(f"in-process ceiling: {single_qps:.0f} queries/s one at a time, {batched_qps:.0f} in batches of 32 "
          f"= {batched_qps / single_qps:.2f}x")

    p50 = http_vs_engine(args.index, args.device, args.rounds, args.k)
    print(f"\none request at a time, p50 ms of {args.rounds} queries:")
    for label, value in p50.items():
        print(f"  {label:<24}{value:>8.2f}")
    engine_ms = p50["in-process engine"]
    print("HTTP / in-process engine = " + ", ".join(
        f"{p50[label] / engine_ms:.2f}x {label.removeprefix('HTTP, ')}" for label in p50 if label.startswith("HTTP")))


if __name__ == "__main__":
    main()
