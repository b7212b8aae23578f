"""Where a /search's time goes, and how one index's round trip compares with another's: each round starts a
service over each index given, alone and in turn (the order rotated from round to round), and sends it the
demo queries (k=10) one request at a time; with --together, one service over every index at once, each query
sent to each in turn, so drift of the machine falls on all alike (but each request finds its caches cooled by
the others'). Rounds start the services afresh, since one process's encoding speed differs from the next's by
more than retrieval costs. Each round prints the medians of the answers' own `latency_ms` stages beside the
round trip's; the end, each index's median over rounds and its ratio to the first index's.

    python bench/stages.py [--rounds 5] [--together] runs/scale/kept/synthetic-10000-ivf runs/scale/kept/synthetic-5000000-ivf
"""
import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.load import QUERIES, Server  # noqa: E402

WARM_UP = 5


def one_round(indexes: list[str]) -> list[tuple[float, dict[str, float]]]:
    """Per index, served together: the round trip's p50 (ms) and each stage's p50."""
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(Server(Path(index), "cpu", verify_checksums="false")) for index in indexes]
        clients = [stack.enter_context(httpx.Client(base_url=server.base, timeout=300, trust_env=False))
                   for server in servers]
        trips: list[list[float]] = [[] for _ in indexes]
        stages: list[dict[str, list[float]]] = [{} for _ in indexes]
        for number, query in enumerate(QUERIES[:WARM_UP] + QUERIES):
            for turn in range(len(indexes)):
                at = (number + turn) % len(indexes)
                started = time.perf_counter()
                response = clients[at].post("/search", json={"query": query, "k": 10})
                elapsed = 1000 * (time.perf_counter() - started)
                response.raise_for_status()
                if number >= WARM_UP:
                    trips[at].append(elapsed)
                    for stage, ms in response.json()["latency_ms"].items():
                        stages[at].setdefault(stage, []).append(ms)
    return [(statistics.median(trip), {stage: statistics.median(values) for stage, values in stage_ms.items()})
            for trip, stage_ms in zip(trips, stages)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("indexes", nargs="+", help="index directories")
    parser.add_argument("--rounds", type=int, default=1, help="fresh starts of every service (default 1)")
    parser.add_argument("--together", action="store_true", help="serve every index at once, queries interleaved")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    started = time.perf_counter()
    p50s: list[list[float]] = [[] for _ in args.indexes]
    for round_number in range(1, args.rounds + 1):
        if args.together:
            answers = one_round(args.indexes)
        else:
            order = [(round_number - 1 + turn) % len(args.indexes) for turn in range(len(args.indexes))]
            alone = {at: one_round([args.indexes[at]])[0] for at in order}
            answers = [alone[at] for at in range(len(args.indexes))]
        for at, (trip, stage_ms) in enumerate(answers):
            p50s[at].append(trip)
            medians = ", ".join(f"{stage} {ms:.2f}" for stage, ms in stage_ms.items())
            print(f"round {round_number}, {args.indexes[at]}: {len(QUERIES)} queries, round trip p50 {trip:.2f} ms; "
                  f"stage p50s (ms): {medians}", flush=True)
    for at, index in enumerate(args.indexes):
        ratios = [p50 / first for p50, first in zip(p50s[at], p50s[0])]
        print(f"{index}: round trip p50 over {args.rounds} rounds {statistics.median(p50s[at]):.2f} ms "
              f"(rounds {', '.join(f'{p:.1f}' for p in p50s[at])}); against {args.indexes[0]}: median "
              f"{statistics.median(ratios):.2f}x (rounds {', '.join(f'{r:.2f}' for r in ratios)})")
    print(f"{args.rounds} rounds over {len(args.indexes)} indexes in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
