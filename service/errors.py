"""The service's errors: what the engine, the limits and the middleware refuse, each with the status its
class names in words; only service/http/status.py knows the codes and bodies."""

from __future__ import annotations


class ServiceError(Exception):
    """A request the service refuses; `str(error)` is the message its client reads."""


class NotServable(ServiceError, ValueError):
    """What this service or its index cannot do (no reranker configured, a mode the index lacks): 400."""


class OverLimit(ServiceError, ValueError):
    """A value past a limit, or not usable: 422 naming the field, in FastAPI's validation shape."""

    def __init__(self, field: tuple, message: str, value=None) -> None:
        super().__init__(message)
        self.field, self.value = field, value


class Ambiguous(ServiceError):
    """A request that says one thing twice and could be read two ways (two Authorization headers): 400."""


class NotFound(ServiceError):
    """A name that names nothing here (an index folder to reload): 404."""


class Unauthorized(ServiceError):
    """A missing or wrong API key: 401."""


class Forbidden(ServiceError):
    """A key that may not call the route: 403."""


class TimedOut(ServiceError):
    """The request stopped arriving: 408."""


class HeadTooLarge(ServiceError):
    """A request head over its byte or header-count limit: 431, and the connection closed."""


class Overloaded(ServiceError):
    """The service is at its concurrency cap: 429 with Retry-After."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Stopping(Overloaded):
    """The service is stopping and takes no new search: 503 with Retry-After, for another replica."""


class NotReady(ServiceError):
    """No index loaded yet, or loading failed: 503."""


class WritesUnavailable(ServiceError):
    """A write the log could not take, nothing of it kept: 507 where the disk holding the log is full
    (`storage_full`), 503 otherwise, with Retry-After where a retry may succeed (`retry_after_s`; None where
    only a restart of the writer helps)."""

    def __init__(self, message: str, storage_full: bool, retry_after_s: int | None) -> None:
        super().__init__(message)
        self.storage_full, self.retry_after_s = storage_full, retry_after_s


class ShardsUnavailable(ServiceError):
    """Sharded serving: a shard did not answer, and the request did not allow a partial answer: 503.
    It is the same for every request of a batch, so a micro-batch fails as a whole (see the batcher)."""
