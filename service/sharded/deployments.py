"""The Serve application: S shard deployments (each holds one `build --shard i/N` directory, its FAISS index
and passages, in `num_replicas` replicas) and an ingress deployment that runs this service's own FastAPI
app (service.http.app.create_app) over a ShardedEngine: it encodes the queries (micro-batched as in
`python -m service`), scatters their vectors to every shard through Serve handles and merges the shards'
exact top-k (service/sharded/sharded_engine.py). `serve run service.sharded.deployments:sharded_app` runs
it on a cluster; `python -m service --ray` (service/sharded/command.py) here or on one."""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np
from ray import serve

from retrieval.load_options import LoadOptions
from retrieval.sharding import ShardIndex, expand_shard_dirs
from service.engine import allocator
from service.http.app import create_app
from service.settings import ServiceSettings
from service.sharded import stop_signal
from service.sharded.sharded_engine import ShardedEngine, describe_shard

log = logging.getLogger("service")
APP_NAME = "dense-search"
DESCRIBE_TIMEOUT_S = 120.0  # a shard replica starting up loads (and checksums) its index first


@serve.deployment(max_ongoing_requests=32)
class ShardDeployment:
    """One shard directory, loaded and checked as the plain service loads an index (`device` auto: the
    GPUs Ray gave this replica, the index sharded over them as `SEARCH_DEVICE=cuda` does; else the CPU),
    with its candidate structures (on the CPU; `mmap` None: the vectors memory-mapped where one is loaded)."""

    def __init__(self, index_dir: str, load: LoadOptions = LoadOptions()) -> None:
        self.index = ShardIndex(index_dir, load)

    def describe(self) -> dict:
        return describe_shard(self.index)

    async def search(self, vectors: np.ndarray, k: int, build: str | None = None, **options):
        # On the replica's event loop, not Serve's thread pool for sync methods: one thread hop less a
        # call (see docs/benchmarks.md, bench/cluster.py), and one search at a time per replica, which
        # FAISS parallelises itself. Serve's own work on this loop (health checks, queue-length probes)
        # waits for a search in progress.
        return self.index.search(vectors, k, build, **options)


class RayShard:
    """A ShardClient over a shard deployment's handle (service.sharded.sharded_engine.ShardClient)."""

    def __init__(self, name: str, handle) -> None:
        self.name, self.handle = name, handle

    def describe(self) -> dict:
        return self.handle.describe.remote().result(timeout_s=DESCRIBE_TIMEOUT_S)

    def search(self, vectors: np.ndarray, k: int, build: str | None = None, **options):
        # A DeploymentResponse: result(timeout_s=...), cancel(). `options`: ShardIndex.search's structure, candidates.
        return self.handle.search.remote(vectors, k, build, **options)


@serve.deployment
@serve.ingress()
class SearchIngress:
    """The HTTP routes of `python -m service` over the shard deployments `names` (their `handles`); with
    `stop_name`, the name of the starting command's StopSignal, drained when that command stops."""

    def __init__(self, settings: ServiceSettings, stop_name: str | None, names: list[str], *handles) -> None:
        # The bound `handles` make the shards part of this application; the calls go through handles made
        # here, which take this replica's Serve settings (gRPC under SERVE_ENV) where a bound handle keeps
        # those of the process that built the application (Ray object references unless it set SERVE_ENV).
        self.settings, self.clients = settings, [RayShard(n, serve.get_deployment_handle(n)) for n in names]
        self.stop_name = stop_name

    async def __serve_build_asgi_app__(self):
        # Off the event loop: the handles' blocking result() may not run on it, and the warm-up searches.
        asgi = await asyncio.to_thread(self._build)
        if self.stop_name:  # held: the event loop keeps only a weak reference to a task
            replica = serve.get_replica_context().replica_id.unique_id
            self.stop_watch = asyncio.get_running_loop().create_task(
                stop_signal.watch(self.stop_name, replica, asgi.state.occupancy))
        return asgi

    def _build(self):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        settings = self.settings
        engine = ShardedEngine.over(self.clients, device=settings.device, query_max_tokens=settings.query_max_tokens,
                                    rerankers=settings.rerankers, backend=settings.backend,
                                    rerank_backend=settings.rerank_backend,
                                    timeout_s=settings.shard_timeout_s, defaults=settings.defaults)
        log.info("ready: %s", engine.describe())
        return create_app(settings, engine)


def build_application(shard_dirs: Sequence[str | Path], settings: ServiceSettings, *, shard_replicas: int = 1,
                      shard_options: dict | None = None, ingress_replicas: int = 1,
                      ingress_options: dict | None = None, shard_resources: bool = False,
                      stop_name: str | None = None):
    """The Serve application: deployments `shard-0` .. `shard-{S-1}` (one per directory, as given, each
    `shard_replicas` replicas with `shard_options` as ray_actor_options, e.g. {"num_gpus": 1}) and the
    ingress `search` (`ingress_replicas`, `ingress_options`), which checks at start that the directories
    are all N shards of one build, in any order. With `shard_resources`, each replica of a shard also
    needs one unit of the custom resource named as its directory (`ray start --resources '{"shard0of4": 2}'`
    on the machines that hold shard0of4, for two replicas there). Every replica runs on the malloc that
    SEARCH_ALLOCATOR names, as `python -m service` does (allocator.worker_env; AllocatorUnavailable where
    it is jemalloc and this machine has none). With `stop_name` (the name of a StopSignal, which
    `python -m service --ray` makes), the ingress drains when it is stopped."""
    names = [f"shard-{position}" for position in range(len(shard_dirs))]
    malloc = allocator.worker_env(settings.allocator)
    log.info("replicas' malloc: %s", ", ".join(f"{name}={value}" for name, value in malloc.items()))
    # Serve logs a line per request and per shard call unless told not to; SEARCH_ACCESS_LOG decides, as it
    # does for uvicorn's (off by default: under load it takes a share of the event loop that serving needs).
    logging_config = {"enable_access_log": settings.access_log}
    shards = []
    for name, directory in zip(names, shard_dirs):
        options = _replica_options(shard_options, malloc)
        if shard_resources:
            options["resources"] = {**options.get("resources", {}), Path(directory).name: 1}
        shards.append(ShardDeployment.options(name=name, num_replicas=shard_replicas, ray_actor_options=options,
                                              logging_config=logging_config)
                      .bind(str(directory), replace(settings.load, device="auto")))
    # Serve holds a replica's requests past max_ongoing_requests in its own queue, unbounded, where the app
    # would never see them to answer 429: so twice the app's cap, which leaves the app to refuse searches
    # past SEARCH_MAX_CONCURRENT_REQUESTS at once, as the plain service does, and keeps room for /health,
    # /ready and the refusals themselves (Serve counts them all; the app counts only searches).
    ingress = SearchIngress.options(name="search", num_replicas=ingress_replicas,
                                    max_ongoing_requests=2 * settings.max_concurrent_requests,
                                    ray_actor_options=_replica_options(ingress_options, malloc),
                                    logging_config=logging_config)
    return ingress.bind(settings, stop_name, names, *shards)


def sharded_app(args: dict):
    """An application builder for Serve config files and KubeRay's RayService (`import_path:
    service.sharded.deployments:sharded_app`): `args` holds `shards` (the directories, as each node sees them, or the
    folder of a `build --shards N` as seen where the builder runs) and optionally shard_replicas,
    shard_cpus, shard_gpus, shard_resources, ingress_replicas, ingress_cpus, ingress_gpus (as the --ray
    flags) and `settings`, SEARCH_* settings by their lower-case names (those
    left out come from the SEARCH_* variables where the builder runs)."""
    settings = ServiceSettings(**args.get("settings", {}))
    return build_application(
        [str(d) for d in expand_shard_dirs(args["shards"])], settings,
        shard_replicas=int(args.get("shard_replicas", 1)),
        shard_options={"num_cpus": float(args.get("shard_cpus", 1)), "num_gpus": float(args.get("shard_gpus", 0))},
        ingress_replicas=int(args.get("ingress_replicas", 1)),
        ingress_options={"num_cpus": float(args.get("ingress_cpus", 1)), "num_gpus": float(args.get("ingress_gpus", 0))},
        shard_resources=bool(args.get("shard_resources", False)),
    )


def _replica_options(options: dict | None, malloc: dict[str, str]) -> dict:
    """ray_actor_options with OMP_NUM_THREADS set to the CPUs it reserves (at least 1), unless given:
    FAISS and torch would otherwise start a thread per core in every replica of a shared machine; and
    `malloc`'s variables (allocator.worker_env), unless given."""
    options = dict(options or {})
    runtime_env = dict(options.get("runtime_env") or {})
    env_vars = {**malloc, **dict(runtime_env.get("env_vars") or {})}
    env_vars.setdefault("OMP_NUM_THREADS", str(max(1, math.ceil(options.get("num_cpus", 1)))))
    options["runtime_env"] = {**runtime_env, "env_vars": env_vars}
    return options
