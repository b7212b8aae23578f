"""Admission control: how much work the service takes on, refused early and cheaply.

A cap on search requests in the service (queued or running): past it the answer is 429 at once, with
Retry-After, as text-embeddings-inference answers past its max_concurrent_requests, instead of a
queue that only grows slower. And a header read timeout, which uvicorn lacks: a connection that has
not sent a whole request head within the timeout is closed, so half-sent requests cannot hold
connections forever (the body's timeout is in `limits.BodyLimits`)."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

from service.errors import Overloaded, send_error

SEARCH_PATHS = frozenset({"/search", "/search/batch"})


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
        if scope["type"] != "http" or scope["path"] not in SEARCH_PATHS:
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


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request head is not complete within
    `timeout_s` of the connection opening or of the previous response (idle keep-alive connections
    are closed sooner, by uvicorn's own keep-alive timeout)."""

    class HeaderTimeoutProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(timeout_s, self._head_timed_out)

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

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
