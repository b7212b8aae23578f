"""Errors mapped to HTTP status codes, in one place."""

from __future__ import annotations

import math

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


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


async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    """422 in FastAPI's own shape, `{"detail": [{"loc", "msg", "type", "input"}]}`, whatever the input held."""
    return JSONResponse(status_code=422, content={"detail": _json_safe(jsonable_encoder(error.errors()))})


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, validation_error)
