"""How routes answer: JSON serialised once and written as the client reads it, or nothing when the
client has gone."""

from __future__ import annotations

import asyncio

from fastapi import Request, Response
from pydantic_core import to_json

ANSWER_SLICE_BYTES = 65_536  # asyncio's default high-water mark for a transport's send buffer
GONE = 499  # nginx's "client closed request": nobody reads it


class SlicedResponse(Response):
    """A response whose body is written ANSWER_SLICE_BYTES at a time, each once the client has read
    enough of the last (uvicorn waits for the send buffer to drain before each write): an answer its
    client does not read keeps its request in the service, counted against the concurrency cap, and
    sits in memory once, instead of being copied whole into the send buffer and forgotten."""

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body = self.body
        for start in range(0, max(len(body), 1), ANSWER_SLICE_BYTES):
            end = start + ANSWER_SLICE_BYTES
            await send({"type": "http.response.body", "body": body[start:end], "more_body": end < len(body)})


GENERATION_HEADER = "X-Index-Generation"


def json_answer(body: dict, generation: str | None = None) -> Response:
    """`body` serialised once, in Rust: returning a model instead makes FastAPI validate every passage
    again. A NaN or infinite score becomes null, as pydantic's own serialiser wrote it. `generation`: the
    index generation that answered, as the GENERATION_HEADER (what /ready calls `generation`)."""
    headers = {GENERATION_HEADER: generation} if generation else None
    return SlicedResponse(to_json(body, inf_nan_mode="null"), media_type="application/json", headers=headers)


async def _disconnect(receive) -> None:
    """Returns once the client has gone (read after the body: the server then reports only that)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(http: Request, work):
    """`work`'s result, or None when the client disconnects first: `work` is cancelled then, so a
    request still queued for the model is dropped before it reaches it."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(http.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the route itself is cancelled (shutdown): so is its work
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None
