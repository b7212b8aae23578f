"""The API keys: who may call which routes, over which passages.

`SEARCH_API_KEY` is one key with every route and every passage. `SEARCH_API_KEYS_FILE` names a JSON file of
scoped keys, re-read on the request after its content changes:

    [{"name": "acme", "key_sha256": "<hex sha256 of the key>", "routes": ["search", "write"],
      "filter": {"tenant": "acme"}}]

Only a key's sha256 is kept, and a key sent is compared with every entry's in constant time. `routes` are
groups of routes (ROUTE_GROUPS); `filter` (the search grammar, retrieval.filters) is the key's scope: the server
ANDs it with every search's own filter, a write must fall inside it, and a passage outside it is answered as
one that does not exist (service/http/routes). A file that does not parse, names an unknown route or filters on
a field the index lacks is refused: at start (the service exits naming the entry), and on a re-read, where the
keys read before stay and /ready says why; a file that is gone lets none of its keys in (fails closed).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from retrieval.filters import FilterError, parse_filter

log = logging.getLogger("service")
RouteGroup = Literal["search", "write", "rerank", "embeddings", "admin"]
# search: /search, /search/batch and the page's searches; write: /passages (GET too); admin: /admin/reload,
# /stats, /metrics, and the index's details in /ready.
ROUTE_GROUPS: tuple[str, ...] = RouteGroup.__args__


@dataclass(frozen=True)
class Key:
    name: str
    routes: frozenset[str]
    scope: dict | None = None  # the filter every passage it reads or writes matches; None: every passage

    def allows(self, group: str) -> bool:
        return group in self.routes


SERVICE_KEY = Key("SEARCH_API_KEY", frozenset(ROUTE_GROUPS))  # the single key: every route, every passage
OPEN = Key("open", frozenset(ROUTE_GROUPS))  # no key configured: every request


class KeyEntry(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    key_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    routes: list[RouteGroup] = Field(min_length=1)
    filter: dict | None = None


class KeysFileError(ValueError):
    """A keys file that cannot be used, naming the entry and why."""


def digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode("utf-8") if isinstance(key, str) else key).digest()


def parse_keys(content: bytes, path: Path, field_types: Callable[[], Mapping[str, str]]) -> list[tuple[bytes, Key]]:
    """(sha256, key) of every entry of the keys file `path`, whose `content` was read; KeysFileError naming the
    first entry that is not usable (a filter is checked against `field_types()`, the index's fields)."""
    try:
        raw = json.loads(content.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise KeysFileError(f"{path}: {error}") from None
    if not isinstance(raw, list):
        raise KeysFileError(f"{path}: expected a JSON list of keys")
    keys, names, hashes = [], set(), set()
    for position, item in enumerate(raw):
        named = isinstance(item, dict) and "name" in item
        label = f"{path}: entry {position}" + (f" ({item['name']})" if named else "")
        try:
            entry = KeyEntry.model_validate(item)
            if entry.filter is not None:
                parse_filter(entry.filter, field_types())
        except ValidationError as error:
            problem = error.errors()[0]
            raise KeysFileError(f"{label}: {'.'.join(map(str, problem['loc'])) or 'entry'}: {problem['msg']}") from None
        except FilterError as error:
            raise KeysFileError(f"{label}: filter: {error}") from None
        if entry.name in names or entry.key_sha256 in hashes:
            raise KeysFileError(f"{label}: its name or key_sha256 is another entry's too")
        names.add(entry.name)
        hashes.add(entry.key_sha256)
        keys.append((bytes.fromhex(entry.key_sha256), Key(entry.name, frozenset(entry.routes), entry.filter)))
    return keys


class Keys:
    """The keys a request may carry (thread-safe): SERVICE_KEY where SEARCH_API_KEY is set, and the entries of
    SEARCH_API_KEYS_FILE (`field_types()`: the fields their filters are checked against), re-read by `refresh`
    when the file's content changes; `error`: why the file's keys are not what it says (a re-read refused, the
    keys before it staying; or the file gone, and none of its keys let in)."""

    def __init__(self, api_key: str | None, path: Path | None, field_types: Callable[[], Mapping[str, str]]) -> None:
        self.path, self.field_types = path, field_types
        self.service_key = [(digest(api_key), SERVICE_KEY)] if api_key is not None else []
        self.error: str | None = None
        self._lock = threading.Lock()
        self._seen: bytes | None = None  # the sha256 of the content last read
        self._refused: str | None = None  # why that content was not taken
        self._file: list[tuple[bytes, Key]] = []
        if path is not None:
            try:
                content = path.read_bytes()
            except OSError as error:
                raise KeysFileError(f"{path}: {error}") from None
            self._file, self._seen = parse_keys(content, path, field_types), digest(content)

    @property
    def required(self) -> bool:
        """Whether a request needs a key (some key is configured)."""
        return bool(self.service_key) or self.path is not None

    @property
    def scoped(self) -> bool:
        """Whether keys may be scoped (a keys file is configured)."""
        return self.path is not None

    def identify(self, credentials: str | bytes | None) -> Key | None:
        """The key `credentials` is (compared with every key, never stopping at a match), or None."""
        if not self.required:
            return OPEN
        if not credentials:
            return None
        given, found = digest(credentials), None
        for expected, key in self.service_key + self._file:
            if hmac.compare_digest(expected, given):
                found = key
        return found

    def of_header(self, authorization: str | bytes) -> Key | None:
        """The key an Authorization header carries (`Bearer KEY`, the scheme in any case), or None."""
        value = authorization.decode("latin-1") if isinstance(authorization, bytes) else authorization
        scheme, _, credentials = value.partition(" ")
        return self.identify(credentials.strip()) if scheme.lower() == "bearer" else None

    def refresh(self) -> None:
        """Re-reads the keys file where its content changed since it was last read (its sha256, not its inode,
        size or time, which a rewrite may keep). A file that does not parse leaves the keys before it; a file
        that is gone lets none of its keys in until it is back (a revocation must not fail open)."""
        if self.path is None:
            return
        with self._lock:
            try:
                content = self.path.read_bytes()
            except FileNotFoundError:
                if self._file or self._seen is not None:
                    self._file, self._seen = [], None
                    self.error = f"the keys file {self.path} is gone: none of its keys is let in until it is back"
                    log.error(self.error)
                return
            except OSError as error:  # unreadable for now (permissions, I/O): the keys before it stay
                self.error = f"the keys file was not re-read, the keys before it stay: {self.path}: {error}"
                return
            seen = digest(content)
            if seen == self._seen:
                self.error = self._refused  # an unreadable spell over
                return
            self._seen = seen
            try:
                self._file = parse_keys(content, self.path, self.field_types)
            except KeysFileError as error:
                self.error = self._refused = f"the keys file was not re-read, the keys before it stay: {error}"
                log.error(self.error)
                return
            self.error = self._refused = None
            log.info("keys file %s re-read: %d keys", self.path, len(self._file))
