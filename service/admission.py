"""Admission control: how much work the service takes on, refused early and cheaply.

A cap on search requests in the service (queued or running): past it the answer is 429 at once, with
Retry-After, as text-embeddings-inference answers past its max_concurrent_requests, instead of a
queue that only grows slower; the HTTP protocol itself answers it, as soon as the request head is in.
And the two timeouts uvicorn lacks: a connection that has not sent a whole request head within the
read timeout is closed, so half-sent requests cannot hold connections forever (the body's timeout is
in `limits.BodyLimits`); one whose client stops reading its answer is aborted after the write
timeout, so unread responses cannot pin memory."""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import time
from http import HTTPStatus

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from service import errors
from service.errors import Overloaded, Stopping, send_error
from service.monitoring import Monitor

# The routes that run a model (all POST): the ones the cap counts.
MODEL_PATHS = frozenset({"/search", "/search/batch", "/v1/embeddings", "/rerank"})
# In the ASGI scope of a search request the HTTP protocol has already counted in (see `timeout_protocol`).
ADMITTED = "search.admitted"


def is_search(scope: dict) -> bool:
    """Whether the request of ASGI `scope` runs a model, so counts against the cap."""
    return scope["path"] in MODEL_PATHS and scope["method"] == "POST"


class Occupancy:
    """Search requests in the service now, against the cap (read by /metrics), and the refusal past it.
    With an `api_key`, only a request that carries it counts: the app answers the others 401, but only
    once it has read their bodies, and keyless clients sending slow bodies must not fill the cap."""

    def __init__(self, cap: int, retry_after_s: int, monitor: Monitor, api_key: bytes | None = None) -> None:
        self.cap, self.retry_after_s, self.monitor = cap, retry_after_s, monitor
        self.expected = b"bearer " + api_key if api_key is not None else None
        self.in_flight = 0
        self.stopping = False

    def full(self) -> bool:
        return self.in_flight >= self.cap or self.stopping

    async def drain(self, timeout_s: float) -> int:
        """Takes no new search from now on (503, `refuse`) and waits, up to `timeout_s`, until those in the
        service are answered: how many are still in it. (The sharded service's stop: service/stop_signal.py.)"""
        self.stopping = True
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight

    def resume(self) -> None:
        """Takes searches again after a drain (one whose stop did not come: service/stop_signal.py)."""
        self.stopping = False

    def counts(self, scope: dict) -> bool:
        """Whether the request of ASGI `scope` counts against the cap: a search, with the key where one is set."""
        if not is_search(scope):
            return False
        if self.expected is None:
            return True
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        scheme, _, credentials = given.partition(b" ")
        return hmac.compare_digest(scheme.lower() + b" " + credentials.strip(), self.expected)

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
            self.monitor.observe_request(unrouted_path, errors.answer(error)[0])  # the status, as errors maps it
        return error


class Admission:
    """ASGI middleware: counts the search requests in the service, and refuses one past the cap with 429
    before its body is read (where the HTTP protocol has not refused it already: see `timeout_protocol`)."""

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


def http_answer(error: errors.ServiceError, default_headers: list[tuple[bytes, bytes]], keep_alive: bool) -> bytes:
    """`error`'s whole HTTP/1.1 answer, as uvicorn would write it after its `default_headers` (Date, Server)."""
    status, body, headers = errors.answer(error)
    payload = json.dumps(body).encode()
    lines = [*default_headers, (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
             *((name.lower().encode(), value.encode()) for name, value in headers.items()),
             *([] if keep_alive else [(b"connection", b"close")])]
    return b"".join([f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode(),
                     *(name + b": " + value + b"\r\n" for name, value in lines), b"\r\n", payload])


def timeout_protocol(read_timeout_s: float, write_timeout_s: float, occupancy: Occupancy | None = None,
                     base: type[HttpToolsProtocol | H11Protocol] = HttpToolsProtocol) -> type:
    """uvicorn's HTTP protocol (`base`: httptools, uvicorn's own choice where it is installed, as
    uvicorn[standard] installs it, or h11), closing a connection whose request head is not complete within
    `read_timeout_s` of the connection opening or of the previous response (idle keep-alive connections
    are closed sooner, by uvicorn's own keep-alive timeout), and aborting one whose client has read
    nothing of a response for `write_timeout_s`: the kernel's send buffer is full and asyncio's holds
    the rest of the body (a 20 MB batch answer, for one), freed only when the connection goes.

    With `occupancy`, a search POST whose head arrives when the service is full is answered 429 by
    the protocol itself, with one write and before any of the app runs: no task, no middleware, no
    route (uvicorn answers its own limit_concurrency 503 the same way, with a stand-in app). A refusal
    then costs the event loop 35 to 50 us (measured here) against 90 to 170 through the app, and in a
    wave of a thousand requests each one waits for every refusal before it. A request let in is
    counted in at once, not when its task first runs, or a burst of heads would all find room. The
    app's `Admission` counts and refuses where no protocol did (h11, whose protocol does not start
    requests through `_start_asgi_task`; an app served some other way)."""

    # (keep-alive, stopping) -> (the default headers it has, the answer)
    refusals: dict[tuple[bool, bool], tuple[list, bytes]] = {}

    class TimeoutProtocol(base):
        _head_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None
        _completing = False

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(read_timeout_s, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _awaiting_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self._awaiting_head() and not self.transport.is_closing():
                self.transport.close()

        def _start_asgi_task(self, cycle, app) -> None:  # httptools: a request's head is complete
            if occupancy is None or not occupancy.counts(cycle.scope):
                super()._start_asgi_task(cycle, app)
            elif self._completing:
                # A pipelined request, started from inside the previous one's last send: decided on the
                # loop's next turn, once that request has left the service (and not by recursion).
                self.loop.call_soon(self._admit, cycle, app)
            else:
                self._admit(cycle, app)

        def _admit(self, cycle, app) -> None:
            if self.transport.is_closing():
                return
            if occupancy.full():
                self._refuse(cycle)
            else:
                occupancy.in_flight += 1
                cycle.scope[ADMITTED] = True
                super()._start_asgi_task(cycle, functools.partial(occupancy.serve, app))

        def _refuse(self, cycle) -> None:
            """Answers `cycle`'s request 429 (503 while stopping) whole; its body, if any, is skipped as it
            arrives (uvicorn drops the body of a request whose response is complete), and the connection stays
            open for the next."""
            error = occupancy.refuse(cycle.scope["path"])
            # A client waiting for 100 Continue may send the body anyway, or not: the connection cannot be reused.
            keep_alive = cycle.keep_alive and not cycle.waiting_for_100_continue
            # The answer's bytes change only with the Date header, which uvicorn renews once a second.
            default_headers = self.server_state.default_headers
            kind = (keep_alive, occupancy.stopping)
            cached = refusals.get(kind)
            if cached is None or cached[0] is not default_headers:
                cached = refusals[kind] = (default_headers, http_answer(error, default_headers, keep_alive))
            self.transport.write(cached[1])
            if self.access_log:
                self.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(cycle.scope), cycle.scope["method"],
                                        get_path_with_query_string(cycle.scope), cycle.scope["http_version"],
                                        errors.answer(error)[0])
            cycle.response_started = cycle.response_complete = True
            if not keep_alive:
                self.transport.close()
            self.on_response_complete()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._awaiting_head():
                self._disarm()

        def on_response_complete(self) -> None:
            self._completing = True  # uvicorn starts the next pipelined request from here
            try:
                super().on_response_complete()
            finally:
                self._completing = False
            if self._awaiting_head():
                self._arm()

        def pause_writing(self) -> None:  # asyncio: the write buffer is over its high-water mark
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout_s, self._write_timed_out)

        def resume_writing(self) -> None:  # the client read enough for the buffer to drain below it
            self._stop_write_timer()
            super().resume_writing()

        def _stop_write_timer(self) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _write_timed_out(self) -> None:
            self._write_timer = None
            self.transport.abort()  # drops the buffered body; connection_lost wakes the waiting send

        def connection_lost(self, exc) -> None:
            self._disarm()
            self._stop_write_timer()
            super().connection_lost(exc)

    return TimeoutProtocol
