"""What one round of shard calls costs on Ray, from inside a Serve replica as the ingress makes them.

    python bench/shard_calls.py [--lines 300] [--shards 3] [--calls 300] [--work runs/cluster]

On a local Ray in Serve's high-throughput mode (service.sharded.placement.job_env, as `python -m service --ray`
runs), over the shards bench/cluster.py builds: the shard deployments of the sharded application
(service.sharded.deployments.ShardDeployment), plain Ray actors holding the same shards (retrieval.sharding.ShardIndex),
and an echo deployment. A probe deployment then times, one round after another from a worker thread as
the ingress's engine calls them, the median of: an echo through a Serve handle, to one and to
`--shards` at once; a search of one query vector through the shard deployments' handles, one and all
at once (what the Ray path's `retrieve` stage waits for), also sent from one thread and awaited on
another as the ingress's engine does; and the same calls on the plain actors
(`ray.get`). The gap between Serve's handles and plain actor calls is what leaving Serve's deployments
for the shard calls could save; the rest is Ray's own cost of a call between processes. Last, with no
call in flight, the median time to encode one demo query in the probe replica and in this process,
with Ray and the replicas still up (the same encoder, as many threads): what being a Serve replica
costs the ingress's encoder.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cluster import indexes  # noqa: E402
from bench.load import QUERIES  # noqa: E402
from bench.ports import unclaimed_ports  # noqa: E402
from models.encoder import BiEncoder  # noqa: E402
from retrieval.load_options import LoadOptions  # noqa: E402
from service.settings import ServiceSettings  # noqa: E402


def median_ms(call, rounds: int) -> float:
    for _ in range(20):  # warm-up
        call()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def encode_ms(rounds: int) -> float:
    """The median time to encode one demo query (each in turn) with MiniLM on the CPU, in this process."""
    encoder, turn = BiEncoder(device="cpu"), itertools.count()
    return median_ms(lambda: encoder.encode_texts([QUERIES[next(turn) % len(QUERIES)]]), rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=300)
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--calls", type=int, default=300, help="rounds timed per kind of call")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "cluster")
    args = parser.parse_args(argv)

    import ray
    import torch
    from ray import serve

    from retrieval.sharding import ShardIndex
    from service.sharded.command import shutdown_serve
    from service.sharded.deployments import ShardDeployment
    from service.sharded.placement import job_env

    @serve.deployment
    class Echo:
        async def ping(self, value):
            return value

    @ray.remote(num_cpus=0)
    class PlainShard:
        def __init__(self, directory: str) -> None:
            self.index = ShardIndex(directory, load=LoadOptions(device="cpu"))

        def ping(self, value):
            return value

        def search(self, vectors, k, build=None):
            return self.index.search(vectors, k, build)

    @serve.deployment
    class Probe:
        def __init__(self, count: int, actors: list, rounds: int) -> None:
            self.shards = [serve.get_deployment_handle(f"shard-{i}", app_name=f"shard-{i}") for i in range(count)]
            self.echo = serve.get_deployment_handle("Echo", app_name="echo")
            self.actors, self.rounds = actors, rounds

        def _measure(self) -> dict[str, float]:
            vector = np.random.default_rng(0).random((1, 384), dtype=np.float32)
            shards, echo, actors, n = self.shards, self.echo, self.actors, len(self.shards)
            pool = ThreadPoolExecutor(1)  # as the ingress's engine: sent from its model thread, awaited on a pool
            calls = {
                "Serve handle, echo, 1": lambda: echo.ping.remote(1).result(),
                f"Serve handle, echo, {n} at once": lambda: [r.result() for r in [echo.ping.remote(1) for _ in range(n)]],
                "Serve handle, shard search, 1": lambda: shards[0].search.remote(vector, 10).result(),
                f"Serve handle, shard search, {n} at once":
                    lambda: [r.result() for r in [s.search.remote(vector, 10) for s in shards]],
                f"Serve handle, shard search, {n} at once, awaited on another thread":
                    lambda: pool.submit(lambda sent: [r.result() for r in sent],
                                        [s.search.remote(vector, 10) for s in shards]).result(),
                "Ray actor, echo, 1": lambda: ray.get(actors[0].ping.remote(1)),
                f"Ray actor, echo, {n} at once": lambda: ray.get([a.ping.remote(1) for a in actors]),
                "Ray actor, shard search, 1": lambda: ray.get(actors[0].search.remote(vector, 10)),
                f"Ray actor, shard search, {n} at once": lambda: ray.get([a.search.remote(vector, 10) for a in actors]),
            }
            found = {name: median_ms(call, self.rounds) for name, call in calls.items()}
            return {**found, "encode one query, in a Serve replica": encode_ms(self.rounds)}

        async def measure(self) -> dict[str, float]:
            return await asyncio.to_thread(self._measure)  # off the replica's loop, as the engine's calls are

    shards, _ = indexes(args.work, args.lines, args.shards)
    env = job_env(ServiceSettings(device="cpu"), local=True)
    ray.init(include_dashboard=False, runtime_env={"env_vars": env})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": unclaimed_ports(1)[0]})
        one_thread = {"num_cpus": 0, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}}}
        for position, directory in enumerate(shards):
            serve.run(ShardDeployment.options(name=f"shard-{position}", ray_actor_options=one_thread)
                      .bind(str(directory), LoadOptions(device="cpu")), name=f"shard-{position}", route_prefix=None)
        serve.run(Echo.options(ray_actor_options={"num_cpus": 0}).bind(), name="echo", route_prefix=None)
        actors = [PlainShard.options(runtime_env=one_thread["runtime_env"]).remote(str(d)) for d in shards]
        threads = {"num_cpus": 0, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(torch.get_num_threads())}}}
        probe = serve.run(Probe.options(ray_actor_options=threads).bind(len(shards), actors, args.calls),
                          name="probe", route_prefix=None)
        found = probe.measure.remote().result(timeout_s=1800)
        # Here, with the same replicas and actors idle beside it.
        found["encode one query, in this process (not Ray's)"] = encode_ms(args.calls)
    finally:
        shutdown_serve()
        ray.shutdown()
    print(f"\n{args.shards} shards of {args.lines} passages, k=10, one query vector, median of {args.calls} rounds "
          "from a thread of a Serve replica")
    for name, ms in found.items():
        print(f"{name:<40} {ms:>7.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
