"""Admission control: how much work the service takes on, refused early and cheaply, shared fairly between keys.

A cap on search requests in the service (queued or running): past it the answer is 429 at once, with
Retry-After, as text-embeddings-inference answers past its max_concurrent_requests, instead of a
queue that only grows slower; the HTTP protocol (service/http/protocol.py) answers it itself, as soon as
the request head is in, and this middleware wherever no protocol did.

The cap is shared between API keys (key names; `open` where no key is configured): below it any key is let in,
so one key alone may fill it; at it, a key with no search in the service is let in all the same (one place of
its own past the cap: at most the cap plus one per key are in), a key holding fewer than its fair share (the cap
over the keys with searches in the service or waiting, the newcomer's counted, at least 1) waits up to
SEARCH_RETRY_AFTER_S for the next place below the cap, which goes to a waiting key before any new arrival, and a
key at or past its share is refused at once. So a key flooding the service cannot keep another out of it (issue
75; and service/engine/fair_queue.py keeps it from queueing ahead of the other on the model thread), and a
service without keys behaves as a single key: refused at once at the cap."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from dataclasses import dataclass

from service.engine.fair_queue import current_key
from service.engine.monitoring import Monitor
from service.http.keys import OPEN, Keys
from service.errors import Overloaded, Stopping
from service.http import status
from service.http.status import send_error

# The routes that run a model or write (all POST): the ones the cap counts.
MODEL_PATHS = frozenset({"/search", "/search/batch", "/v1/embeddings", "/rerank", "/passages", "/passages/delete"})
# In the ASGI scope of a search request the HTTP protocol has already decided on (see service.http.protocol).
ADMITTED = "search.admitted"


def is_search(scope: dict) -> bool:
    """Whether the request of ASGI `scope` runs a model, so counts against the cap."""
    return scope["path"] in MODEL_PATHS and scope["method"] == "POST"


@dataclass(eq=False)
class Place:
    """A search's place under the cap, for key `key`: taken at once, or waited for (`granted` resolves True once
    a place is handed to it, False when the service stops)."""

    key: str
    granted: asyncio.Future | None = None


class Occupancy:
    """Search requests in the service now, against the cap (read by /metrics), per key and in all, the fair share
    of it each key may claim, and the refusal past it. Where `keys` asks for a key, only a request that carries a
    known one counts: the app answers the others 401, but only once it has read their bodies, and keyless clients
    sending slow bodies must not fill the cap."""

    def __init__(self, cap: int, retry_after_s: int, monitor: Monitor, keys: Keys | None = None) -> None:
        self.cap, self.retry_after_s, self.monitor, self.keys = cap, retry_after_s, monitor, keys
        self.in_flight = 0
        self.held: Counter[str] = Counter()  # in the service, by key name (zeros kept: /metrics shows them)
        self.waiters: deque[Place] = deque()  # at the cap, waiting for a place, in arrival order
        self.waiting: Counter[str] = Counter()  # the same, by key name
        self.stopping = False

    def full(self) -> bool:
        return self.in_flight >= self.cap or self.stopping

    async def drain(self, timeout_s: float) -> int:
        """Takes no new search from now on (503, `refuse`) and waits, up to `timeout_s`, until those in the
        service are answered: how many are still in it. (The sharded service's stop: service/sharded/stop_signal.py.)"""
        self.stopping = True
        while self.waiters:  # those waiting for a place are answered 503 too
            place = self.waiters.popleft()
            self.waiting[place.key] -= 1
            if not place.granted.done():
                place.granted.set_result(False)
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight

    def resume(self) -> None:
        """Takes searches again after a drain (one whose stop did not come: service/sharded/stop_signal.py)."""
        self.stopping = False

    def key_of(self, scope: dict) -> str | None:
        """The name of the key the request of ASGI `scope` counts against the cap for; None: it does not count (no
        search, or no known key where one is set)."""
        if not is_search(scope):
            return None
        if self.keys is None or not self.keys.required:
            return OPEN.name
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        key = self.keys.of_header(given)
        return key.name if key is not None else None

    def counts(self, scope: dict) -> bool:
        """Whether the request of ASGI `scope` counts against the cap: a search, with the key where one is set."""
        return self.key_of(scope) is not None

    def enter(self, key: str) -> Place | None:
        """A place for a search of `key`, decided at once (synchronously: a burst of heads sees every decision
        before it): taken, below the cap or where the key has none in the service (a place of its own, past the
        cap: so at most the cap plus one per key are in); waited for, at the cap, by a key below its fair share;
        None: refuse it."""
        if self.stopping:
            return None
        claimed = self.held[key] + self.waiting[key]
        if self.in_flight < self.cap or not claimed:  # a key with none in the service has a place of its own
            self._take(key)
            return Place(key)
        if claimed >= self.cap or self.retry_after_s <= 0:  # a key alone at the cap, as a service without keys
            return None
        active = {name for name, count in self.held.items() if count} | {
            name for name, count in self.waiting.items() if count} | {key}
        if claimed >= max(1, self.cap // len(active)):
            return None
        place = Place(key, asyncio.get_running_loop().create_future())
        self.waiters.append(place)
        self.waiting[key] += 1
        return place

    async def serve(self, app, place: Place, scope, receive, send, *, unrouted: bool = False) -> None:
        """Runs `app` for the request `place` is for, once it holds the place (waited for up to the Retry-After,
        else answered 429, or 503 if the service stopped meanwhile), and gives the place back however the request
        ends. `unrouted`: a refusal here is answered outside the app (see `refuse`)."""
        if place.granted is not None and not await self._wait(place):
            return await send_error(send, self.refuse(scope["path"] if unrouted else None, place.key, waited=True))
        current_key.set(place.key)  # its work on the model thread queues in its key's lane (fair_queue)
        try:
            await app(scope, receive, send)
        finally:
            self._leave(place.key)

    async def _wait(self, place: Place) -> bool:
        """Whether a place was handed to `place` within the Retry-After (False too: the service stopped). A client
        gone meanwhile is not seen here (its body is unread): its request takes the place, and ends in the app."""
        granted = place.granted
        try:
            await asyncio.wait((granted,), timeout=self.retry_after_s)
        except BaseException:  # cancelled: a place handed over meanwhile is given back
            if not granted.done():
                self._forget(place)
            elif granted.result():
                self._leave(place.key)
            raise
        if not granted.done():
            self._forget(place)
            return False
        return granted.result()

    def _forget(self, place: Place) -> None:
        place.granted.cancel()
        self.waiters.remove(place)
        self.waiting[place.key] -= 1

    def _take(self, key: str) -> None:
        self.in_flight += 1
        self.held[key] += 1

    def _leave(self, key: str) -> None:
        """Gives back `key`'s place: to the waiting key with the fewest in the service (the first of them to
        come), else to whoever comes next; a place of a key's own, past the cap, to nobody."""
        self.held[key] -= 1
        self.in_flight -= 1
        if self.waiters and not self.stopping and self.in_flight < self.cap:
            place = min(self.waiters, key=lambda waiting: self.held[waiting.key])  # the first of the fewest
            self.waiters.remove(place)
            self.waiting[place.key] -= 1
            self._take(place.key)
            place.granted.set_result(True)

    def refuse(self, unrouted_path: str | None = None, key: str | None = None, waited: bool = False
               ) -> Overloaded | Stopping:
        """Counts a refusal (by `key` too, where known) and returns its error. `unrouted_path`: the refusal is
        answered outside the app, whose request counter does not see it, so it is counted by route here; `waited`:
        the request waited for its share and no place came."""
        if self.stopping:
            error = Stopping(f"stopping: this service takes no new search; retry after {self.retry_after_s} s",
                             self.retry_after_s)
        else:
            error = Overloaded(
                f"overloaded: {self.cap} search requests are in the service, the max_concurrent_requests limit "
                f"(SEARCH_MAX_CONCURRENT_REQUESTS)" + (", and no place came free within the Retry-After for this "
                "key's share of it" if waited else "") + f"; retry after {self.retry_after_s} s", self.retry_after_s)
        self.monitor.rejected.inc()
        if key is not None:
            self.monitor.observe_key_refusal(key)
        if unrouted_path is not None:
            self.monitor.observe_request(unrouted_path, status.answer(error)[0])  # the status, as status.py maps it
        return error


class Admission:
    """ASGI middleware: counts the search requests in the service, and refuses one past the cap with 429
    before its body is read, or has it wait for its key's share (where the HTTP protocol has not decided
    already: see service.http.protocol)."""

    def __init__(self, app, occupancy: Occupancy) -> None:
        self.app, self.occupancy = app, occupancy

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get(ADMITTED):
            return await self.app(scope, receive, send)
        key = self.occupancy.key_of(scope)
        if key is None:
            return await self.app(scope, receive, send)
        place = self.occupancy.enter(key)
        if place is None:
            return await send_error(send, self.occupancy.refuse(key=key))
        await self.occupancy.serve(self.app, place, scope, receive, send)
