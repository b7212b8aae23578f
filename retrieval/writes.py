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
from retrieval.fields import MAX_FIELDS, FieldColumns, FieldTypes
from retrieval.filters import Filter, conjunction, evaluate
from retrieval.searcher import Searcher
from retrieval.segment import Passage, Segment
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
                 held: ExitStack | None = None) -> None:
        self.log, self.publish, self._folder_lock = log, None, held  # published once replayed
        self._lock = threading.Lock()
        segment = Segment(searcher.manifest.count, searcher.manifest.write_sequence)
        self.searcher = searcher.with_segment(segment)
        self.segment_since: float | None = None  # when the segment's first write was applied (monotonic)
        for record in log.records:
            if record.seq > searcher.manifest.write_sequence:
                self._apply(record)
        self.publish = publish
        if publish is not None:
            publish(self.searcher)

    @classmethod
    def open(cls, searcher: Searcher, publish: Callable[[Searcher], None] | None = None) -> "Writes":
        """The writes to `searcher`'s index: the folder's writer lock taken (retrieval.out_lock: out_lock.InUse while
        a build, update or other writer holds it), its log opened (created where there is none; a torn last record
        dropped), and the writes the generation does not hold replayed."""
        held = ExitStack()
        held.enter_context(out_lock.hold(searcher.index_dir, "writer"))
        try:
            return cls(searcher, WriteLog.open(searcher.index_dir), publish, held)
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
        a passage (an empty text, an id missing or over MAX_ID_CHARS), over `max_bytes` as a JSON line, an id twice,
        a field whose type differs from the collection's, or outside `scope` (a filter every passage written must
        match; the fields it fixes by equality at its top level are set where a passage lacks them)."""
        types = self._field_types()
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
            parsed = parse_record(dict(item), i)
            if isinstance(parsed, BadLine):
                raise WriteError(where + (_field_named(parsed.reason),), parsed.reason)
            if len(parsed.id) > MAX_ID_CHARS:
                raise WriteError(where + ("id",),
                                 f"id of {len(parsed.id)} characters, over the limit of {MAX_ID_CHARS}")
            if parsed.id in seen:
                raise WriteError(where + ("id",), f"id {parsed.id!r} is also item {seen[parsed.id]} of this batch")
            seen[parsed.id] = i
            _refuse_conflict(types, where, parsed.fields or {})
            types.add(parsed.fields, i)
            passages.append(Passage(parsed.id, parsed.text, dict(parsed.fields or {})))
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
            types = self._field_types()  # a batch written since the check may have typed a field first
            for position, passage in enumerate(passages):
                _refuse_conflict(types, ("passages", position), passage.fields)
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
            if filter is not None:
                ids = self._matching(searcher, conjunction(bound, searcher.parse_filter(filter)))
            held = self._held(list(dict.fromkeys(ids)), bound, inside=True)
            if not held:
                return self.seq, 0
            record = Record(self.seq + 1, delete=tuple(held))
            self._commit(record)
            return record.seq, len(held)

    def rebase(self, searcher: Searcher) -> None:
        """Serves `searcher`, a new generation of the index holding the writes up to its manifest's write_sequence
        (retrieval.compaction), with the later ones replayed beside it; the log drops the ones it holds."""
        with self._lock:
            folded = searcher.manifest.write_sequence
            self.searcher = searcher.with_segment(Segment(searcher.manifest.count, folded))
            self.segment_since = None
            later = [record for record in self.log.records if record.seq > folded]
            for record in later:
                self._apply(record)
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

    def _field_types(self) -> FieldTypes:
        """The collection's field types, as a batch's fields are checked against."""
        types = FieldTypes(max_fields=max(MAX_FIELDS, len(self.searcher.field_types)))
        types.know(self.searcher.field_types, "the index")
        return types

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

    def _apply(self, record: Record) -> None:
        self._serve(self._after(record))

    def _after(self, record: Record) -> Searcher:
        """The searcher with `record` applied."""
        searcher = self.searcher
        segment = searcher.segment
        if record.upsert:
            passages = [Passage(**item) for item in record.upsert]
            base_rows = searcher.passages.rows_of([p.id for p in passages])
            segment = segment.upserted(passages, record.vectors, record.seq, base_rows)
        else:
            segment = segment.deleted(record.delete, record.seq, searcher.passages.rows_of(list(record.delete)))
        return searcher.with_segment(segment)

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


def _refuse_conflict(types: FieldTypes, where: tuple, fields: Mapping) -> None:
    """WriteError at `where` (and the field it names) where `fields` do not fit `types` (FieldTypes.conflict)."""
    conflict = types.conflict(fields)
    if conflict is not None:
        name = next((name for name in fields if f'"{name}"' in conflict), None)
        raise WriteError(where + ((name,) if name else ()), conflict)


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
