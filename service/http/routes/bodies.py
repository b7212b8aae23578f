"""Request bodies parsed as JSON off the event loop where they are large: a flood of big bodies (a filter of
thousands of clauses, a batch of long texts) then costs worker threads their parsing, not every other
request the loop serves meanwhile (/health included)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from fastapi import Request
from fastapi.routing import APIRoute

ON_LOOP_BYTES = 65_536  # smaller bodies parse faster than a hop to a thread


class JsonOffLoopRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = json.loads(body) if len(body) < ON_LOOP_BYTES else await asyncio.to_thread(json.loads, body)
        return self._json


class JsonOffLoopRoute(APIRoute):
    """A route whose request's JSON body is a JsonOffLoopRequest's."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def handle(request: Request):
            return await handler(JsonOffLoopRequest(request.scope, request.receive))

        return handle
