"""Sharded serving on a local Ray Serve against the plain service over the same passages, in one run.

    python bench/cluster.py [--lines 300] [--shards 3] [--replicas 1 2] [--clients 1 4] [--seconds 12]
                            [--slices 4] [--k 10] [--probe 200] [--work runs/cluster]
                            [--ingress-env NAME=VALUE ...]

Builds (once, into `--work`) the first `--lines` passages of the demo corpus as `--shards` shards
(`build --shards N`) and merges them (`merge`): one flat index over the very vectors the shards
hold. Starts `python -m service` over the merged index, and on a local Ray (every core) the sharded
application (`service.sharded.deployments.build_application`) with each `--replicas` count per shard in turn, in
Serve's high-throughput mode as `python -m service --ray` sets it (`service.sharded.placement.serve_env`: each
variable overridden by the environment, e.g. RAY_SERVE_THROUGHPUT_OPTIMIZED=0 RAY_SERVE_ENABLE_HA_PROXY=0
for Serve's defaults).
For every client count it drives the plain service and the Ray path in alternating slices (plain,
Ray, Ray, plain, ...) adding up to `--seconds` each, and prints throughput, p50 and p99 with the Ray
path's p50 as a ratio of the plain service's (the goal: at most 1.3 at one client). Then, one request
at a time and alternating between the two (`--probe` each), where each path's time goes: the medians
of the service's own `latency_ms` stages (encode; retrieve: for the Ray path, the shard calls and the
merge) and of the HTTP hop (the client's time less the service's total). Before each load and after
each of its slices it reads the resident memory of the plain service and of the Ray path's ingress
and shard replicas (MiB; both run on the malloc SEARCH_ALLOCATOR names). No CPUs are reserved for the
replicas: the ingress, the shards and the plain service share the machine, as the clients do, so the
figures compare the paths' overhead, not a cluster's capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.load import QUERIES, Server, alternate, name_value, rss_mib, search_request  # noqa: E402
from bench.ports import unclaimed_ports  # noqa: E402
from index_builder.build import BuildOptions, build_index  # noqa: E402
from index_builder.merge import merge_shards  # noqa: E402
from models.encoder import BiEncoder  # noqa: E402
from retrieval.sharding import shard_folder  # noqa: E402
from service.settings import ServiceSettings  # noqa: E402

GOAL = 1.3
PARTS = ("client", "hop", "encode", "retrieve")


def replica_pids(app: str, deployment: str = "") -> list[int]:
    """The pids of this machine's replicas of Serve application `app` (titled ray::ServeReplica:APP:DEPLOYMENT),
    those of `deployment` (a name's beginning) only if given."""
    prefix = f"ray::ServeReplica:{app}:{deployment}".encode()
    found = []
    for process in Path("/proc").glob("[0-9]*"):
        try:
            if (process / "cmdline").read_bytes().startswith(prefix):
                found.append(int(process.name))
        except OSError:
            continue
    return found


def where_time_goes(bases: dict[str, str], requests: int, k: int) -> dict[str, dict[str, float]]:
    """Per target, the medians (ms) over `requests` sequential searches, sent to the targets in turn (so
    a drifting host weighs on each alike): the client's round trip, the HTTP hop (that less the
    service's own `latency_ms.total`), and the encode and retrieve stages."""
    clients = {name: httpx.Client(base_url=base, timeout=60.0, trust_env=False) for name, base in bases.items()}
    seen: dict[str, list[dict[str, float]]] = {name: [] for name in bases}
    try:
        for i in range(requests + 10):  # the first 10 each warm the connection
            for name, client in clients.items():
                started = time.perf_counter()
                answer = client.post("/search", json={"query": QUERIES[i % len(QUERIES)], "k": k})
                elapsed = 1000 * (time.perf_counter() - started)
                answer.raise_for_status()
                stages = answer.json()["latency_ms"]
                if i >= 10:
                    seen[name].append({"client": elapsed, "hop": elapsed - stages["total"], **stages})
    finally:
        for client in clients.values():
            client.close()
    return {name: {part: statistics.median(r[part] for r in rows) for part in PARTS} for name, rows in seen.items()}


def indexes(work: Path, lines: int, count: int) -> tuple[list[Path], Path]:
    """The shards and their merge, built unless `work` already holds them."""
    folder = work / f"demo{lines}-{count}"
    shards = [shard_folder(folder / "shards", i) for i in range(count)]
    merged = folder / "merged"
    if not merged.exists():
        folder.mkdir(parents=True, exist_ok=True)
        corpus = folder / "corpus.tsv"
        with (ROOT / "data/demo/corpus.tsv").open(encoding="utf-8") as source:
            corpus.write_text("".join(line for _, line in zip(range(lines), source)), encoding="utf-8")
        if not shards[0].exists():
            build_index(BuildOptions(corpus, folder / "shards", shards=count), BiEncoder(device="cpu"))
        merge_shards(shards, merged)
    return shards, merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=300)
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2], help="replicas per shard, in turn")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--seconds", type=float, default=12.0, help="per setup and client count")
    parser.add_argument("--slices", type=int, default=4)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--probe", type=int, default=200,
                        help="sequential requests per target for the stage medians (0: none)")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "cluster")
    parser.add_argument("--ingress-env", action="append", default=[], type=name_value, metavar="NAME=VALUE",
                        help="a variable for the ingress replicas' environment (e.g. OMP_WAIT_POLICY=PASSIVE); repeatable")
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    from service.sharded.command import shutdown_serve
    from service.sharded.deployments import APP_NAME, build_application
    from service.sharded.placement import job_env

    shards, merged = indexes(args.work, args.lines, args.shards)
    rows, parts, memories = [], [], []
    threads = str(os.cpu_count() or 1)
    with Server(merged, "cpu") as plain:
        settings = ServiceSettings(device="cpu")
        ray.init(include_dashboard=False, runtime_env={"env_vars": job_env(settings, local=True)})
        try:
            [port] = unclaimed_ports(1)
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            for replicas in args.replicas:
                application = build_application(
                    [str(s) for s in shards], settings, shard_replicas=replicas, shard_options={"num_cpus": 0},
                    ingress_options={"num_cpus": 0, "runtime_env": {"env_vars": {
                        "OMP_NUM_THREADS": threads, **dict(args.ingress_env)}}})
                serve.run(application, name=APP_NAME, route_prefix="/")
                ray_path = f"ray, {args.shards} shards x {replicas}"

                def memory() -> dict[str, str]:
                    return {"plain": f"{rss_mib(plain.process.pid):.0f}",
                            ray_path: f"{sum(map(rss_mib, replica_pids(APP_NAME, 'search'))):.0f}"
                                      f"+{sum(map(rss_mib, replica_pids(APP_NAME, 'shard-'))):.0f}"}
                for clients in args.clients:
                    search = search_request(args.k)
                    targets = {"plain": (plain.base, search), ray_path: (f"http://127.0.0.1:{port}", search)}
                    series = {name: [reading] for name, reading in memory().items()}
                    loads = asyncio.run(alternate(targets, clients, args.seconds, args.slices, warm_up_s=1.0,
                                                  timeout_s=60.0,
                                                  after_slice=lambda name: series[name].append(memory()[name])))
                    base = loads["plain"].row()
                    memories += [(name, clients, readings) for name, readings in series.items()]
                    for name, load in loads.items():
                        row = load.row()
                        rows.append((name, clients, row, row["p50"] / base["p50"]))
                if args.probe:
                    found = where_time_goes({"plain": plain.base, ray_path: f"http://127.0.0.1:{port}"},
                                            args.probe, args.k)
                    parts += list(found.items())
                serve.delete(APP_NAME)
        finally:
            shutdown_serve()
            ray.shutdown()

    print(f"\n{args.lines} passages, k={args.k}, {args.seconds:g} s per setup and client count, {os.cpu_count()} cores")
    print(f"{'setup':<24} {'clients':>7} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6} {'p50 / plain':>11}")
    for name, clients, row, ratio in rows:
        print(f"{name:<24} {clients:>7} {row['rps']:>8.1f} {row['p50']:>8.1f} {row['p99']:>8.1f} "
              f"{row['errors']:>6} {ratio:>11.2f}")
    print(f"\nresident memory, MiB, before the load and after each of its {args.slices} slices "
          "(the Ray path: ingress+shards)")
    for name, clients, readings in memories:
        print(f"{name:<24} {clients:>7}  {' '.join(readings)}")
    if parts:
        print(f"\nwhere the time goes, one request at a time ({args.probe} each), medians in ms "
              "(hop: the client's time less the service's total)")
        print(f"{'setup':<24} " + " ".join(f"{part:>8}" for part in PARTS))
        for name, medians in parts:
            print(f"{name:<24} " + " ".join(f"{medians[part]:>8.2f}" for part in PARTS))
    one = [ratio for name, clients, _, ratio in rows if name != "plain" and clients == min(args.clients)]
    print(f"\nRay path p50 overhead at {min(args.clients)} client(s): "
          + ", ".join(f"{ratio:.2f}x" for ratio in one) + f" (goal <= {GOAL}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
