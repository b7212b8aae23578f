"""Each domain error's HTTP answer (service.errors), in one place: its status code and body, for routes
(through exception handlers) and for ASGI middleware, which answers before any route or handler runs
(`send_error`)."""

from __future__ import annotations

import json
import math

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from service.errors import (Ambiguous, Forbidden, HeadTooLarge, NotFound, NotReady, NotServable, Overloaded, OverLimit,
                            ServiceError, ShardsUnavailable, Stopping, TimedOut, Unauthorized, WritesUnavailable)


def _json_safe(value):
    """`value` with every non-finite float written as a string: JSON has no NaN or Infinity, and a
    request may send them (Python's JSON reader accepts NaN, Infinity and 1e309)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def answer(error: ServiceError) -> tuple[int, dict, dict[str, str]]:
    """Status code, JSON body and headers for `error`."""
    if isinstance(error, OverLimit):
        problem = {"type": "limit", "loc": ["body", *error.field], "msg": str(error), "input": error.value}
        return 422, {"detail": _json_safe(jsonable_encoder([problem]))}, {}
    if isinstance(error, Overloaded):  # Stopping too, 503
        status = 503 if isinstance(error, Stopping) else 429
        return status, {"detail": str(error)}, {"Retry-After": str(error.retry_after_s)}
    if isinstance(error, WritesUnavailable):  # 507 Insufficient Storage: RFC 4918, section 11.5
        retry = {} if error.retry_after_s is None else {"Retry-After": str(error.retry_after_s)}
        return 507 if error.storage_full else 503, {"detail": str(error)}, retry
    if isinstance(error, Unauthorized):
        return 401, {"detail": str(error)}, {"WWW-Authenticate": "Bearer"}
    status = {NotServable: 400, Ambiguous: 400, Forbidden: 403, NotFound: 404, TimedOut: 408, HeadTooLarge: 431,
              NotReady: 503, ShardsUnavailable: 503}[type(error)]
    return status, {"detail": str(error)}, {}


async def send_error(send, error: ServiceError) -> None:
    """`error`'s whole answer from ASGI middleware."""
    status, body, headers = answer(error)
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
        *((name.lower().encode(), value.encode()) for name, value in headers.items())]})
    await send({"type": "http.response.body", "body": payload})


async def service_error(request: Request, error: ServiceError) -> JSONResponse:
    status, body, headers = answer(error)
    return JSONResponse(status_code=status, content=body, headers=headers)


async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    """422 in FastAPI's own shape, `{"detail": [{"loc", "msg", "type", "input"}]}`, whatever the input held."""
    return JSONResponse(status_code=422, content={"detail": _json_safe(jsonable_encoder(error.errors()))})


async def unparsable_body(request: Request, error: HTTPException) -> JSONResponse:
    """FastAPI's 400 for a body its JSON reader gave up on: a 422 naming the body where the reason is nesting
    past the reader's recursion limit (a body that is not JSON is FastAPI's own 422 already)."""
    if error.status_code == 400 and isinstance(error.__cause__, RecursionError):
        problem = {"type": "json_invalid", "loc": ["body"], "input": None,
                   "msg": "JSON nested too deeply for the parser (arrays and objects within each other)"}
        return JSONResponse(status_code=422, content={"detail": [problem]})
    return await http_exception_handler(request, error)


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(ServiceError, service_error)
    app.add_exception_handler(HTTPException, unparsable_body)
