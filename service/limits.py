"""Limits that are settings, refused with 422 in FastAPI's validation-error shape, each message
naming the field, the limit and the environment variable that sets it."""

from __future__ import annotations

import json

from fastapi.exceptions import RequestValidationError

from service.settings import ServiceSettings


def refuse(field: tuple, message: str, value=None) -> RequestValidationError:
    return RequestValidationError([{"type": "limit", "loc": ("body", *field), "msg": message, "input": value}])


def unencodable(text: str) -> str | None:
    """Why `text` cannot be encoded as UTF-8 (JSON allows lone surrogates such as "\\ud800"), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"is not valid Unicode text: a lone surrogate at character {error.start}"
    return None


def check_query(settings: ServiceSettings, query: str, field: tuple = ("query",)) -> None:
    if not query.strip():
        raise refuse(field, "query must not be empty or only whitespace", query)
    reason = unencodable(query)
    if reason:
        raise refuse(field, f"query {reason}")
    if len(query) > settings.max_query_chars:
        raise refuse(
            field,
            f"query is {len(query)} characters, over the max_query_chars limit of {settings.max_query_chars} "
            "(SEARCH_MAX_QUERY_CHARS)",
        )


def check_tokens(limit: int, tokens: int, field: tuple = ("query",)) -> None:
    """With `truncate: false`: a query longer than the index's query token limit is refused."""
    if tokens > limit:
        raise refuse(
            field,
            f"query is {tokens} tokens, over the query token limit of {limit} (the index's query_max_tokens, "
            "or SEARCH_QUERY_MAX_TOKENS); send truncate: true to cut it",
        )


def check_k(settings: ServiceSettings, k: int) -> None:
    if k > settings.max_k:
        raise refuse(("k",), f"k={k} is over the max_k limit of {settings.max_k} (SEARCH_MAX_K)", k)


def check_batch(settings: ServiceSettings, queries: list[str]) -> None:
    if len(queries) > settings.max_batch_queries:
        raise refuse(
            ("queries",),
            f"{len(queries)} queries, over the max_batch_queries limit of {settings.max_batch_queries} "
            "(SEARCH_MAX_BATCH_QUERIES)",
        )
    for position, query in enumerate(queries):
        check_query(settings, query, ("queries", position))


class _TooLarge(BaseException):
    """Raised from `receive` past the limit. Not an Exception: FastAPI turns any Exception met while it
    reads a body into 400 "error parsing the body", and the limit's answer is a 422."""


class BodySizeLimit:
    """ASGI middleware: a body over `max_bytes` (declared or streamed) gets 422 before any parsing."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        received = 0
        started = False

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
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
                await self._refuse(send)

    async def _refuse(self, send) -> None:
        body = json.dumps({"detail": [{
            "type": "limit", "loc": ["body"], "input": None,
            "msg": f"request body is over the max_body_bytes limit of {self.max_bytes} bytes (SEARCH_MAX_BODY_BYTES)",
        }]}).encode()
        await send({"type": "http.response.start", "status": 422,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
