"""Writes to an index without a build: upserts and deletes, logged before they are acknowledged
(retrieval.write_log) and searched at once (retrieval.segment), by the one writer of the index.

    writes = Writes.open(Searcher("indexes/demo"))
    writes.upsert([{"id": "p9", "text": "...", "year": 2024}])     # -> the write's sequence number
    writes.delete(ids=["p1"]); writes.delete(filter={"year": {"lt": 2000}})
    writes.searcher.search("...")                                   # sees every write acknowledged
    writes.get("p9")

A passage is a JSONL record of a corpus (`id`, `text`, optional `title`, metadata fields: retrieval.corpus), and
a batch is checked whole before anything is written (WriteError names the item and the field); a batch that
is written is written whole. `open` replays the log's writes the generation does not hold.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import ExitStack
from typing import Callable, Mapping, Sequence

import numpy as np

from retrieval import out_lock
from retrieval.corpus import DEFAULT_MAX_PASSAGE_BYTES, BadLine, parse_record
from retrieval.fields import MAX_FIELDS, MAX_SCOPE_FIELDS, FieldColumns, value_type
from retrieval.filters import Filter, conjunction, evaluate, parse_filter
from retrieval.scopes import scope_fields
from retrieval.searcher import Searcher
from retrieval.segment import Passage
from retrieval.write_log import Record, WriteLog

MAX_ID_CHARS = 512  # a passage id's length at most, in characters


class WriteError(ValueError):
    """A write refused: `path` names where (("passages", 3, "year"), ("ids",), ...)."""

    def __init__(self, path: tuple, message: str) -> None:
        super().__init__(message)
        self.path = path


class Writes:
    """The writes to one served generation: `searcher` is the generation with every acknowledged write, and is
    replaced (never changed) by each write, so a search keeps the one it started with; `publish` is given each
    such searcher, in write order, before the write returns. Thread-safe."""

    def __init__(self, searcher: Searcher, log: WriteLog, publish: Callable[[Searcher], None] | None = None,
                 held: ExitStack | None = None, max_scope_fields: int = MAX_SCOPE_FIELDS) -> None:
        self.max_scope_fields = max_scope_fields  # the fields one scope's passages may hold (refuse_fields)
        self.log, self.publish, self._folder_lock = log, None, held  # published once replayed
        self._lock = threading.Lock()
        self.searcher = searcher.writable()
        self.segment_since: float | None = None  # when the segment's first write was applied (monotonic)
        self._replay([record for record in log.records if record.seq > searcher.manifest.write_sequence])
        self.publish = publish
        if publish is not None:
            publish(self.searcher)

    @classmethod
    def open(cls, searcher: Searcher, publish: Callable[[Searcher], None] | None = None,
             max_scope_fields: int = MAX_SCOPE_FIELDS) -> "Writes":
        """The writes to `searcher`'s index: the folder's writer lock taken (retrieval.out_lock: out_lock.InUse while
        a build, update or other writer holds it), its log opened (created where there is none; a torn last record
        dropped), and the writes the generation does not hold replayed."""
        held = ExitStack()
        held.enter_context(out_lock.hold(searcher.index_dir, "writer"))
        try:
            return cls(searcher, WriteLog.open(searcher.index_dir), publish, held, max_scope_fields)
        except BaseException:
            held.close()
            raise

    @property
    def seq(self) -> int:
        """The last write applied; 0 for none."""
        return self.searcher.segment.seq

    def check_upsert(self, items: Sequence[Mapping], max_bytes: int = DEFAULT_MAX_PASSAGE_BYTES,
                     scope: dict | None = None) -> list[Passage]:
        """`items` (JSON objects) as passages; WriteError naming the first item and field that cannot be one: not
        a passage (an id that is not a non-empty string or over MAX_ID_CHARS, an empty text), over `max_bytes` as a
        JSON line, an id twice, a field that cannot join the collection (`refuse_fields`), or outside `scope` (a
        filter every passage written must match; the fields it fixes by equality at its top level are set where a
        passage lacks them)."""
        implied = fixed_fields(scope, self.searcher.field_types) if scope is not None else {}
        passages, seen = [], {}
        for i, item in enumerate(items):
            where = ("passages", i)
            if not isinstance(item, Mapping):
                raise WriteError(where, "expected a JSON object")
            item = {**implied, **item}
            size = len(json.dumps(item, ensure_ascii=False).encode("utf-8", "surrogatepass"))
            if size > max_bytes:
                raise WriteError(where, f"{size} bytes as JSON, over the limit of {max_bytes} bytes a passage may have")
            _refuse_loose_types(where, item)
            parsed = parse_record(dict(item), i)
            if isinstance(parsed, BadLine):
                raise WriteError(where + (_field_named(parsed.reason),), parsed.reason)
            if len(parsed.id) > MAX_ID_CHARS:
                raise WriteError(where + ("id",),
                                 f"id of {len(parsed.id)} characters, over the limit of {MAX_ID_CHARS}")
            if parsed.id in seen:
                raise WriteError(where + ("id",), f"id {parsed.id!r} is also item {seen[parsed.id]} of this batch")
            seen[parsed.id] = i
            passages.append(Passage(parsed.id, parsed.text, dict(parsed.fields or {})))
        self.refuse_fields(passages, scope)
        if scope is not None:
            outside = np.flatnonzero(~self._matches(self.searcher.parse_filter(scope), [p.fields for p in passages]))
            if len(outside):
                raise WriteError(("passages", int(outside[0])), "this passage's fields are outside the key's scope "
                                 f"{json.dumps(scope)}")
        return passages

    def upsert(self, items: Sequence[Mapping] | Sequence[Passage], vectors: np.ndarray | None = None,
               scope: dict | None = None) -> int:
        """Writes a batch of passages (JSON objects, checked by `check_upsert`; or passages it made), each
        replacing the passage of its id where the collection holds one; `vectors`: theirs, encoded by the index's
        encoder as passages (encoded here where None). With a `scope`, a passage held outside it is not replaced:
        WriteError naming the id. Returns the write's sequence number once it is logged."""
        if all(isinstance(item, Passage) for item in items):
            passages = list(items)
        else:
            passages = self.check_upsert(items, scope=scope)
        if vectors is None:
            vectors = self.searcher.encoder.encode_passages([passage.text for passage in passages])
        with self._lock:
            if scope is not None:
                taken = self._held([p.id for p in passages], self.searcher.parse_filter(scope), inside=False)
                if taken:
                    position = next(i for i, p in enumerate(passages) if p.id == taken[0])
                    raise WriteError(("passages", position, "id"), f"id {taken[0]!r} is taken by a passage this key "
                                     "may not write (ids are the collection's: give each scope its own)")
            self.refuse_fields(passages, scope)  # a batch written since the check may have typed a field first
            record = Record(self.seq + 1, upsert=tuple(vars(p) for p in passages), vectors=vectors)
            self._commit(record)
            return record.seq

    def delete(self, ids: Sequence[str] | None = None, filter: Filter | dict | None = None,
               scope: dict | None = None) -> tuple[int, int]:
        """Deletes the passages of `ids`, or those `filter` matches (the search filter grammar; resolved to ids when
        it is applied, and logged as those), among those `scope` matches (None: all; a passage outside it is
        answered as one the collection does not hold). Returns (sequence number, passages deleted); a delete that
        deletes nothing is not logged, and its sequence number is the last write's."""
        if (ids is None) == (filter is None):
            raise WriteError((), "give ids or a filter (one of them)")
        with self._lock:
            searcher = self.searcher
            bound = None if scope is None else searcher.parse_filter(scope)
            if filter is not None:  # checked against the fields the scope sees, so a refusal names none outside it
                seen = searcher.field_types if bound is None else scope_fields(searcher, bound)
                ids = self._matching(searcher, conjunction(bound, parse_filter(filter, seen)))
            held = self._held(list(dict.fromkeys(ids)), bound, inside=True)
            if not held:
                return self.seq, 0
            record = Record(self.seq + 1, delete=tuple(held))
            self._commit(record)
            return record.seq, len(held)

    def rebase(self, searcher: Searcher) -> None:
        """Serves `searcher`, a new generation of the index holding the writes up to its manifest's write_sequence
        (retrieval.compaction), with the later ones replayed beside it; the log drops the ones it holds."""
        searcher = searcher.writable()
        with self._lock:
            folded = searcher.manifest.write_sequence
            self.searcher = searcher
            self.segment_since = None
            later = [record for record in self.log.records if record.seq > folded]
            self._replay(later)
            if not later and self.publish is not None:
                self.publish(self.searcher)
            self.log.drop_through(folded)

    def get(self, pid: str, scope: dict | None = None):
        """The passage `pid` with its fields (retrieval.searcher.HitWithFields), or None (also for one outside
        `scope`)."""
        searcher = self.searcher
        found = searcher.passage(pid)
        if found is None or scope is None or self._matches(searcher.parse_filter(scope), [found.fields])[0]:
            return found
        return None

    def _held(self, ids: list[str], scope: Filter | None, inside: bool) -> list[str]:
        """Those of `ids` the collection holds, inside `scope` (None: all) or, with `inside` false, outside it."""
        if scope is None:
            return list(self.searcher.live_rows(ids)) if inside else []
        found = self.searcher.passages_with_fields(ids)
        matched = self._matches(scope, [hit.fields for hit in found])
        return [hit.id for hit, match in zip(found, matched) if match == inside]

    def refuse_fields(self, passages: Sequence[Passage], scope: dict | None) -> None:
        """WriteError naming the first passage and field that cannot join the collection: a field of
        another type than its name has there, or one field too many. Fields are counted over the live passages
        that hold them (a delete frees a field at once): for a write without `scope`, the collection's, at most
        the index's --max-fields (MAX_FIELDS at least); for a scoped one, those inside the scope, at most
        `max_scope_fields`, whatever other scopes hold, and its refusals name nothing outside the scope."""
        searcher = self.searcher
        bound = None if scope is None else searcher.parse_filter(scope)
        held, types = dict(scope_fields(searcher, bound)), searcher.field_types
        if bound is None:
            cap = max(MAX_FIELDS, len(searcher.manifest.fields))
            over = "of the collection, over the {cap} an index may declare (raise it with --max-fields)"
        else:
            cap = self.max_scope_fields
            over = "of the passages this key may write, over the {cap} one key's passages may hold " \
                   "(SEARCH_MAX_SCOPE_FIELDS)"
        for position, passage in enumerate(passages):
            for name, value in passage.fields.items():
                kind, where = value_type(value), ("passages", position, name)
                known = held.get(name, types.get(name))
                if known is None:
                    held[name] = kind
                    if len(held) > cap:
                        raise WriteError(where, f'field "{name}" would be field {len(held)} ' + over.format(cap=cap))
                elif known != kind:
                    if bound is not None and name not in held:  # another scope's field: neither it nor its type named
                        raise WriteError(where, f'field "{name}" cannot be a {kind}: the collection holds the name '
                                                "with another type (a field has one type across the collection); "
                                                "choose another name")
                    raise WriteError(where, f'field "{name}" is a {kind} here but a {known} in the collection (a field '
                                            "has one type across the collection)")
                else:
                    held.setdefault(name, kind)

    def _matches(self, scope: Filter, fields: list[dict]) -> np.ndarray:
        columns = FieldColumns.of_rows(len(fields), self.searcher.field_types, enumerate(fields))
        return evaluate(scope, columns)

    def _matching(self, searcher: Searcher, filter: Filter) -> list[str]:
        segment = searcher.segment
        restriction = searcher.generation_rows(filter)
        rows = np.flatnonzero(restriction.mask) if restriction is not None else np.arange(segment.base_count)
        return searcher.passages.ids(rows.tolist()) + [segment.passages[i].id
                                                       for i in np.flatnonzero(segment.matching(filter))]

    def _commit(self, record: Record) -> None:
        """`record` logged and applied: the next searcher made first, so a write that fails is neither logged nor
        applied, and one logged is applied."""
        searcher = self._after(record)
        self.log.append(record)
        self._serve(searcher)

    def _replay(self, records: list[Record]) -> None:
        """The log's `records` (written before, not yet in the generation) applied, in one pass."""
        if records:
            self._serve(self.searcher.with_writes(records))

    def _after(self, record: Record) -> Searcher:
        """The searcher with `record` applied."""
        return self.searcher.with_writes([record])

    def _serve(self, searcher: Searcher) -> None:
        if self.segment_since is None:
            self.segment_since = time.monotonic()
        self.searcher = searcher
        if self.publish is not None:
            self.publish(searcher)

    def close(self) -> None:
        self.log.close()
        if self._folder_lock is not None:
            self._folder_lock.close()


JSON_NAMES = {str: "a string", int: "a number", float: "a number", bool: "a boolean", list: "a list",
              dict: "an object", type(None): "null"}


def _refuse_loose_types(where: tuple, item: Mapping) -> None:
    """WriteError naming the key where an item's id, text or title is not a JSON string (a corpus line's number id
    is read as its digits; a write's is refused, so that what is stored is what was sent)."""
    named = "id" if "id" in item else "_id" if "_id" in item else None
    if named is None:
        raise WriteError(where + ("id",), 'missing "id": every passage needs a string id')
    for key in (named, "text", "title"):
        value = item.get(key, "")
        if not isinstance(value, str) and not (key == "title" and value is None):
            raise WriteError(where + (key,), f"{key} must be a string, not {JSON_NAMES.get(type(value), 'that')}")
    if not item[named].strip():
        raise WriteError(where + (named,), f"{named} is empty: every passage needs a string id")


def fixed_fields(scope: dict, types: Mapping[str, str]) -> dict:
    """The field values `scope` (a filter) fixes by equality at its top level: {"tenant": "acme"} and
    {"tenant": {"$eq": "acme"}} fix tenant (a list field's equality means "contains", and fixes nothing)."""
    fixed = {}
    for name, value in scope.items():
        if name.startswith("$") or types.get(name) in (None, "string[]"):
            continue
        if isinstance(value, dict):
            if set(value) != {"$eq"}:
                continue
            value = value["$eq"]
        fixed[name] = value
    return fixed


def _field_named(reason: str) -> str:
    """The field a corpus reader's reason names: a metadata field's name, "id" or "text"."""
    if reason.startswith('field "'):
        return reason.split('"')[1]
    return "text" if "text" in reason and not reason.startswith(("id ", "missing")) else "id"
