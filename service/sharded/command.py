"""`python -m service --ray`: starts (or joins) Ray, deploys the application (service/sharded/deployments.py)
where it can be placed and its ports are free (placement.py), and stops it whole on Ctrl-C or SIGTERM,
the ingress drained first (stop_signal.py).

Only `python -m service --ray ...` imports this folder; the plain service never imports Ray."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
import uuid
from pathlib import Path

import ray
from ray import serve
from ray.serve.schema import ApplicationStatusOverview, DeploymentStatus

from retrieval.sharding import expand_shard_dirs
from service.engine import allocator
from service.settings import ServiceSettings
from service.sharded import stop_signal
from service.sharded.deployments import APP_NAME, build_application
from service.sharded.placement import job_env, placement_problems, ports_in_use, serve_ports, starts_local_ray

log = logging.getLogger("service")


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
