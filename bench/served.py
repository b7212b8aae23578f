"""One served pipeline's round trip on the user's own queries: starts `python -m service` over an index with the
SEARCH_* settings given, sends each query as one /search request (one at a time, after a few to warm up) and
prints the round trip's p50 and p95 and the answers' own stage p50s.

    python bench/served.py --index DIR --queries FILE [--set NAME=VALUE ...] [--body JSON]

`--queries`: TSV qid<TAB>query or BEIR JSONL (as `index_builder eval` reads them). `--set`: a service setting
by its variable (SEARCH_RERANKERS='["runs/scifact/models/monobert/checkpoint-0000300"]'); `--body`: what each
request adds to the query (default {"k": 10}), e.g. '{"k": 10, "mode": "hybrid", "fusion": "rrf", "rerank":
true, "depth": 4, "retrieval_weight": 2}'.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.load import Server, name_value  # noqa: E402
from retrieval.readers import read_queries  # noqa: E402

WARM_UP = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", type=Path, required=True, help="index directory served")
    parser.add_argument("--queries", type=Path, required=True, help="TSV qid<TAB>query or BEIR JSONL")
    parser.add_argument("--set", type=name_value, action="append", default=[], metavar="NAME=VALUE",
                        help="a service setting, e.g. SEARCH_RERANK_BACKEND=onnx-int8 (repeatable)")
    parser.add_argument("--body", type=json.loads, default={"k": 10}, help="JSON each request adds to its query")
    args = parser.parse_args()
    queries = list(read_queries(args.queries).values())
    started = time.perf_counter()
    trips: list[float] = []
    stages: dict[str, list[float]] = {}
    with Server(args.index, "cpu", environ=dict(args.set)) as server, \
            httpx.Client(base_url=server.base, timeout=300, trust_env=False) as client:
        for number, query in enumerate(queries[:WARM_UP] + queries):
            sent = time.perf_counter()
            response = client.post("/search", json={**args.body, "query": query})
            elapsed = 1000 * (time.perf_counter() - sent)
            if response.status_code != 200:
                sys.exit(f"error: /search answered {response.status_code}: {response.text[:300]}")
            if number >= WARM_UP:
                trips.append(elapsed)
                for stage, ms in response.json()["latency_ms"].items():
                    stages.setdefault(stage, []).append(ms)
    p95 = statistics.quantiles(trips, n=20)[-1] if len(trips) > 1 else trips[0]
    medians = ", ".join(f"{stage} {statistics.median(values):.1f}" for stage, values in stages.items()
                        if stage != "started_at")
    print(f"{len(trips)} queries, one at a time, in {time.perf_counter() - started:.0f} s: round trip p50 "
          f"{statistics.median(trips):.1f} ms, p95 {p95:.1f} ms; stage p50s (ms): {medians}")


if __name__ == "__main__":
    main()
