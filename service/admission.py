"""Admission control: how much work the service takes on, refused early and cheaply.

A cap on search requests in the service (queued or running): past it the answer is 429 at once, with
Retry-After, as text-embeddings-inference answers past its max_concurrent_requests, instead of a
queue that only grows slower. And the two timeouts uvicorn lacks: a connection that has not sent a
whole request head within the read timeout is closed, so half-sent requests cannot hold connections
forever (the body's timeout is in `limits.BodyLimits`); one whose client stops reading its answer is
aborted after the write timeout, so unread responses cannot pin memory."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.errors import Overloaded, send_error

# The routes that run a model: the ones the cap counts.
MODEL_PATHS = frozenset({"/search", "/search/batch", "/v1/embeddings", "/rerank"})


class Occupancy:
    """Search requests in the service now, against the cap; read by /metrics."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.in_flight = 0


class Admission:
    """ASGI middleware: a search request past `occupancy.cap` gets 429 before its body is read."""

    def __init__(self, app, occupancy: Occupancy, retry_after_s: int, on_reject) -> None:
        self.app, self.occupancy, self.retry_after_s, self.on_reject = app, occupancy, retry_after_s, on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in MODEL_PATHS:
            return await self.app(scope, receive, send)
        occupancy = self.occupancy
        if occupancy.in_flight >= occupancy.cap:
            self.on_reject()
            return await send_error(send, Overloaded(
                f"overloaded: {occupancy.cap} search requests are in the service, the max_concurrent_requests "
                f"limit (SEARCH_MAX_CONCURRENT_REQUESTS); retry after {self.retry_after_s} s", self.retry_after_s))
        occupancy.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            occupancy.in_flight -= 1


def timeout_protocol(read_timeout_s: float, write_timeout_s: float,
                     base: type[HttpToolsProtocol | H11Protocol] = HttpToolsProtocol) -> type:
    """uvicorn's HTTP protocol (`base`: httptools, uvicorn's own choice where it is installed, as
    uvicorn[standard] installs it, or h11), closing a connection whose request head is not complete within
    `read_timeout_s` of the connection opening or of the previous response (idle keep-alive connections
    are closed sooner, by uvicorn's own keep-alive timeout), and aborting one whose client has read
    nothing of a response for `write_timeout_s`: the kernel's send buffer is full and asyncio's holds
    the rest of the body (a 20 MB batch answer, for one), freed only when the connection goes."""

    class TimeoutProtocol(base):
        _head_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None

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

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._awaiting_head():
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
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
