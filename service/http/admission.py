"""Admission control: how much work the service takes on, refused early and cheaply.

A cap on search requests in the service (queued or running): past it the answer is 429 at once, with
Retry-After, as text-embeddings-inference answers past its max_concurrent_requests, instead of a
queue that only grows slower; the HTTP protocol (service/http/protocol.py) answers it itself, as soon as
the request head is in, and this middleware wherever no protocol did."""

from __future__ import annotations

import asyncio
import time

from service.engine.monitoring import Monitor
from service.http.keys import Keys
from service.errors import Overloaded, Stopping
from service.http import status
from service.http.status import send_error

# The routes that run a model or write (all POST): the ones the cap counts.
MODEL_PATHS = frozenset({"/search", "/search/batch", "/v1/embeddings", "/rerank", "/passages", "/passages/delete"})
# In the ASGI scope of a search request the HTTP protocol has already counted in (see service.http.protocol).
ADMITTED = "search.admitted"


def is_search(scope: dict) -> bool:
    """Whether the request of ASGI `scope` runs a model, so counts against the cap."""
    return scope["path"] in MODEL_PATHS and scope["method"] == "POST"


class Occupancy:
    """Search requests in the service now, against the cap (read by /metrics), and the refusal past it.
    Where `keys` asks for a key, only a request that carries a known one counts: the app answers the others
    401, but only once it has read their bodies, and keyless clients sending slow bodies must not fill the cap."""

    def __init__(self, cap: int, retry_after_s: int, monitor: Monitor, keys: Keys | None = None) -> None:
        self.cap, self.retry_after_s, self.monitor, self.keys = cap, retry_after_s, monitor, keys
        self.in_flight = 0
        self.stopping = False

    def full(self) -> bool:
        return self.in_flight >= self.cap or self.stopping

    async def drain(self, timeout_s: float) -> int:
        """Takes no new search from now on (503, `refuse`) and waits, up to `timeout_s`, until those in the
        service are answered: how many are still in it. (The sharded service's stop: service/sharded/stop_signal.py.)"""
        self.stopping = True
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight

    def resume(self) -> None:
        """Takes searches again after a drain (one whose stop did not come: service/sharded/stop_signal.py)."""
        self.stopping = False

    def counts(self, scope: dict) -> bool:
        """Whether the request of ASGI `scope` counts against the cap: a search, with the key where one is set."""
        if not is_search(scope):
            return False
        if self.keys is None or not self.keys.required:
            return True
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        return self.keys.of_header(given) is not None

    async def serve(self, app, scope, receive, send) -> None:
        """Runs `app` for a request counted in (`in_flight += 1` as it was let in, which a burst of heads
        must see at once), and counts it out however it ends."""
        try:
            await app(scope, receive, send)
        finally:
            self.in_flight -= 1

    def refuse(self, unrouted_path: str | None = None) -> Overloaded | Stopping:
        """Counts a refusal and returns its error. `unrouted_path`: the refusal is answered outside the app,
        whose request counter does not see it, so it is counted by route here."""
        if self.stopping:
            error = Stopping(f"stopping: this service takes no new search; retry after {self.retry_after_s} s",
                             self.retry_after_s)
        else:
            error = Overloaded(
                f"overloaded: {self.cap} search requests are in the service, the max_concurrent_requests limit "
                f"(SEARCH_MAX_CONCURRENT_REQUESTS); retry after {self.retry_after_s} s", self.retry_after_s)
        self.monitor.rejected.inc()
        if unrouted_path is not None:
            self.monitor.observe_request(unrouted_path, status.answer(error)[0])  # the status, as status.py maps it
        return error


class Admission:
    """ASGI middleware: counts the search requests in the service, and refuses one past the cap with 429
    before its body is read (where the HTTP protocol has not refused it already: see service.http.protocol)."""

    def __init__(self, app, occupancy: Occupancy) -> None:
        self.app, self.occupancy = app, occupancy

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get(ADMITTED) or not self.occupancy.counts(scope):
            return await self.app(scope, receive, send)
        occupancy = self.occupancy
        if occupancy.full():
            return await send_error(send, occupancy.refuse())
        occupancy.in_flight += 1
        await occupancy.serve(self.app, scope, receive, send)
