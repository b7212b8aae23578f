"""What one scope (an API key's filter: service/http/keys.py) sees of a collection's fields: the fields its live
passages hold, so that what a scoped key is told, and what it may declare, depends on its own passages alone.

    scope_fields(searcher, searcher.parse_filter({"tenant": "a"}))   # ScopeFields({"tenant": "string", ...})
    scope_fields(searcher, None)                                     # the fields the whole live collection holds

A field counts while a live passage inside the scope holds it: a delete frees it at once, not at the next
compaction. The generation's part (per field, its rows inside the scope) is counted once per generation and
scope; each segment (retrieval.segment) then takes off the hidden rows and adds its live written passages, in
time of what was written, not of the collection.
"""

from __future__ import annotations

import numpy as np

from retrieval.fields import ScopeFields
from retrieval.filters import Filter


def scope_fields(searcher, scope: Filter | None) -> ScopeFields:
    """The fields (name: type, by name) the live passages of `searcher` inside `scope` hold
    (None: every live passage), and the fields `scope` itself reads."""
    segment = searcher.segment
    key = ("scope fields", None if scope is None else scope.spec)
    return segment.made(key, lambda: _fields(searcher, scope))


def _fields(searcher, scope: Filter | None) -> ScopeFields:
    segment, columns = searcher.segment, searcher.restrictions.columns
    inside = None if scope is None else searcher.restrictions.of(scope).mask
    counts = dict(_generation_counts(searcher, scope, inside))
    if segment.hidden is not None:
        gone = segment.hidden if inside is None else segment.hidden & inside
        rows = np.flatnonzero(gone)
        for name, column in columns.columns.items():
            counts[name] -= int(column.exists_at(rows).sum())
    for position in np.flatnonzero(segment.matching(scope)):
        for name in segment.passages[position].fields:
            counts[name] = counts.get(name, 0) + 1
    read = {name for name, _ in scope.types} if scope is not None else set()
    return ScopeFields(sorted((name, kind) for name, kind in searcher.field_types.items()
                              if counts.get(name, 0) > 0 or name in read))


def _generation_counts(searcher, scope: Filter | None, inside: np.ndarray | None) -> dict[str, int]:
    """Per field of the generation, its rows inside `scope` (hidden ones too), counted once per generation."""
    key = None if scope is None else scope.spec
    cache = searcher.scope_counts
    if key not in cache:
        columns = searcher.restrictions.columns.columns
        cache[key] = {name: int(column.exists().sum() if inside is None else (column.exists() & inside).sum())
                      for name, column in columns.items()}
    return cache[key]
