"""The encode stage against the model's bound: where a single query's time goes between the bare forward
pass and the service's answer, torch against the default ONNX fp32 query backend, in one run.

    python bench/encode_stage.py [--size 10000] [--root runs/encode-stage] [--rounds 200] [--clients 32]
                                 [--seconds 30] [--slices 6] [--main DIR]

On a --size synthetic index with BM25 (bench/scale.py's clustered vectors and generated texts, the packaged
MiniLM's record; built once under --root, then reused):
1. The demo queries one at a time through four steps, in blocks whose order rotates, so a drift of the
   host's speed weighs on all alike: in this process, for torch and for ONNX fp32, the bare forward pass of
   the tokenized query (the model alone), the whole encode (tokenize + forward + pool) and a whole library
   search (`Searcher.search`, k=10, the default hybrid), each timed apart; and two `python -m service` over
   the index, today's torch (SEARCH_BACKEND=torch) and the default (the ONNX fp32 query backend,
   probe-checked at load), each sent the query: round-trip p50 and the answers' own `latency_ms` stages;
   with --main, a third service from that checkout, at its own defaults.
2. The services under --clients light clients in alternating slices (bench/load.py): requests/s, p50, p99.
Prints the goals' ratios (issue 59): the service's encode p50 over the bare ONNX encode's, /search p50
over the library's whole search, and requests/s of the default over torch's (and main's, with --main).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from http.client import HTTPConnection
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.load import QUERIES, Server, alternate, search_request  # noqa: E402
from bench.scale import build_synthetic, demo_centres, reusable  # noqa: E402
from index_builder.build import encoder_record  # noqa: E402
from models.checkpoint import padded_batch  # noqa: E402
from models.encoder import BiEncoder  # noqa: E402
from retrieval.index_format import read_manifest  # noqa: E402
from retrieval.load_options import LoadOptions  # noqa: E402
from retrieval.searcher import Searcher, encoder_for  # noqa: E402

BLOCK = 10  # queries per backend before the other takes its turn
SIGMA = 0.02


def index_at(root: Path, size: int) -> Path:
    out = root / f"synthetic-{size}-bm25"
    if not reusable(out):
        encoder = BiEncoder(device="cpu")
        build_synthetic(out, size, encoder.dimension, encoder_record(encoder), demo_centres(encoder, encoder.dimension),
                        SIGMA, bm25=True)
    return out


class InProcess:
    """One backend's library search in this process, each step timed apart: the bare forward pass of the
    tokenized query, the whole encode (tokenize + forward + pool) and a whole `Searcher.search`."""

    def __init__(self, index: Path, backend: str) -> None:
        self.searcher = Searcher(index, encoder_for(read_manifest(index), "cpu", backend=backend), LoadOptions(device="cpu"))
        self.times: dict[str, list[float]] = {"forward": [], "encode": [], "search": []}

    def __call__(self, query: str, kept: bool) -> None:
        encoder = self.searcher.encoder
        ids = encoder.tokenize(query).ids
        batch, mask = padded_batch([ids], encoder.tokenizer.pad_token_id or 0, encoder.device)
        segments = torch.full_like(batch, encoder.spec.query_segment_id)
        with torch.inference_mode():
            started = time.perf_counter()
            encoder._transformer(batch, mask, segments)
            forward = time.perf_counter() - started
        started = time.perf_counter()
        encoder.encode_queries([query])
        encode = time.perf_counter() - started
        started = time.perf_counter()
        self.searcher.search(query, 10)
        search = time.perf_counter() - started
        if kept:
            for name, seconds in (("forward", forward), ("encode", encode), ("search", search)):
                self.times[name].append(1000 * seconds)

    def p50(self) -> dict[str, float]:
        return {name: statistics.median(values) for name, values in self.times.items()}


class Served:
    """One service sent /search one request at a time, through the standard library's http.client (httpx costs
    the client about a millisecond a request more): the round trip, the answers' `latency_ms` stages, and the
    round trip of a /health that does no work."""

    def __init__(self, server: Server) -> None:
        self.connection = HTTPConnection("127.0.0.1", server.port, timeout=60)
        self.times: dict[str, list[float]] = {"round trip": [], "/health": []}

    def __call__(self, query: str, kept: bool) -> None:
        body = json.dumps({"query": query, "k": 10})
        started = time.perf_counter()
        self.connection.request("POST", "/search", body=body, headers={"Content-Type": "application/json"})
        response = self.connection.getresponse()
        payload = response.read()
        elapsed = 1000 * (time.perf_counter() - started)
        if response.status != 200:
            raise RuntimeError(f"/search answered {response.status}: {payload[:200]!r}")
        started = time.perf_counter()
        self.connection.request("GET", "/health")
        self.connection.getresponse().read()
        health = 1000 * (time.perf_counter() - started)
        if kept:
            self.times["round trip"].append(elapsed)
            self.times["/health"].append(health)
            for stage, ms in json.loads(payload)["latency_ms"].items():
                self.times.setdefault(stage, []).append(ms)

    def p50(self) -> dict[str, float]:
        return {name: statistics.median(values) for name, values in self.times.items()}


def interleaved(steps: dict, queries: list[str]) -> None:
    """Each query through every step, blocks of BLOCK queries, the order of the steps rotated by block."""
    names = list(steps)
    for query in queries[:5]:  # warm-up
        for step in steps.values():
            step(query, False)
    for number, start in enumerate(range(0, len(queries), BLOCK)):
        order = names[number % len(names):] + names[:number % len(names)]
        for name in order:
            for query in queries[start:start + BLOCK]:
                steps[name](query, True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=10_000)
    parser.add_argument("--root", type=Path, default=ROOT / "runs/encode-stage")
    parser.add_argument("--rounds", type=int, default=200, help="queries one at a time, per backend")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=30.0, help="of load per server, over all slices")
    parser.add_argument("--slices", type=int, default=6)
    parser.add_argument("--main", type=Path, help="a checkout of main (git worktree add DIR main) whose service, at "
                        "its defaults, is measured beside this one's")
    args = parser.parse_args(argv)
    for name in ("size", "rounds", "clients", "seconds", "slices"):
        if getattr(args, name) < 1:
            parser.exit(2, f"error: --{name} must be positive, got {getattr(args, name)}\n")
    started = time.perf_counter()
    index = index_at(args.root, args.size)
    queries = (QUERIES * (args.rounds // len(QUERIES) + 1))[:args.rounds]

    servers = {"torch": Server(index, "cpu", backend="torch", verify_checksums="false"),
               "default": Server(index, "cpu", verify_checksums="false")}
    if args.main is not None:
        servers = {"main": Server(index, "cpu", checkout=args.main.resolve(), verify_checksums="false"), **servers}
    try:
        for server in servers.values():
            server.__enter__()
        backends = {name: httpx.get(f"{server.base}/ready", trust_env=False).json()["index"]["backend"]
                    for name, server in servers.items()}
        bare = {backend: InProcess(index, backend) for backend in ("torch", "onnx")}
        served = {name: Served(server) for name, server in servers.items()}
        interleaved({**{f"in process {name}": step for name, step in bare.items()},
                     **{f"service {name}": step for name, step in served.items()}}, queries)
        loads = asyncio.run(alternate({name: (server.base, search_request(10)) for name, server in servers.items()},
                                      args.clients, args.seconds, args.slices, timeout_s=30.0, light=True))
    finally:
        for server in servers.values():
            if server.process.poll() is None:
                server.__exit__()
    for backend, step in bare.items():
        row = step.p50()
        print(f"in process, {backend:5}: forward p50 {row['forward']:.2f} ms, encode {row['encode']:.2f} ms, "
              f"Searcher.search {row['search']:.2f} ms")
    for name, step in served.items():
        row = step.p50()
        stages = ", ".join(f"{stage} {ms:.2f}" for stage, ms in row.items() if stage not in ("round trip", "/health"))
        print(f"service {name:7} (backend {backends[name]}): /search p50 {row['round trip']:.2f} ms (/health "
              f"{row['/health']:.2f} ms); stages p50: {stages}")
    rows = {name: load.row() for name, load in loads.items()}
    for name, row in rows.items():
        print(f"service {name:7}, {args.clients} light clients: {row['rps']:.1f} req/s, p50 {row['p50']:.1f} ms, "
              f"p99 {row['p99']:.1f} ms, {row['errors']} errors")
    onnx, default = bare["onnx"].p50(), served["default"].p50()
    print(f"goals: service encode p50 / bare ONNX encode p50 = {default['encode'] / onnx['encode']:.2f} (<= 1.2), "
          f"and over the bare forward {default['encode'] / onnx['forward']:.2f}; "
          f"/search p50 / Searcher.search p50 = {default['round trip'] / onnx['search']:.2f} (<= 1.3); "
          + ", ".join(f"requests/s default / {name} = {rows['default']['rps'] / rows[name]['rps']:.2f}"
                      for name in rows if name != "default") + " (>= 1.5 over main)")
    print(f"bench/encode_stage.py: {args.size:,} passages, {len(queries)} queries a backend, "
          f"{time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
