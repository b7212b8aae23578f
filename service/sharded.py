"""Sharded serving on Ray Serve: one application of S shard deployments (each holds one `build --shard
i/N` directory, its FAISS index and passages, in `num_replicas` replicas) and an ingress deployment that
runs this service's own FastAPI app (service.app.create_app) over a ShardedEngine: it encodes the
queries (micro-batched as in `python -m service`), scatters their vectors to every shard through Serve
handles and merges the shards' exact top-k (service/sharded_engine.py).

Only `python -m service --ray ...` imports this module; the plain service never imports Ray."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import math
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Sequence

import numpy as np
import ray
from ray import serve
from ray.serve.schema import ApplicationStatusOverview, DeploymentStatus

from retrieval.sharding import ShardIndex, expand_shard_dirs
from service import allocator, stop_signal
from service.app import create_app
from service.settings import ServiceSettings
from service.sharded_engine import ShardedEngine, describe_shard

log = logging.getLogger("service")
APP_NAME = "dense-search"
DESCRIBE_TIMEOUT_S = 120.0  # a shard replica starting up loads (and checksums) its index first


@serve.deployment(max_ongoing_requests=32)
class ShardDeployment:
    """One shard directory, loaded and checked as the plain service loads an index (`device` auto: the
    GPUs Ray gave this replica, the index sharded over them as `SEARCH_DEVICE=cuda` does; else the CPU),
    with its candidate structures (on the CPU; `mmap` None: the vectors memory-mapped where one is loaded)."""

    def __init__(self, index_dir: str, device: str = "auto", verify_checksums: bool = True,
                 mmap: bool | None = None, fp16: bool = False) -> None:
        self.index = ShardIndex(index_dir, device=device, verify_checksums=verify_checksums, mmap=mmap, fp16=fp16)

    def describe(self) -> dict:
        return describe_shard(self.index)

    async def search(self, vectors: np.ndarray, k: int, build: str | None = None, **options):
        # On the replica's event loop, not Serve's thread pool for sync methods: one thread hop less a
        # call (see docs/benchmarks.md, bench/cluster.py), and one search at a time per replica, which
        # FAISS parallelises itself. Serve's own work on this loop (health checks, queue-length probes)
        # waits for a search in progress.
        return self.index.search(vectors, k, build, **options)


class RayShard:
    """A ShardClient over a shard deployment's handle (service.sharded_engine.ShardClient)."""

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
                stop_signal.watch(self.stop_name, replica, asgi.state.runtime.occupancy))
        return asgi

    def _build(self):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        settings = self.settings
        engine = ShardedEngine.over(self.clients, device=settings.device, query_max_tokens=settings.query_max_tokens,
                                    rerankers=settings.rerankers, backend=settings.backend,
                                    rerank_backend=settings.rerank_backend,
                                    timeout_s=settings.shard_timeout_s)
        log.info("ready: %s", engine.describe())
        return create_app(settings, engine)


# Ray Serve's high-throughput mode (Ray's guide "Enable High Throughput on Ray Serve"): HAProxy (shipped
# with ray[serve] on Linux) forwards HTTP straight to the ingress replica's own server in place of Serve's
# Python proxy, and the ingress calls the shards over gRPC. The router keeps its own loop, since the engine
# calls the shard handles from its model thread. It cuts much of what Serve's defaults add to a search
# (see docs/benchmarks.md, bench/cluster.py). They go into the runtime_env of the job that starts Serve,
# whose controller, proxies and replicas all inherit it (a Serve already running on a cluster keeps the
# mode it started in: under `serve run` and KubeRay, set them in the cluster's environment). Setting one
# where `python -m service --ray` runs overrides it (RAY_SERVE_ENABLE_HA_PROXY=0: Serve's Python proxy).
SERVE_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1",
    # gRPC's default 4 MiB cap on a received message would refuse a shard's answer to a batch at k = 1000.
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**31 - 1),
}


def client_timeout_env(settings: ServiceSettings) -> dict[str, str]:
    """HAProxy's `timeout client`, in whole seconds: how long a client may send nothing (of a request's
    head or body) or read nothing (of its answer) before HAProxy closes the connection (408 while the
    request is unfinished). The plain service bounds these with SEARCH_READ_TIMEOUT_S and
    SEARCH_WRITE_TIMEOUT_S; HAProxy has one limit for both ways, so it takes the longer (Ray's default:
    an hour, which lets half-sent requests hold connections)."""
    return {"RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": str(math.ceil(max(settings.read_timeout_s, settings.write_timeout_s)))}


# On a Ray started here the one load balancer in front of the ingress is this machine's HAProxy, which Serve
# itself updates (and which retries a refused connection): Ray's drain period, there for cloud load
# balancers to deregister a stopping ingress replica (30 s), would only hold every stop (Ctrl-C, SIGTERM)
# that long.
LOCAL_SERVE_ENV = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}


def serve_env(settings: ServiceSettings, *, local: bool = False) -> dict[str, str]:
    """SERVE_ENV, `client_timeout_env(settings)` and for a `local` Ray (started here) LOCAL_SERVE_ENV, each
    variable as this process's environment sets it where it does."""
    defaults = {**SERVE_ENV, **client_timeout_env(settings), **(LOCAL_SERVE_ENV if local else {})}
    return {name: os.environ.get(name, default) for name, default in defaults.items()}


def job_env(settings: ServiceSettings, *, local: bool = False) -> dict[str, str]:
    """The env_vars of a Ray job that starts Serve: `serve_env(settings, local=local)`, and a PYTHONPATH
    with this checkout ahead of the caller's, so that Ray's workers on this host import the code that
    started them."""
    root = str(Path(__file__).resolve().parents[1])
    return {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
            **serve_env(settings, local=local)}


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
    # SEARCH_INDEX_MMAP false leaves it to each shard, as to the plain service: mapped where a structure is loaded.
    for name, directory in zip(names, shard_dirs):
        options = _replica_options(shard_options, malloc)
        if shard_resources:
            options["resources"] = {**options.get("resources", {}), Path(directory).name: 1}
        shards.append(ShardDeployment.options(name=name, num_replicas=shard_replicas, ray_actor_options=options,
                                              logging_config=logging_config)
                      .bind(str(directory), "auto", settings.verify_checksums, settings.index_mmap or None,
                            settings.gpu_fp16))
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
    service.sharded:sharded_app`): `args` holds `shards` (the directories, as each node sees them, or the
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


def _amounts(resources: dict[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in resources.items())


def _fits(amount: float, offered: float) -> bool:
    return round(amount, 4) <= round(offered, 4)  # Ray counts resources in steps of 1e-4; sums of floats drift


def placement_problems(asks: Sequence[tuple[str, int, dict[str, float]]], nodes: Sequence[dict]) -> list[str]:
    """What Ray could never place of an application on the cluster as it stands: `asks` are (what, replicas,
    the resources a replica reserves), `nodes` as ray.nodes() lists them. A line for each kind of replica
    that no live node offers in full, and for each resource the replicas reserve more of, all together,
    than the live nodes have (a necessary condition, not a packing: Ray may still find no room)."""
    offered = [node.get("Resources", {}) for node in nodes if node.get("Alive")]
    problems, needed = [], {}
    for what, replicas, ask in asks:
        ask = {name: amount for name, amount in ask.items() if amount > 0}
        if ask and not any(all(_fits(amount, node.get(name, 0)) for name, amount in ask.items()) for node in offered):
            most = {name: max((node.get(name, 0) for node in offered), default=0) for name in ask}
            problems.append(f"a replica of {what} reserves {_amounts(ask)}, and no node offers that "
                            f"(the most one offers: {_amounts(most)})")
        for name, amount in ask.items():
            needed[name] = needed.get(name, 0) + replicas * amount
    for name, amount in needed.items():
        total = sum(node.get(name, 0) for node in offered)
        if not _fits(amount, total):
            problems.append(f"the replicas reserve {amount:g} {name} in all, and the cluster has {total:g}"
                            + (" (--shard-cpus 0 --ingress-cpus 0.5 lets them share the cores)" if name == "CPU" else ""))
    return problems


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sharded serving on Ray Serve (--ray)")
    group.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                       help="serve --shards on Ray Serve; ADDRESS of a running cluster (e.g. auto, or ray://HOST:10001); "
                            "none: RAY_ADDRESS, else the cluster `ray start` runs on this machine, else a local Ray "
                            "started here")
    group.add_argument("--shards", nargs="+", metavar="DIR",
                       help="the N shard directories of one build (--shard i/N jobs), or the folder of a build --shards N")
    group.add_argument("--shard-replicas", type=int, default=1, metavar="R", help="replicas per shard (default 1)")
    group.add_argument("--shard-cpus", type=float, default=1, help="CPUs each shard replica reserves (default 1)")
    group.add_argument("--shard-gpus", type=float, default=0,
                       help="GPUs each shard replica reserves (default 0); its index is sharded over them")
    group.add_argument("--shard-resources", action="store_true",
                       help="place each shard's replicas on nodes offering the custom resource named as its directory "
                            "(ray start --resources '{\"shard0of4\": 2}' where shard0of4 is)")
    group.add_argument("--ingress-replicas", type=int, default=1, help="ingress replicas (default 1)")
    group.add_argument("--ingress-cpus", type=float, default=1, help="CPUs each ingress replica reserves (default 1)")
    group.add_argument("--ingress-gpus", type=float, default=0, help="GPUs each ingress replica reserves (default 0)")


def starts_local_ray(address: str | None) -> bool:
    """Whether ray.init(address) would start a new Ray here rather than join one: no address (nor
    RAY_ADDRESS, nor a cluster `ray start` runs on this machine), or "local". Such a Ray never grows."""
    try:
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:  # Ray moved it: count it as joined, which only warns
        return False
    try:
        return canonicalize_bootstrap_address(address) is None
    except Exception:  # noqa: BLE001 - an address ray.init itself will refuse, saying why
        return False


# The ports a Serve in HAProxy mode binds at fixed numbers, each moved by its variable; Ray's own reading of
# them (ray.serve._private.constants) is what the Ray started here inherits. `True`: on every interface.
HAPROXY_MODE_PORTS = {"RAY_SERVE_HAPROXY_STATS_PORT": True, "RAY_SERVE_HAPROXY_METRICS_PORT": True,
                      "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": False}


def serve_ports(settings: ServiceSettings) -> dict[int, tuple[str, str]]:
    """The ports a Serve started here takes on this machine, with the variable that moves each and the
    address it binds: SEARCH_PORT, and in HAProxy mode (serve_env) HAProxy's stats and metrics pages (on
    every interface) and Serve's fallback proxy (on SEARCH_HOST). A second Serve in this mode on one
    machine must move them all."""
    from ray.serve._private import constants

    ports = {settings.port: ("SEARCH_PORT", settings.host)}
    if serve_env(settings)["RAY_SERVE_ENABLE_HA_PROXY"] == "1":
        for name, everywhere in HAPROXY_MODE_PORTS.items():
            port = getattr(constants, name, None)
            if isinstance(port, int) and port > 0:
                ports.setdefault(port, (name, "0.0.0.0" if everywhere else settings.host))
    return ports


def ports_in_use(ports: dict[int, tuple[str, str]]) -> list[str]:
    """`NAME=PORT` for each of `ports` (as serve_ports gives them) that something on this machine listens
    on already."""
    taken = []
    for port, (name, host) in ports.items():
        host = "0.0.0.0" if host in ("", "::", "0.0.0.0") else host  # Serve binds "::" as every interface
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as HAProxy: TIME_WAIT does not count
            try:
                probe.bind((host, port))
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    taken.append(f"{name}={port}")
    return taken


def shutdown_serve(timeout_s: float = 120.0) -> None:
    """serve.shutdown() once every application is gone. Serve's own shutdown waits 30 s for its
    controller, less than an ingress replica in direct-ingress mode may take to stop under Ray's default
    drain (RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S, 30 s, and RAY_SERVE_DIRECT_INGRESS_SHUTDOWN_BUFFER_S,
    5 s: an operator's setting where LOCAL_SERVE_ENV's is overridden), and Ray shut down under a controller
    still stopping takes down the proxy actor that would stop HAProxy."""
    for name in serve.status().applications:
        serve.delete(name, _blocking=False)  # every drain at once
    deadline = time.monotonic() + timeout_s
    while serve.status().applications:
        if time.monotonic() > deadline:
            log.warning("applications still stopping after %g s: %s", timeout_s, ", ".join(serve.status().applications))
            break
        time.sleep(0.5)
    serve.shutdown()


def start_failures(status: ApplicationStatusOverview | None) -> list[str]:
    """What stopped the application from starting, from its serve.status() entry: for each deployment
    whose replicas failed to start, its name and the last line of the replica's error (the exception:
    `shard-1: retrieval.index_format.IndexFormatError: .../index.faiss: sha256 differs from the manifest's`)."""
    failed = []
    for name, deployment in (status.deployments.items() if status else ()):
        if deployment.status in (DeploymentStatus.DEPLOY_FAILED, DeploymentStatus.UNHEALTHY):
            lines = [line.strip() for line in (deployment.message or "").splitlines() if line.strip()]
            failed.append(f"{name}: {lines[-1] if lines else deployment.status.value}")
    return failed


def _deploy(application) -> list[str]:
    """serve.run(application): [] once it runs, else its start_failures (Serve's own error names no cause)."""
    try:
        serve.run(application, name=APP_NAME, route_prefix="/")
        return []
    except RuntimeError:
        try:
            failed = start_failures(serve.status().applications.get(APP_NAME))
        except Exception:  # noqa: BLE001 - then Serve's own error is all there is
            failed = []
        if not failed:
            raise
        return failed


def _stop_on_sigterm() -> None:
    """SIGTERM (`kill`, `docker stop`, Kubernetes) stops as Ctrl-C does (_stop), and the command exits 0.
    Ray's own handler would end the process at once, before Serve could stop what it runs."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def _stop(started_here: bool, serving: bool, stop, drain_s: float) -> None:
    """Takes down what the command started: on its own Ray, Serve as a whole (the proxies stop their
    HAProxy) and Ray; on a cluster, only the application; first, given the StopSignal `stop` (the
    application deployed, or deploying), the ingress replicas running answer the searches they hold
    (drain_ingress, up to `drain_s`). A second signal is ignored meanwhile: cut short, the stop would leave
    HAProxy listening."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if serving:
        log.info("stopping %s", "Serve and the local Ray" if started_here else f"the application {APP_NAME}")
    if stop is not None:
        try:
            stop_signal.drain_ingress(stop, drain_s)
        except Exception as error:  # noqa: BLE001 - the stop goes on
            log.warning("ingress not drained: %s: %s", type(error).__name__, error)
    try:
        if serving and started_here:
            shutdown_serve()
        elif serving:
            serve.delete(APP_NAME)
    finally:
        ray.shutdown()
    if serving:
        log.info("stopped")


def serve_sharded(args: argparse.Namespace, settings: ServiceSettings) -> int:
    """Starts (or joins) Ray, runs the application on SEARCH_HOST:SEARCH_PORT (behind HAProxy under
    SERVE_ENV), and keeps it up until stopped (Ctrl-C or SIGTERM). Exits 2 before starting a Ray here where
    the ports Serve takes are in use (serve_ports), and before deploying where that Ray could never place
    the replicas (placement_problems); joining a cluster, it warns instead. Exits 2 with the replicas'
    own error where the application fails to start (a shard folder missing or damaged on its node)."""
    if not args.shards:
        print("error: --ray needs --shards DIR [DIR ...]", file=sys.stderr)
        return 2
    shard_dirs = [str(d.resolve()) for d in expand_shard_dirs(args.shards)]
    stop_name = f"stop-{uuid.uuid4().hex}"  # this command's: another's on the cluster is not it
    try:
        application = build_application(
            shard_dirs, settings, shard_replicas=args.shard_replicas,
            shard_options={"num_cpus": args.shard_cpus, "num_gpus": args.shard_gpus},
            ingress_replicas=args.ingress_replicas,
            ingress_options={"num_cpus": args.ingress_cpus, "num_gpus": args.ingress_gpus},
            shard_resources=args.shard_resources, stop_name=stop_name,
        )
    except allocator.AllocatorUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    started_here = starts_local_ray(args.ray or None)
    taken = ports_in_use(serve_ports(settings)) if started_here else []
    if taken:
        print(f"error: ports this machine's Serve would listen on are in use: {', '.join(taken)} (another service, "
              "or a HAProxy left by a Serve that was killed); set the variables named to free ports", file=sys.stderr)
        return 2
    ray.init(address=args.ray or None, runtime_env={"env_vars": job_env(settings, local=started_here)})
    _stop_on_sigterm()
    shard_ask = {"CPU": args.shard_cpus, "GPU": args.shard_gpus}
    asks = [("the ingress (--ingress-cpus, --ingress-gpus)", args.ingress_replicas,
             {"CPU": args.ingress_cpus, "GPU": args.ingress_gpus})]
    if args.shard_resources:
        asks += [(f"shard-{position} (--shard-cpus, --shard-gpus, --shard-resources)", args.shard_replicas,
                  {**shard_ask, Path(directory).name: 1}) for position, directory in enumerate(shard_dirs)]
    else:
        asks.append(("a shard (--shard-cpus, --shard-gpus)", args.shard_replicas * len(shard_dirs), shard_ask))
    unplaceable, failed, serving, stop = [], [], False, None
    try:
        problems = placement_problems(asks, ray.nodes())
        if problems and started_here:  # a Ray started here never grows: the replicas would wait for ever
            unplaceable = problems
        else:
            for problem in problems:
                log.warning("replicas wait until the cluster has room (an autoscaler may add it): %s", problem)
            stop = stop_signal.StopSignal.options(name=stop_name, namespace=stop_signal.NAMESPACE).remote()
            serve.start(http_options={"host": settings.host, "port": settings.port})
            serving = True
            failed = _deploy(application)
            if not failed:
                log.info("serving %d shards on http://%s:%d", len(shard_dirs), settings.host, settings.port)
                while True:
                    time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        # A search waits for the shards at most SEARCH_SHARD_TIMEOUT_S, after its encoding.
        _stop(started_here, serving, stop if serving and not failed else None, settings.drain_timeout_s)
    if unplaceable:
        print(f"error: the application cannot be placed on this machine's Ray: {'; '.join(unplaceable)}",
              file=sys.stderr)
        return 2
    if failed:
        print(f"error: the application could not start: {'; '.join(failed)}", file=sys.stderr)
        return 2
    return 0
