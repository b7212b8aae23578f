"""Passage metadata: the fields a JSONL corpus carries beside id, title and text, their types, and the
per-field columns a filter (retrieval.filters) is evaluated over.

A field's value is a string, a number, a boolean or a list of strings; null means the field is absent.
Each field has one type across the collection (`FieldTypes`, checked as a build reads the corpus), which
the manifest lists (`Manifest.fields`). The values are stored with the passage, as a JSON object in the
passage store's `fields` column; `FieldColumns` reads them once, when an index loads, into one numpy
array per field, so a filter is a vectorised mask over every row rather than a query per request.
"""

from __future__ import annotations

import difflib
import json
import math
import sqlite3
import unicodedata
from dataclasses import dataclass, field
from typing import Iterable, Literal, Mapping

import numpy as np

FieldType = Literal["string", "number", "boolean", "string[]"]
FIELD_TYPES: tuple[str, ...] = ("string", "number", "boolean", "string[]")
RESERVED = ("id", "_id", "title", "text")  # a JSONL record's own keys, never fields
BEIR_METADATA = "metadata"  # BEIR corpus.jsonl's object: its supported members become fields
MAX_NAME_CHARS = 256
MAX_FIELDS = 256  # the fields an index may declare by default (build and update --max-fields raise it)
MAX_SCOPE_FIELDS = 32  # the fields one API key's passages may hold, written over HTTP (SEARCH_MAX_SCOPE_FIELDS)


def value_type(value) -> FieldType | None:
    """The type of a field's value; None for null (the field is then absent). ValueError with the reason
    for a value no field may hold: a nested object, a list holding anything but strings, a number that is
    not finite (JSON's reader takes NaN, Infinity and 1e999) or past float64's range."""
    if value is None:
        return None
    if isinstance(value, bool):  # before int: bool is an int in Python
        return "boolean"
    if isinstance(value, (int, float)):
        try:
            finite = math.isfinite(float(value))
        except OverflowError:
            finite = False
        if not finite:
            raise ValueError(f"{value!r} is not a finite number")
        return "number"
    if isinstance(value, str):
        _check_text(value, "its value")
        return "string"
    if isinstance(value, list):
        for item in value:
            if not isinstance(item, str):
                raise ValueError("a list may hold strings only (strings, numbers, booleans and lists of strings "
                                 "are supported)")
            _check_text(item, "a list item")
        return "string[]"
    raise ValueError("nested objects are not supported (strings, numbers, booleans and lists of strings are)")


def _check_text(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{what} is not valid Unicode text: a lone surrogate at character {error.start}") from None


def check_name(name: str) -> None:
    """ValueError unless `name` may name a field: not empty, at most MAX_NAME_CHARS characters, not starting
    with `$` (a filter's operators do), without `"` or `\\` (the store reads a field by a quoted JSON path)
    and without control characters (SQLite's JSON functions end a key at a NUL)."""
    if not name or len(name) > MAX_NAME_CHARS:
        raise ValueError(f"a field name must have 1 to {MAX_NAME_CHARS} characters")
    if name.startswith("$") or '"' in name or "\\" in name:
        raise ValueError("a field name may not start with $ nor hold \" or \\")
    control = next((position for position, char in enumerate(name) if unicodedata.category(char) == "Cc"), None)
    if control is not None:
        raise ValueError(f"a field name may not hold control characters (U+{ord(name[control]):04X} at character "
                         f"{control})")
    _check_text(name, "its name")


def record_fields(record: Mapping) -> dict:
    """A JSONL record's fields: every key but id, _id, title and text, with the members of a BEIR `metadata`
    object flattened among them (its members of an unsupported kind, nested objects say, are ignored, and so
    are members named id, _id, title or text); nulls are left out. ValueError naming the field for a value or
    name no field may have, or a `metadata` member that is also a top-level field."""
    fields = {}
    for name, value in record.items():
        if name in RESERVED:
            continue
        if name == BEIR_METADATA and isinstance(value, dict):
            for member, inner in value.items():
                if member in RESERVED:
                    continue
                try:
                    check_name(member)
                    kind = value_type(inner)
                except ValueError:
                    continue
                if kind is None:
                    continue
                if member in record:
                    raise ValueError(f'field "{member}" is both a top-level field and a member of "metadata"')
                fields[member] = inner
            continue
        try:
            check_name(name)
            kind = value_type(value)
        except ValueError as error:
            raise ValueError(f'field "{name[:MAX_NAME_CHARS]}": {error}') from None
        if kind is not None:
            fields[name] = value
    return fields


@dataclass
class FieldTypes:
    """The type of each field seen so far, and where it was first seen (a corpus line, or the index an update
    adds to; for messages); at most `max_fields` fields."""

    types: dict[str, str] = field(default_factory=dict)
    first_seen: dict[str, str] = field(default_factory=dict)
    max_fields: int = MAX_FIELDS

    def conflict(self, fields: Mapping | None) -> str | None:
        """Why a passage with `fields` cannot join the collection (a field of another type than before, or
        one field too many), or None."""
        new = [name for name in (fields or {}) if name not in self.types]
        if len(self.types) + len(new) > self.max_fields:
            return (f'field "{new[-1]}" would be field {len(self.types) + len(new)} of the collection, over the '
                    f"{self.max_fields} an index may declare (raise it with --max-fields)")
        for name, value in (fields or {}).items():
            kind = value_type(value)
            if name in self.types and self.types[name] != kind:
                return (f'field "{name}" is a {kind} here but a {self.types[name]} {self.first_seen[name]} '
                        "(a field has one type across the collection)")
        return None

    def admit(self, passages: Iterable) -> list[tuple[int, str]]:
        """(line, reason) for each of `passages` (with .fields and .line, in corpus order) whose fields conflict
        with those seen before it; the others' types are learnt."""
        conflicts = []
        for passage in passages:
            reason = self.conflict(passage.fields)
            if reason is None:
                self.add(passage.fields, passage.line)
            else:
                conflicts.append((passage.line, reason))
        return conflicts

    def add(self, fields: Mapping | None, line: int) -> None:
        for name, value in (fields or {}).items():
            if name not in self.types:
                self.types[name], self.first_seen[name] = value_type(value), f"on line {line}"

    def know(self, types: Mapping[str, str], origin: str) -> None:
        """`types` (an index's, from its manifest) learnt as first seen in `origin`."""
        for name, kind in types.items():
            if name not in self.types:
                self.types[name], self.first_seen[name] = kind, f"in {origin}"

    @classmethod
    def of_store(cls, connection: sqlite3.Connection) -> "FieldTypes":
        """The types of the passages already stored (an interrupted build resuming)."""
        types = cls()
        for name, kind, line in sorted(_stored(connection), key=lambda found: found[2]):
            if name not in types.types:
                types.types[name], types.first_seen[name] = kind, f"on line {line}"
        return types

    def sorted(self) -> dict[str, str]:
        return dict(sorted(self.types.items()))


# SQLite's json_type of a stored value -> its field type
JSON_TYPES = {"text": "string", "integer": "number", "real": "number", "true": "boolean", "false": "boolean",
              "array": "string[]"}


def _stored(connection: sqlite3.Connection) -> list[tuple[str, str, int]]:
    """(field, type, first corpus line) of each field and type the stored passages hold."""
    found = connection.execute("SELECT j.key, j.type, MIN(p.line) FROM passages p, json_each(p.fields) j "
                               "WHERE p.fields IS NOT NULL GROUP BY j.key, j.type").fetchall()
    merged: dict[tuple[str, str], int] = {}
    for name, json_type, line in found:
        key = (name, JSON_TYPES[json_type])
        merged[key] = min(line, merged.get(key, line))
    return [(name, kind, line) for (name, kind), line in merged.items()]


def stored_types(connection: sqlite3.Connection) -> dict[str, str]:
    """The type of each field the stored passages hold, by name (what the manifest lists); ValueError naming
    a field stored with two types (passages merged from builds that typed it differently)."""
    types: dict[str, tuple[str, int]] = {}
    for name, kind, line in _stored(connection):
        if name in types and types[name][0] != kind:
            (other, at), here = types[name], (kind, line)
            first, second = sorted([(other, at), here], key=lambda found: found[1])
            raise ValueError(f'field "{name}" is a {first[0]} on corpus line {first[1]} but a {second[0]} on line '
                             f"{second[1]} (a field has one type across the collection)")
        types[name] = (kind, line)
    return {name: kind for name, (kind, _) in sorted(types.items())}


def encode_fields(fields: Mapping | None) -> str | None:
    """The `fields` column's value for a passage: a JSON object, or NULL for none."""
    return json.dumps(fields, ensure_ascii=False, separators=(",", ":")) if fields else None


@dataclass
class Column:
    """One field over every row. number: float64 values, NaN where absent. boolean: int8, 1, 0 or -1 (absent).
    string: int32 codes into `values` (-1: absent). string[]: `present` per row, and one (item_rows[i],
    item_codes[i]) pair per list item, codes into `values`."""

    kind: str
    data: np.ndarray | None = None
    values: dict[str, int] = field(default_factory=dict)
    present: np.ndarray | None = None
    item_rows: np.ndarray | None = None
    item_codes: np.ndarray | None = None

    def exists(self) -> np.ndarray:
        if self.kind == "number":
            return ~np.isnan(self.data)
        if self.kind == "string[]":
            return self.present
        return self.data >= 0

    def exists_at(self, rows: np.ndarray) -> np.ndarray:
        """`exists()` at `rows` alone, in time of their number."""
        if self.kind == "number":
            return ~np.isnan(self.data[rows])
        if self.kind == "string[]":
            return self.present[rows]
        return self.data[rows] >= 0


class FieldColumns:
    """Every field of an index as a column over its `count` rows (see Column); `types` as the manifest lists them."""

    def __init__(self, count: int, types: Mapping[str, str], columns: Mapping[str, Column]) -> None:
        self.count, self.types, self.columns = count, dict(types), dict(columns)

    @classmethod
    def empty(cls, count: int) -> "FieldColumns":
        return cls(count, {}, {})

    @classmethod
    def load(cls, connection: sqlite3.Connection, types: Mapping[str, str], count: int) -> "FieldColumns":
        """The columns of `types`' fields, read from a passage store in one pass over its rows, each row's
        fields parsed by Python's JSON reader: values are kept as the exact code points stored (NUL included,
        which SQLite's JSON functions cut a string at), in time linear in the values stored."""
        if not types:
            return cls.empty(count)
        stored = connection.execute("SELECT row, fields FROM passages WHERE fields IS NOT NULL")
        return cls.of_rows(count, types, ((row, json.loads(fields)) for row, fields in stored))

    @classmethod
    def of_rows(cls, count: int, types: Mapping[str, str], rows: Iterable[tuple[int, Mapping]]) -> "FieldColumns":
        """The columns of `types`' fields over `count` rows from (row, fields) pairs; a value of another type than
        its field's is absent."""
        found: dict[str, tuple[list[int], list]] = {name: ([], []) for name in types}
        for row, fields in rows:
            for name, value in fields.items():
                column = found.get(name)
                if column is not None and _is_a(value, types[name]):
                    column[0].append(row)
                    column[1].append(value)
        return cls(count, types, {name: _column(kind, count, *found[name]) for name, kind in types.items()})


def _is_a(value, kind: str) -> bool:
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"boolean": bool, "string": str, "string[]": list}[kind])


def absent_column(kind: str, count: int) -> Column:
    return _fill(kind, count, np.empty(0, dtype=np.int64), [])


def _column(kind: str, count: int, rows: list[int], values: list) -> Column:
    if kind != "string[]":
        return _fill(kind, count, np.asarray(rows, dtype=np.int64), values)
    vocabulary: dict[str, int] = {}
    pairs = [(row, vocabulary.setdefault(item, len(vocabulary))) for row, items in zip(rows, values) for item in items]
    present = np.zeros(count, dtype=bool)
    present[np.asarray(rows, dtype=np.int64)] = True
    item_rows = np.fromiter((row for row, _ in pairs), dtype=np.int32, count=len(pairs))
    item_codes = np.fromiter((code for _, code in pairs), dtype=np.int32, count=len(pairs))
    return Column(kind, values=vocabulary, present=present, item_rows=item_rows, item_codes=item_codes)


def _fill(kind: str, count: int, rows: np.ndarray, values: list) -> Column:
    if kind == "number":
        data = np.full(count, np.nan)
        data[rows] = np.asarray(values, dtype=np.float64)
        return Column(kind, data)
    if kind == "boolean":
        data = np.full(count, -1, dtype=np.int8)
        data[rows] = np.asarray(values, dtype=np.int8)
        return Column(kind, data)
    if kind == "string[]":
        return Column(kind, present=np.zeros(count, dtype=bool), item_rows=np.empty(0, dtype=np.int32),
                      item_codes=np.empty(0, dtype=np.int32))
    vocabulary: dict[str, int] = {}
    codes = np.fromiter((vocabulary.setdefault(value, len(vocabulary)) for value in values), dtype=np.int32,
                        count=len(values))
    data = np.full(count, -1, dtype=np.int32)
    data[rows] = codes
    return Column(kind, data, values=vocabulary)


def merged_types(named: Iterable[tuple[str, Mapping[str, str]]]) -> dict[str, str]:
    """The fields of several indexes together (the shards of one build); ValueError naming a field two of
    them type differently."""
    types: dict[str, str] = {}
    holder: dict[str, str] = {}
    for name, fields in named:
        for field_name, kind in fields.items():
            if types.setdefault(field_name, kind) != kind:
                raise ValueError(f'field "{field_name}" is a {kind} in {name} but a {types[field_name]} in '
                                 f"{holder[field_name]}")
            holder.setdefault(field_name, name)
    return dict(sorted(types.items()))


SHOWN_FIELDS = 8  # an unknown field's message names at most this many of the index's


class ScopeFields(dict):
    """The fields one scope (an API key's filter) sees, name: type: those the live passages inside it hold and
    those the scope itself reads. Checked against these, a request's errors name nothing outside the scope."""


def known_fields(name: str, types: Mapping[str, str]) -> str:
    """What an error about an unknown field `name` says of the index's fields (or, for ScopeFields, of the
    scope's): all of them where they are few, else the closest few (an answer stays small however many fields
    an index declares)."""
    scoped = isinstance(types, ScopeFields)
    if not types:
        return ("the passages this key may read hold no fields" if scoped
                else "this index has no fields: it was built without metadata fields")
    if len(types) <= SHOWN_FIELDS:
        whose = "the fields of the passages this key may read" if scoped else "this index's fields"
        return f"{whose}: {', '.join(types)}"
    close = difflib.get_close_matches(name, list(types), n=3, cutoff=0.6)
    closest = f"closest: {', '.join(close)}; " if close else ""
    if scoped:
        return f"{closest}the passages this key may read hold {len(types)} fields"
    return f"{closest}this index has {len(types)} fields, listed in /ready"


class UnknownField(ValueError):
    """A field asked for that the index does not have; `position` is its place in the list asked."""

    def __init__(self, position: int, message: str) -> None:
        super().__init__(message)
        self.position = position


def chosen_fields(fields, types: Mapping[str, str]) -> tuple[str, ...] | None:
    """The fields a search returns with each hit: None (and False) for none, True for all of `types`, a list
    of names for those (UnknownField naming one the index lacks)."""
    if fields is None or fields is False:
        return None
    if fields is True:
        return tuple(types)
    for position, name in enumerate(fields):
        if name not in types:
            shown = str(name).encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate, escaped
            raise UnknownField(position, f'fields: unknown field "{shown}" ({known_fields(str(name), types)})')
    return tuple(dict.fromkeys(fields))
