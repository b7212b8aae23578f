"""Fair admission: can one API key flooding the service keep another out of it? (issue 75, item 3)

    python bench/fair_admission.py [--index indexes/demo] [--cap N] [--a-clients N] [--seconds 20]
                                   [--batch 64] [--grace 60] [--device cpu] [--checkout PATH]

Starts `python -m service` with a keys file of two keys, A and B, and SEARCH_MAX_CONCURRENT_REQUESTS=--cap (unset:
the service's default). For `--seconds`, key A floods it: `--a-clients` clients (unset: the cap plus 8), each
posting a /search/batch of `--batch` queries again as soon as it is answered (told 429, after its Retry-After);
meanwhile key B sends single /search requests one at a time (told 429, it waits the Retry-After too). B's request
still in the service at the end is waited for up to `--grace` seconds. Prints, per key: requests, the share
answered 429, and the p50/p99 of its answered (200) and of all its requests. `--checkout`: whose code serves
(another checkout, with this one's virtual environment), to measure the code before a change against it.
The clients run in this process, on the server's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.load import QUERIES, Connection, Server  # noqa: E402
from index_builder.build import BuildOptions, build_index  # noqa: E402
from models.encoder import BiEncoder  # noqa: E402
from service.settings import ServiceSettings  # noqa: E402

KEYS = {"A": "bench-key-a", "B": "bench-key-b"}


def keyed_connection(host: str, port: int, key: str, timeout_s: float | None = None) -> Connection:
    """bench.load's light keep-alive connection, sending `key` as the bearer of every request."""
    return Connection(host, port, timeout_s, key=key)


@dataclass
class Answers:
    """One key's requests: (status, ms) of each answered, and how many got no answer."""

    answers: list[tuple[int, float]] = field(default_factory=list)
    unanswered: int = 0

    def ms(self, q: float, status: int | None = None) -> float:
        values = [ms for code, ms in self.answers if status is None or code == status]
        return float(np.percentile(values, q)) if values else float("nan")

    def share(self, status: int) -> float:
        return sum(code == status for code, _ in self.answers) / max(len(self.answers), 1)

    def row(self, key: str) -> str:
        return (f"| {key} | {len(self.answers) + self.unanswered} | {self.share(429):.0%} | "
                f"{sum(code == 200 for code, _ in self.answers)} | {self.ms(50, 200):.0f} | {self.ms(99, 200):.0f} | "
                f"{self.ms(50):.0f} | {self.ms(99):.0f} | {self.unanswered} |")


async def flood(base: str, a_clients: int, batch: int, seconds: float, grace_s: float) -> tuple[Answers, Answers]:
    host, port = base.removeprefix("http://").split(":")
    a_bodies = [json.dumps({"queries": [QUERIES[(start + n) % len(QUERIES)] for n in range(batch)], "k": 10}).encode()
                for start in range(0, len(QUERIES), batch)]
    b_bodies = [json.dumps({"query": query, "k": 10}).encode() for query in QUERIES]
    a_connections = [keyed_connection(host, int(port), KEYS["A"]) for _ in range(a_clients)]
    b_connection = keyed_connection(host, int(port), KEYS["B"])
    await asyncio.gather(*(c.request("GET", "/health") for c in [*a_connections, b_connection]))
    a, b = Answers(), Answers()
    deadline = time.perf_counter() + seconds

    async def client(connection: Connection, answers: Answers, path: str, bodies: list[bytes], n: int) -> None:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            status, retry_after = await connection.request("POST", path, bodies[n % len(bodies)])
            answers.answers.append((status, 1000 * (time.perf_counter() - started)))
            n += 1
            if status == 429:
                await asyncio.sleep(min(retry_after, max(0.0, deadline - time.perf_counter())))

    a_tasks = [asyncio.create_task(client(c, a, "/search/batch", a_bodies, n)) for n, c in enumerate(a_connections)]
    b_task = asyncio.create_task(client(b_connection, b, "/search", b_bodies, 0))
    await asyncio.sleep(seconds)
    try:  # B's last request: answered within the grace, or counted unanswered
        await asyncio.wait_for(b_task, grace_s)
    except TimeoutError:
        b.unanswered += 1
    a.unanswered = sum(not task.done() for task in a_tasks)
    for task in a_tasks:
        task.cancel()
    for connection in [*a_connections, b_connection]:
        connection.close()
    return a, b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", type=Path, default=ROOT / "indexes/demo")
    parser.add_argument("--cap", type=int, default=None, help="SEARCH_MAX_CONCURRENT_REQUESTS; unset: its default")
    parser.add_argument("--a-clients", type=int, default=None, help="key A's clients; unset: the cap plus 8")
    parser.add_argument("--batch", type=int, default=64, help="queries in each of A's /search/batch requests")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--grace", type=float, default=60.0, help="how long B's last request is waited for")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--checkout", type=Path, default=ROOT, help="whose code serves")
    args = parser.parse_args(argv)
    cap = args.cap or ServiceSettings.model_fields["max_concurrent_requests"].default
    a_clients = args.a_clients or cap + 8
    if not (args.index / "manifest.json").exists():
        build_index(BuildOptions(corpus=ROOT / "data/demo/corpus.tsv", out=args.index, bm25=True),
                    BiEncoder(device=args.device))
    keys = Path(tempfile.mkdtemp()) / "keys.json"
    keys.write_text(json.dumps([{"name": name, "key_sha256": hashlib.sha256(key.encode()).hexdigest(),
                                 "routes": ["search"]} for name, key in KEYS.items()]))
    env = {"api_keys_file": str(keys), **({"max_concurrent_requests": str(args.cap)} if args.cap else {})}
    with Server(args.index, args.device, checkout=args.checkout, **env) as server:
        asyncio.run(flood(server.base, 2, args.batch, 2.0, args.grace))  # warm-up
        a, b = asyncio.run(flood(server.base, a_clients, args.batch, args.seconds, args.grace))
    print(f"cap {cap}, key A: {a_clients} clients of /search/batch x {args.batch} queries; key B: one /search at a "
          f"time; {args.seconds:g} s; code: {args.checkout}")
    print("| key | requests | 429 | answered 200 | 200 p50 ms | 200 p99 ms | all p50 ms | all p99 ms | unanswered |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(a.row("A"))
    print(b.row("B"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
