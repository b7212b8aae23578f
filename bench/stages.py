"""Where a /search's time goes: one service at a time over each index given, the demo queries sent one at a
time at k=10, and the median of each stage of the answers' own `latency_ms` beside the round trip's.

    python bench/stages.py runs/scale/kept/synthetic-10000-ivf runs/scale/kept/synthetic-5000000-ivf
"""
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.load import QUERIES, Server  # noqa: E402

WARM_UP = 5


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python bench/stages.py INDEX_DIR [INDEX_DIR ...]")
    for index in sys.argv[1:]:
        with Server(Path(index), "cpu", verify_checksums="false") as server:
            stages, trips = {}, []
            with httpx.Client(base_url=server.base, timeout=300, trust_env=False) as client:
                for number, query in enumerate(QUERIES[:WARM_UP] + QUERIES):
                    started = time.perf_counter()
                    response = client.post("/search", json={"query": query, "k": 10})
                    elapsed = 1000 * (time.perf_counter() - started)
                    response.raise_for_status()
                    if number >= WARM_UP:
                        trips.append(elapsed)
                        for stage, ms in response.json()["latency_ms"].items():
                            stages.setdefault(stage, []).append(ms)
        medians = ", ".join(f"{stage} {statistics.median(values):.2f}" for stage, values in stages.items())
        print(f"{index}: {len(trips)} queries, round trip p50 {statistics.median(trips):.2f} ms; stage p50s (ms): "
              f"{medians}", flush=True)


if __name__ == "__main__":
    main()
