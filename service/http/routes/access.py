"""Who may call a route (the API keys: service/http/keys.py), the key a request carries, and the error answers
the spec lists for a route."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.engine.monitoring import Monitor
from service.engine.tracing import Tracing
from service.errors import Ambiguous, Forbidden, Unauthorized
from service.http.keys import OPEN, Key, Keys
from service.settings import ServiceSettings


@dataclass(frozen=True)
class Access:
    """`guard(group)`: the dependencies of a route of that group (none where no key is configured, so the spec
    then declares no security scheme); `responses`: a route's error answers, for the spec."""

    settings: ServiceSettings
    keys: Keys
    monitor: Monitor
    tracing: Tracing

    def guard(self, group: str | None) -> list:
        """The key check of a route of `group` (None: any key will do): 401 without a known key, 403 for a key
        whose routes do not include the group; the key is then the request's (`key_of`)."""
        if not self.keys.required:
            return []
        bearer = HTTPBearer(auto_error=False, description="an API key (SEARCH_API_KEY, or one of SEARCH_API_KEYS_FILE)")
        keys, monitor, tracing = self.keys, self.monitor, self.tracing

        def require_key(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
            if len(request.headers.getlist("authorization")) > 1:  # one proxy may read the first, another the last
                monitor.observe_key("unknown", "refused")
                raise Ambiguous("two Authorization headers: send one")
            keys.refresh()
            key = keys.identify(credentials.credentials if credentials is not None else None)
            if key is None:
                monitor.observe_key("unknown", "refused")
                raise Unauthorized("missing or wrong API key")
            tracing.annotate({"search.key": key.name})
            request.state.key = key  # named in the audit log, refused or not
            if group is not None and not key.allows(group):
                monitor.observe_key(key.name, "refused")
                raise Forbidden(f"the key {key.name!r} may not call {group} routes (it may call: "
                                f"{', '.join(sorted(key.routes))})")
            monitor.observe_key(key.name, "allowed")

        return [Depends(require_key)]

    def responses(self, errors: dict[int, str] | None = None, search: bool = False) -> dict:
        """The error answers a route may give, for the spec (422 FastAPI adds itself)."""
        described = {503: "the index is loading, or failed to load", **(errors or {})}
        if self.keys.required:
            described[401] = "missing or wrong API key"
        if self.keys.scoped:
            described[403] = "the key may not call this route"
        if search:
            described[408] = "the request body stopped arriving (SEARCH_READ_TIMEOUT_S)"
            described[429] = "overloaded: retry after the Retry-After header's seconds (SEARCH_MAX_CONCURRENT_REQUESTS)"
        return {status: {"description": text} for status, text in sorted(described.items())}


def key_of(request: Request) -> Key:
    """The key the request was let in with (OPEN where no key is configured)."""
    return getattr(request.state, "key", OPEN)
