"""The encoder backends on the CPU: torch against ONNX Runtime (fp32, and int8 weights).

    python bench/backends.py [--index indexes/demo] [--rounds 300] [--clients 32] [--seconds 30] [--slices 6]
                             [--light-clients]

1. Query encoding in this process, one query at a time (`--rounds` demo queries) and in batches of
   32, each backend in turn per block of queries (torch, onnx, onnx-int8, then reversed, ...), so a
   drift of the host's speed weighs on all alike: p50 ms and the ratio to torch.
2. /search under `--clients` concurrent clients: three `python -m service` processes on the same
   index (SEARCH_BACKEND=torch, onnx, onnx-int8), loaded in alternating slices (bench/load.py) by
   httpx clients (`--light-clients`: bench/load.py's `Connection`s, which leave the servers more of the
   host's CPU): requests/s, p50, p99, the ratio to torch and the clients' own CPU.
Goals (issue 17): encode p50 at least 2x torch's with a setting whose quality holds, /search
requests/s at least 1.5x. Quality: scripts/backends.sh (nDCG@10 on Cranfield and SciFact dev).
Builds the demo index first if `--index` does not exist.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.load import QUERIES, Server, alternate, search_request  # noqa: E402
from index_builder.build import BuildOptions, build_index  # noqa: E402
from models.backends import BACKENDS  # noqa: E402
from models.encoder import BiEncoder  # noqa: E402

BLOCK = 10  # queries per backend before the next one takes its turn


def encode_p50(encoders: dict[str, BiEncoder], queries: list[str], batch: int) -> dict[str, float]:
    """p50 ms of encoding `batch` queries at once, per backend, blocks alternating."""
    times: dict[str, list[float]] = {name: [] for name in encoders}
    groups = [queries[i:i + batch] for i in range(0, len(queries) - batch + 1, batch)]
    for name, encoder in encoders.items():  # warm-up
        for group in groups[:3]:
            encoder.encode_queries(group)
    for number, start in enumerate(range(0, len(groups), BLOCK)):
        order = list(encoders) if number % 2 == 0 else list(reversed(encoders))
        for name in order:
            for group in groups[start:start + BLOCK]:
                started = time.perf_counter()
                encoders[name].encode_queries(group)
                times[name].append(1000 * (time.perf_counter() - started))
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--index", type=Path, default=ROOT / "indexes/demo")
    parser.add_argument("--rounds", type=int, default=300, help="queries encoded one at a time, per backend")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=30.0, help="of load per backend, over all slices")
    parser.add_argument("--slices", type=int, default=6)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--light-clients", action="store_true",
                        help="load /search with bench/load.py's light HTTP connections instead of httpx clients, "
                             "which take less of the CPU the servers share with them")
    args = parser.parse_args(argv)
    for name in ("rounds", "clients", "seconds", "slices", "k"):
        if getattr(args, name) < 1:
            parser.exit(2, f"error: --{name} must be positive, got {getattr(args, name)}\n")
    if not (args.index / "manifest.json").exists():
        build_index(BuildOptions(corpus=ROOT / "data/demo/corpus.tsv", out=args.index, bm25=True),
                    BiEncoder(device="cpu"))

    queries = (QUERIES * (args.rounds // len(QUERIES) + 1))[:args.rounds]
    encoders = {backend: BiEncoder(device="cpu", backend=backend) for backend in BACKENDS}
    single = encode_p50(encoders, queries, 1)
    batched = encode_p50(encoders, (queries * 32)[:max(32 * 3 * BLOCK, 32)], 32)
    del encoders
    for backend in BACKENDS:
        print(f"encode {backend:9}: one query p50 {single[backend]:.2f} ms ({single['torch'] / single[backend]:.2f}x "
              f"torch), 32 queries p50 {batched[backend]:.1f} ms ({batched['torch'] / batched[backend]:.2f}x torch)")

    servers = {backend: Server(args.index, "cpu", backend=backend) for backend in BACKENDS}
    try:
        for server in servers.values():
            server.__enter__()
        targets = {backend: (server.base, search_request(args.k)) for backend, server in servers.items()}
        loads = asyncio.run(alternate(targets, args.clients, args.seconds, args.slices, timeout_s=30.0,
                                      light=args.light_clients))
    finally:
        for server in servers.values():
            if server.process.poll() is None:
                server.__exit__()
    rows = {backend: load.row() for backend, load in loads.items()}
    for backend, row in rows.items():
        print(f"/search {backend:9} ({args.clients} clients, {loads[backend].seconds:.0f} s): {row['rps']:.1f} req/s "
              f"({row['rps'] / rows['torch']['rps']:.2f}x torch), p50 {row['p50']:.1f} ms, p99 {row['p99']:.1f} ms, "
              f"{row['errors']} errors; the clients used {loads[backend].client_cpu / loads[backend].seconds:.0%} "
              f"of a core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
