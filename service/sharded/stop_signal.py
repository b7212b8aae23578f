"""The stop of `python -m service --ray`, seen by every ingress replica at once: a small Ray actor the
command owns (StopSignal), which each replica watches from its start (`watch`) and the command sets
(`drain_ingress`). Each replica then takes no new search and answers those it holds while the shards
still answer them (Serve deletes the shards with the ingress, under searches in flight). A call through
Serve's deployment handle would reach only the replica Serve's router picks, the idler, and could miss
the busy one. Kept apart from service.sharded so that the actor's worker imports no model, FAISS or web
framework."""

from __future__ import annotations

import asyncio
import logging
import time

import ray

log = logging.getLogger("service")
NAMESPACE = "dense-search"  # the command's actor's, whatever namespace the command itself runs in
CALL_TIMEOUT_S = 30.0  # the command's own calls: the stop ignores signals, so it must not hang on one
RESUME_AFTER_S = 10.0  # a replica whose command died before deleting the application serves again after it


# Async: every call waits on one event loop. A `stopped` call per replica stays pending until the stop
# (Ray does not cancel those of replicas Serve replaced), hence a cap well above any replica count.
@ray.remote(num_cpus=0, max_concurrency=10_000)
class StopSignal:
    """Each ingress replica waits on `stopped` (which registers it), drains, and `report`s how many
    searches it still held; the command `stop`s and reads `reports`."""

    def __init__(self) -> None:
        self.stopping, self.forever = asyncio.Event(), asyncio.Event()
        self.timeout_s, self.watchers, self.left = 0.0, set(), {}

    async def stopped(self, replica: str) -> float:
        self.watchers.add(replica)
        await self.stopping.wait()
        return self.timeout_s

    async def stop(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.stopping.set()

    async def report(self, replica: str, left: int) -> None:
        self.left[replica] = left

    async def reports(self) -> tuple[list[str], dict[str, int]]:
        return sorted(self.watchers), dict(self.left)

    async def gone(self) -> None:
        """Never answers: the caller's await fails once this actor dies with its command."""
        await self.forever.wait()


async def watch(name: str, replica: str, occupancy, resume_after_s: float = RESUME_AFTER_S) -> None:
    """In ingress replica `replica`, from its start: once the command's StopSignal `name` stops, drains
    `occupancy` (service.http.admission.Occupancy: no new search, 503 with Retry-After; those in it answered,
    up to the stop's timeout) and reports. Where the command dies before deleting the application (killed
    during the drain), the replica takes searches again `resume_after_s` later: drained for good, it would
    answer 503 for ever while Serve counts it healthy."""
    while True:
        try:
            signal = await asyncio.to_thread(ray.get_actor, name, namespace=NAMESPACE)
            timeout_s = await signal.stopped.remote(replica)
            break
        except (ValueError, ray.exceptions.ActorDiedError):  # no such actor, or dead: its command is gone
            return
        except ray.exceptions.RayError as error:  # ActorUnavailableError and the like: passing
            log.warning("stop signal %s unreachable, retrying: %s", name, error)
            await asyncio.sleep(1.0)
    left = await occupancy.drain(timeout_s)
    try:
        await signal.report.remote(replica, left)
        await signal.gone.remote()
    except ray.exceptions.RayError:
        pass
    await asyncio.sleep(resume_after_s)  # a replica deleted as it should be never gets past this
    log.warning("the command that stopped this replica is gone and the application with it is not: serving again")
    occupancy.resume()


def drain_ingress(signal, timeout_s: float) -> None:
    """Stops `signal` (every ingress replica then drains at once, each for at most `timeout_s`) and waits
    until each replica that watches it has reported, a little longer than `timeout_s` at most (a replica
    that Serve replaced stays registered: then the stop waits that long)."""
    ray.get(signal.stop.remote(timeout_s), timeout=CALL_TIMEOUT_S)
    deadline = time.monotonic() + timeout_s + 10  # beyond the replicas' own deadline: their reports' way here
    while True:
        watchers, left = ray.get(signal.reports.remote(), timeout=CALL_TIMEOUT_S)
        if set(left) >= set(watchers) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    searches = sum(left.values())
    log.log(logging.WARNING if searches or len(left) < len(watchers) else logging.INFO,
            "ingress drained: %d of %d replicas, %d searches still in them", len(left), len(watchers), searches)
