"""Exact metadata filters in the MongoDB-style grammar Pinecone and Chroma use, parsed once into a checked
tree and evaluated to a boolean mask over every row of an index (retrieval.fields.FieldColumns).

    {"source": "pubmed"}                          equality ($eq shorthand)
    {"year": {"$gte": 2020, "$lt": 2024}}         several operators on a field: all must hold
    {"lang": {"$in": ["en", "de"]}}               $in / $nin: a list of values of the field's type
    {"source": "pubmed", "open": true}            several keys in one object: all must hold
    {"$or": [{"source": "pubmed"}, {"year": {"$lt": 2000}}]}      $and / $or: a list of filters
    {"$not": {"source": "pubmed"}}                $not: a filter, or on a field an operator object
    {"tags": {"$exists": true}}                   whether the passage has the field

Operators: $eq $ne (string, number, boolean), $gt $gte $lt $lte (number), $in $nin (a list of strings,
numbers or booleans), $exists (true or false). On a list-of-strings field, equality and $in mean
"contains" (as Pinecone has it), $ne and $nin "does not contain". A passage without the field matches
none of $eq, $in and the ranges, and so matches $ne and $nin, their negations (as MongoDB has it). `{}`
matches every passage.

Everything wrong with a filter is a FilterError (a ValueError) whose `path` locates it and whose message
names the field or operator: an unknown field, a value of another type than the field's, an unknown
operator, a malformed $in.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from retrieval.fields import Column, FieldColumns, absent_column, known_fields

MAX_DEPTH = 32  # nesting of $and / $or / $not a filter may have
# A filter's size, so its cost is bounded: its clauses (conditions, $and, $or, $not and empty objects) and the
# values of its $in and $nin lists, each counted over the whole filter (Pinecone caps one $in at 10,000). Each
# clause is about one pass over an index's rows.
MAX_CLAUSES = 1024
MAX_LIST_VALUES = 10_000
SCALAR_OPERATORS = ("$eq", "$ne")
RANGE_OPERATORS = ("$gt", "$gte", "$lt", "$lte")
LIST_OPERATORS = ("$in", "$nin")
FIELD_OPERATORS = (*SCALAR_OPERATORS, *RANGE_OPERATORS, *LIST_OPERATORS, "$exists", "$not")
LOGICAL_OPERATORS = ("$and", "$or", "$not")
# The operand type each field type's equality and $in take: a list field's items are strings.
OPERAND_TYPE = {"string": "string", "number": "number", "boolean": "boolean", "string[]": "string"}


class FilterError(ValueError):
    """A filter this index cannot apply; `path` locates the fault inside the filter (keys and list positions)."""

    def __init__(self, path: tuple, message: str) -> None:
        super().__init__(_printable(message))
        self.path = tuple(_printable(part) if isinstance(part, str) else part for part in path)


def _printable(text: str) -> str:
    """`text` with what UTF-8 cannot hold (a lone surrogate a JSON request may escape) written as an escape,
    so a message or location quoting a request's key can be answered."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# The tree. Nodes are frozen (hashable), so a parsed filter can key a cache and a micro-batch's plan.
@dataclass(frozen=True)
class Compare:
    field: str
    op: str  # $eq, $gt, $gte, $lt, $lte ($ne is Not(Compare $eq))
    value: Any


@dataclass(frozen=True)
class Within:
    field: str
    values: tuple  # $in ($nin is Not(Within))


@dataclass(frozen=True)
class Exists:
    field: str


@dataclass(frozen=True)
class Not:
    child: Any


@dataclass(frozen=True)
class All:
    children: tuple  # every child holds; no child: every passage


@dataclass(frozen=True)
class Any_:
    children: tuple  # some child holds


@dataclass(frozen=True)
class Filter:
    """A parsed filter: `spec`, its canonical JSON (equal filters have equal specs; what a Filter compares
    and hashes by), `root` the checked tree, `types` the fields it reads with the types it was checked against."""

    spec: str
    root: Any = field(compare=False, repr=False)
    types: tuple[tuple[str, str], ...] = field(compare=False, repr=False, default=())

    def check(self, types: Mapping[str, str]) -> None:
        """FilterError unless each field it reads has the type it was checked against in `types` (an index
        reloaded since the filter was parsed may differ)."""
        for name, kind in self.types:
            if types.get(name) != kind:
                now = f"a {types[name]}" if name in types else "not a field"
                raise FilterError((name,), f'filter: field "{name}" is {now} of this index (the filter was checked '
                                           f"against a {kind})")


def parse_filter(spec: Any, types: Mapping[str, str]) -> Filter:
    """`spec` (a filter as JSON gives it) checked against an index's field types (the manifest's `fields`);
    FilterError for anything that does not fit."""
    if isinstance(spec, Filter):
        spec.check(types)
        return spec
    used = _Used()
    root = _filter(spec, types, (), used, 0)
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return Filter(canonical, root, tuple(sorted(used.types.items())))


def conjunction(first: Filter | None, second: Filter | None) -> Filter | None:
    """The filter both hold for (`{"$and": [first, second]}`, already parsed); either where the other is None."""
    if first is None or second is None:
        return first or second
    spec = json.dumps({"$and": [json.loads(first.spec), json.loads(second.spec)]}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=False)
    return Filter(spec, All((first.root, second.root)), tuple(sorted(set(first.types) | set(second.types))))


@dataclass
class _Used:
    """What a filter parsed so far reads (its fields, with their types) and how big it is."""

    types: dict[str, str] = field(default_factory=dict)
    clauses: int = 0
    values: int = 0

    def count(self, path: tuple, clauses: int = 1, values: int = 0) -> None:
        self.clauses += clauses
        self.values += values
        if self.clauses > MAX_CLAUSES:
            raise FilterError(path, f"filter{_where(path)}: more than {MAX_CLAUSES} clauses (conditions, $and, $or, $not "
                                    "and empty objects), the most a filter may have (MAX_CLAUSES); for many values "
                                    "of one field use \"$in\"")
        if self.values > MAX_LIST_VALUES:
            raise FilterError(path, f"filter{_where(path)}: more than {MAX_LIST_VALUES} values in its $in and $nin "
                                    "lists together, the most a filter may have (MAX_LIST_VALUES)")


def _where(path: tuple) -> str:
    return f" at {'.'.join(map(str, path))}" if path else ""


def _filter(spec, types, path, used, depth):
    if not isinstance(spec, dict):
        raise FilterError(path, f"filter{_where(path)}: expected an object such as {{\"field\": value}}, "
                                f"got {_shown(spec)}")
    if depth > MAX_DEPTH:
        raise FilterError(path, f"filter{_where(path)}: nested deeper than {MAX_DEPTH} levels")
    if not spec:
        used.count(path)  # {}: no condition, but a node to evaluate all the same
    clauses = []
    for key, value in spec.items():
        here = (*path, key)
        if key in LOGICAL_OPERATORS:
            used.count(here)
        if key in ("$and", "$or"):
            if not isinstance(value, list) or not value:
                raise FilterError(here, f'filter: "{key}" needs a non-empty list of filters, got {_shown(value)}')
            children = tuple(_filter(child, types, (*here, i), used, depth + 1) for i, child in enumerate(value))
            clauses.append(All(children) if key == "$and" else _any(children))
        elif key == "$not":
            clauses.append(Not(_filter(value, types, here, used, depth + 1)))
        elif key.startswith("$"):
            raise FilterError(here, f'filter: unknown operator "{key}" (at the top of a filter: '
                                    f"{', '.join(LOGICAL_OPERATORS)}; on a field: {', '.join(FIELD_OPERATORS)})")
        else:
            clauses.append(_field(key, value, types, here, used, depth))
    return clauses[0] if len(clauses) == 1 else All(tuple(clauses))


def _any(children: tuple):
    """`$or` of children; where each is equality on one and the same field, that field's `$in`: one pass over
    the rows rather than one a clause (a passage matches either alike, list fields included)."""
    if all(isinstance(child, Compare) and child.op == "$eq" for child in children) and \
            len({child.field for child in children}) == 1:
        return Within(children[0].field, tuple(dict.fromkeys(child.value for child in children)))
    return Any_(children)


def _field(name, value, types, path, used, depth):
    if name not in types:
        raise FilterError(path, f'filter: unknown field "{name}" ({known_fields(name, types)})')
    kind = types[name]
    used.types[name] = kind
    if not isinstance(value, dict):
        return _operator(name, kind, "$eq", value, path, used)
    if not value:
        raise FilterError(path, f'filter: field "{name}" has an empty operator object; give one such as {{"$eq": ...}}')
    if depth > MAX_DEPTH:
        raise FilterError(path, f"filter{_where(path)}: nested deeper than {MAX_DEPTH} levels")
    clauses = []
    for op, operand in value.items():
        if op == "$not":
            used.count((*path, op))
            if not isinstance(operand, dict) or not operand:
                raise FilterError((*path, op), f'filter: "$not" on field "{name}" needs an operator object such as '
                                               f'{{"$in": [...]}}, got {_shown(operand)}')
            clauses.append(Not(_field(name, operand, types, (*path, op), used, depth + 1)))
        else:
            clauses.append(_operator(name, kind, op, operand, (*path, op), used))
    return clauses[0] if len(clauses) == 1 else All(tuple(clauses))


def _operator(name, kind, op, operand, path, used):
    used.count(path, values=len(operand) if op in LIST_OPERATORS and isinstance(operand, list) else 0)
    if op not in FIELD_OPERATORS:
        raise FilterError(path, f'filter: unknown operator "{op}" on field "{name}" '
                                f"(known: {', '.join(FIELD_OPERATORS)})")
    if op == "$exists":
        if not isinstance(operand, bool):
            raise FilterError(path, f'filter: "$exists" on field "{name}" needs true or false, got {_shown(operand)}')
        return Exists(name) if operand else Not(Exists(name))
    if op in RANGE_OPERATORS:
        if kind != "number":
            raise FilterError(path, f'filter: "{op}" needs a number field, but field "{name}" is a {kind}')
        return Compare(name, op, _operand(name, kind, op, operand, path))
    if op in LIST_OPERATORS:
        if not isinstance(operand, list):
            raise FilterError(path, f'filter: "{op}" on field "{name}" needs a list of {OPERAND_TYPE[kind]}s, '
                                    f"got {_shown(operand)}")
        values = tuple(_operand(name, kind, op, item, (*path, i)) for i, item in enumerate(operand))
        return Within(name, values) if op == "$in" else Not(Within(name, values))
    node = Compare(name, "$eq", _operand(name, kind, op, operand, path))
    return node if op == "$eq" else Not(node)


def _operand(name, kind, op, value, path):
    """`value` as the field's type wants it: a string, a finite number (float), or a boolean."""
    wanted = OPERAND_TYPE[kind]
    if wanted == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if math.isfinite(number):
            return number
    elif wanted == "string" and isinstance(value, str) or wanted == "boolean" and isinstance(value, bool):
        return value
    if isinstance(value, (list, dict)) and op in SCALAR_OPERATORS:
        hint = ' (to match any of several values use "$in")' if isinstance(value, list) else ""
        raise FilterError(path, f'filter: "{op}" on field "{name}" needs a single {wanted}, got {_shown(value)}{hint}')
    what = f"field \"{name}\" is a {kind}" + (" (of strings)" if kind == "string[]" else "")
    raise FilterError(path, f'filter: {what}, so "{op}" needs a {"finite " if wanted == "number" else ""}{wanted}, '
                            f"got {_shown(value)}")


def _shown(value) -> str:
    kind = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object",
            type(None): "null"}.get(type(value), type(value).__name__)
    text = json.dumps(value, ensure_ascii=False, default=str)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({kind})"


def evaluate(filter: Filter, columns: FieldColumns) -> np.ndarray:
    """The rows `filter` matches, as a boolean mask over `columns.count` rows. A field the columns lack (a
    shard none of whose passages has it) is absent from every row."""
    return _mask(filter.root, columns)


def _column(columns: FieldColumns, name: str, kind: str) -> Column:
    column = columns.columns.get(name)
    return column if column is not None else absent_column(kind, columns.count)


def _mask(node, columns: FieldColumns) -> np.ndarray:
    count = columns.count
    if isinstance(node, All):
        mask = np.ones(count, dtype=bool)
        for child in node.children:
            mask &= _mask(child, columns)
        return mask
    if isinstance(node, Any_):
        mask = np.zeros(count, dtype=bool)
        for child in node.children:
            mask |= _mask(child, columns)
        return mask
    if isinstance(node, Not):
        return ~_mask(node.child, columns)
    kind = columns.types.get(node.field)
    if kind is None:  # a field of the whole collection this shard's passages never have
        return np.zeros(count, dtype=bool)
    column = _column(columns, node.field, kind)
    if isinstance(node, Exists):
        return column.exists().copy()
    if isinstance(node, Within):
        return _within(column, node.values, count)
    if node.op == "$eq":
        return _within(column, (node.value,), count)
    compare = {"$gt": np.greater, "$gte": np.greater_equal, "$lt": np.less, "$lte": np.less_equal}[node.op]
    return compare(column.data, node.value)  # NaN, an absent value, compares false


def _within(column: Column, values: tuple, count: int) -> np.ndarray:
    """Rows whose value is one of `values` (a list field: that holds one of them). A few values are compared
    one by one (0.1 ms a million rows each), more looked up in a table (np.take: 3 ms; np.isin sorts: 50)."""
    if column.kind in ("number", "boolean"):
        wanted = {float(v) for v in values} if column.kind == "number" else {int(v) for v in values}
        return _one_of(column.data, wanted, count)
    codes = {column.values[v] for v in values if v in column.values}
    if column.kind == "string":
        return _one_of(column.data, codes, count, len(column.values))
    mask = np.zeros(count, dtype=bool)
    if codes:
        mask[column.item_rows[_one_of(column.item_codes, codes, len(column.item_codes), len(column.values))]] = True
    return mask


def _one_of(data: np.ndarray, wanted: set, count: int, codes: int | None = None) -> np.ndarray:
    """data[i] in `wanted`, for each i; `codes`: data holds codes 0 .. codes - 1 (or -1)."""
    if len(wanted) <= 4 or codes is None:
        if len(wanted) > 4:
            return np.isin(data, np.fromiter(wanted, dtype=data.dtype))
        mask = np.zeros(count, dtype=bool)
        for value in wanted:
            mask |= data == value
        return mask
    table = np.zeros(codes + 1, dtype=bool)  # the last entry: code -1, absent
    table[list(wanted)] = True
    return np.take(table, data, mode="wrap")
