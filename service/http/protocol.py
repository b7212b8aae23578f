"""The service's HTTP protocol: uvicorn's, with the limits uvicorn lacks, enforced as bytes arrive.

- A request head over `max_head_bytes` or `max_headers` lines is answered 431 and its connection closed,
  before more of it is kept (httptools' parser has no cap: it would hold a head of any size whole).
- A connection that has not sent a whole request head within the read timeout is closed, so half-sent
  requests cannot hold connections forever (the body's timeout is in `limits.BodyLimits`); one whose
  client stops reading its answer is aborted after the write timeout, so unread answers cannot pin memory.
- A search past the admission cap (service.http.admission) is refused 429 here, as soon as its head is in,
  unless its key has none in the service (let in) or is below its fair share of the cap (it then waits for
  the next place)."""

from __future__ import annotations

import asyncio
import functools
import json
from http import HTTPStatus

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from service.errors import HeadTooLarge, ServiceError
from service.http import status
from service.http.admission import ADMITTED, Occupancy

# A request head ends at its first empty line.
HEAD_END = b"\r\n\r\n"
# Where a head over a limit is marked, in the scope of the request it would have been.
HEAD_REFUSED = "search.head_refused"


def http_answer(error: ServiceError, default_headers: list[tuple[bytes, bytes]], keep_alive: bool) -> bytes:
    """`error`'s whole HTTP/1.1 answer, as uvicorn would write it after its `default_headers` (Date, Server)."""
    code, body, headers = status.answer(error)
    payload = json.dumps(body).encode()
    lines = [*default_headers, (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
             *((name.lower().encode(), value.encode()) for name, value in headers.items()),
             *([] if keep_alive else [(b"connection", b"close")])]
    return b"".join([f"HTTP/1.1 {code} {HTTPStatus(code).phrase}\r\n".encode(),
                     *(name + b": " + value + b"\r\n" for name, value in lines), b"\r\n", payload])


def timeout_protocol(read_timeout_s: float, write_timeout_s: float, occupancy: Occupancy | None = None,
                     base: type[HttpToolsProtocol | H11Protocol] = HttpToolsProtocol, *,
                     max_head_bytes: int = 32_768, max_headers: int = 100) -> type:
    """uvicorn's HTTP protocol (`base`: httptools, uvicorn's own choice where it is installed, as
    uvicorn[standard] installs it, or h11), closing a connection whose request head is not complete within
    `read_timeout_s` of the connection opening or of the previous response (idle keep-alive connections
    are closed sooner, by uvicorn's own keep-alive timeout), and aborting one whose client has read
    nothing of a response for `write_timeout_s`: the kernel's send buffer is full and asyncio's holds
    the rest of the body (a batch answer at k = 1000 runs to megabytes), freed only when the connection goes.

    With `occupancy`, a search POST whose head arrives when the service is full, from a key holding its
    fair share of the cap or more, is answered 429 by the protocol itself, with one write and before
    any of the app runs: no task, no middleware, no route (uvicorn answers its own limit_concurrency
    503 the same way, with a stand-in app). A refusal then costs the event loop a fraction of one
    through the app, and in a wave of refusals each one waits for every refusal before it (see
    docs/benchmarks.md, bench/overload.py). A request let in is counted in at once, not when its task
    first runs, or a burst of heads would all find room; one below its key's share is queued at once
    and waits for a place in its task (`Occupancy.serve`). The app's `Admission` counts, refuses and
    queues where no protocol did (h11, whose protocol does not start requests through
    `_start_asgi_task`; an app served some other way).

    A request head of more than `max_head_bytes` (request line and headers) or `max_headers` header
    lines is answered 431 and the connection closed; the bytes of a head still arriving are counted
    before the parser keeps them, so no connection holds more than the limit and one read (256 KiB)."""

    def too_large(what: str) -> HeadTooLarge:
        return HeadTooLarge(f"request head over {what} (SEARCH_MAX_HEAD_BYTES, SEARCH_MAX_HEADERS)")

    # (keep-alive, stopping) -> (the default headers it has, the answer)
    refusals: dict[tuple[bool, bool], tuple[list, bytes]] = {}

    class TimeoutProtocol(base):
        _head_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None
        _completing = False
        _head_bytes = 0  # of the head arriving now, counted since the previous response
        _head_tail = b""  # its last bytes, where its end may begin
        _header_lines = 0  # of the request being parsed (httptools' on_header)
        _header_bytes = 0

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
            if HEAD_REFUSED in cycle.scope:
                cycle.response_started = cycle.response_complete = True  # its body, if any, is not read
                self._refuse_head(cycle.scope[HEAD_REFUSED])
            elif occupancy is None or (key := occupancy.key_of(cycle.scope)) is None:
                super()._start_asgi_task(cycle, app)
            elif self._completing:
                # A pipelined request, started from inside the previous one's last send: decided on the
                # loop's next turn, once that request has left the service (and not by recursion).
                self.loop.call_soon(self._admit, cycle, app, key)
            else:
                self._admit(cycle, app, key)

        def _admit(self, cycle, app, key: str) -> None:
            if self.transport.is_closing():
                return
            place = occupancy.enter(key)
            if place is None:
                self._refuse(cycle, key)
            else:  # in, or waiting for its key's share (service.http.admission), in a task as any request
                cycle.scope[ADMITTED] = True
                super()._start_asgi_task(cycle, functools.partial(occupancy.serve, app, place, unrouted=True))

        def _refuse(self, cycle, key: str) -> None:
            """Answers `cycle`'s request 429 (503 while stopping) whole; its body, if any, is skipped as it
            arrives (uvicorn drops the body of a request whose response is complete), and the connection stays
            open for the next."""
            error = occupancy.refuse(cycle.scope["path"], key)
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
                                        status.answer(error)[0])
            cycle.response_started = cycle.response_complete = True
            if not keep_alive:
                self.transport.close()
            self.on_response_complete()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._awaiting_head():
                end = data.find(HEAD_END)
                if end < 0:  # the empty line may straddle two reads
                    joint = (self._head_tail + data[:3]).find(HEAD_END)
                    end = joint - len(self._head_tail) if joint >= 0 else -1
                head = self._head_bytes + (len(data) if end < 0 else end + len(HEAD_END))
                if head > max_head_bytes:
                    return self._refuse_head(too_large(f"the max_head_bytes limit of {max_head_bytes} bytes"))
                self._head_bytes, self._head_tail = (head, data[-3:]) if end < 0 else (0, b"")
            super().data_received(data)
            if not self._awaiting_head():
                self._disarm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._header_lines = self._header_bytes = 0

        def on_header(self, name: bytes, value: bytes) -> None:  # httptools: one whole header line
            self._header_lines += 1
            self._header_bytes += len(name) + len(value) + 4
            if self._header_lines <= max_headers:  # past it, not kept: the request is refused at its end
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            # A pipelined head, fed while the previous request ran, was not counted in `data_received`.
            if self._header_lines > max_headers:
                self.scope[HEAD_REFUSED] = too_large(f"the max_headers limit of {max_headers} header lines")
            elif self._header_bytes > max_head_bytes:
                self.scope[HEAD_REFUSED] = too_large(f"the max_head_bytes limit of {max_head_bytes} bytes")
            super().on_headers_complete()

        def _refuse_head(self, error: HeadTooLarge) -> None:
            """Answers 431 and closes the connection, with nothing more of the request read."""
            self.transport.write(http_answer(error, self.server_state.default_headers, keep_alive=False))
            self.transport.close()
            if occupancy is not None:
                occupancy.monitor.observe_request("unmatched", status.answer(error)[0])

        def on_response_complete(self) -> None:
            self._completing = True  # uvicorn starts the next pipelined request from here
            try:
                super().on_response_complete()
            finally:
                self._completing = False
            if self._awaiting_head():
                self._head_bytes, self._head_tail = 0, b""
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
