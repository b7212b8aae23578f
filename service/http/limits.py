"""Limits that are settings, checked at the edge: each refusal an OverLimit (422) naming the field,
the limit and the environment variable that sets it."""

from __future__ import annotations

import asyncio

from service.errors import OverLimit, TimedOut
from service.http.status import send_error
from service.settings import ServiceSettings


def unencodable(text: str) -> str | None:
    """Why `text` cannot be encoded as UTF-8 (JSON allows lone surrogates such as "\\ud800"), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"is not valid Unicode text: a lone surrogate at character {error.start}"
    return None


def check_query(settings: ServiceSettings, query: str, field: tuple = ("query",)) -> None:
    """A text to encode: a query of /search, or an input of /v1/embeddings (the message names which)."""
    noun = "query" if field[0] in ("query", "queries") else "text"
    if not query.strip():
        raise OverLimit(field, f"{noun} must not be empty or only whitespace", query)
    reason = unencodable(query)
    if reason:
        raise OverLimit(field, f"{noun} {reason}")
    if len(query) > settings.max_query_chars:
        raise OverLimit(
            field,
            f"{noun} is {len(query)} characters, over the max_query_chars limit of {settings.max_query_chars} "
            "(SEARCH_MAX_QUERY_CHARS)",
        )


def check_batch_tokens(settings: ServiceSettings, tokens: int, field: str = "queries") -> None:
    if tokens > settings.max_batch_tokens:
        raise OverLimit((field,), f"the {field} are {tokens} tokens in all, over the max_batch_tokens limit of "
                                  f"{settings.max_batch_tokens} (SEARCH_MAX_BATCH_TOKENS): send fewer at a time")


def check_rerank_tokens(settings: ServiceSettings, tokens: int, field: str) -> None:
    if tokens > settings.max_rerank_tokens:
        raise OverLimit((field,), f"the query and {field} make {tokens} tokens for the reranker in all, over the "
                                  f"max_rerank_tokens limit of {settings.max_rerank_tokens} (SEARCH_MAX_RERANK_TOKENS): "
                                  "send fewer or shorter texts at a time")


def check_k(settings: ServiceSettings, k: int) -> None:
    if k > settings.max_k:
        raise OverLimit(("k",), f"k={k} is over the max_k limit of {settings.max_k} (SEARCH_MAX_K)", k)


def check_batch(settings: ServiceSettings, queries: list[str], field: str = "queries") -> None:
    if len(queries) > settings.max_batch_queries:
        raise OverLimit(
            (field,),
            f"{len(queries)} {field}, over the max_batch_queries limit of {settings.max_batch_queries} "
            "(SEARCH_MAX_BATCH_QUERIES)",
        )
    for position, query in enumerate(queries):
        check_query(settings, query, (field, position))


def check_documents(settings: ServiceSettings, documents: list[str], field: str) -> None:
    """Passages sent to be reranked: at most max_rerank_depth of them, each valid Unicode text of at most
    max_query_chars characters (an abuse guard: the reranker cuts them at its token limit)."""
    if len(documents) > settings.max_rerank_depth:
        raise OverLimit((field,), f"{len(documents)} {field}, over the max_rerank_depth limit of "
                                  f"{settings.max_rerank_depth} (SEARCH_MAX_RERANK_DEPTH)")
    for position, text in enumerate(documents):
        reason = unencodable(text)
        if reason:
            raise OverLimit((field, position), f"the text {reason}")
        if len(text) > settings.max_query_chars:
            raise OverLimit((field, position), f"the text is {len(text)} characters, over the max_query_chars limit "
                                               f"of {settings.max_query_chars} (SEARCH_MAX_QUERY_CHARS)")


class _TooLarge(BaseException):
    """Raised from `receive` past the limit. Not an Exception: FastAPI turns any Exception met while it
    reads a body into 400 "error parsing the body", and the limit's answer is a 422."""


class _TooSlow(BaseException):
    """Raised from `receive` when the body stops arriving (see _TooLarge for why not an Exception)."""


class BodyLimits:
    """ASGI middleware: a body over `max_bytes` (declared or streamed) gets 422 before any parsing; a
    body whose next part takes more than `timeout_s` to arrive gets 408, so a half-sent request does
    not hold the service forever. Reading for a disconnect after the body is not timed."""

    def __init__(self, app, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await send_error(send, self._too_large())
        received = 0
        body_done = False
        started = False

        async def counted_receive():
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                raise _TooSlow from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_bytes:
                    raise _TooLarge
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _TooLarge:
            if not started:
                await send_error(send, self._too_large())
        except _TooSlow:
            if not started:
                await send_error(send, TimedOut(
                    f"request body not received: no part of it arrived within {self.timeout_s:g} s, the "
                    "read_timeout_s limit (SEARCH_READ_TIMEOUT_S)"))

    def _too_large(self) -> OverLimit:
        return OverLimit((), f"request body is over the max_body_bytes limit of {self.max_bytes} bytes "
                             "(SEARCH_MAX_BODY_BYTES)")
