"""Who may call a route (the API key) and the error answers the spec lists for it."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.errors import Unauthorized
from service.settings import ServiceSettings


@dataclass(frozen=True)
class Access:
    """`protected`: the dependencies of a route that needs the key (none without one, so the spec then
    declares no security scheme); `responses`: a route's error answers, for the spec."""

    settings: ServiceSettings
    protected: list

    @classmethod
    def for_settings(cls, settings: ServiceSettings) -> "Access":
        if settings.api_key is None:
            return cls(settings, [])
        bearer = HTTPBearer(auto_error=False, description="the SEARCH_API_KEY value")
        expected = settings.api_key.get_secret_value().encode()

        def require_key(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
            given = credentials.credentials.encode() if credentials is not None else b""
            if not hmac.compare_digest(given, expected):
                raise Unauthorized("missing or wrong API key")

        return cls(settings, [Depends(require_key)])

    def responses(self, errors: dict[int, str] | None = None, search: bool = False) -> dict:
        """The error answers a route may give, for the spec (422 FastAPI adds itself)."""
        described = {503: "the index is loading, or failed to load", **(errors or {})}
        if self.settings.api_key is not None:
            described[401] = "missing or wrong API key"
        if search:
            described[408] = "the request body stopped arriving (SEARCH_READ_TIMEOUT_S)"
            described[429] = "overloaded: retry after the Retry-After header's seconds (SEARCH_MAX_CONCURRENT_REQUESTS)"
        return {status: {"description": text} for status, text in sorted(described.items())}
