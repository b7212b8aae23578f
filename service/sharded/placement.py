"""Where the application runs: the environment Serve is started with, the ports it takes on this
machine, and whether a Ray can place the replicas asked for."""

from __future__ import annotations

import errno
import math
import os
import socket
from pathlib import Path
from typing import Sequence


from service.settings import ServiceSettings


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
    root = str(Path(__file__).resolve().parents[2])
    return {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
            **serve_env(settings, local=local)}


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
