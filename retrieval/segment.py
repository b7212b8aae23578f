"""The passages written since a generation was built (writes over HTTP), searched exactly beside it.

A `Segment` is immutable: each write makes the next one (`applied`), and a search reads the one it
started with. It holds the written passages (id, text, fields, vector) in write order, which of them are still
live (an id written again or deleted is not), and which of the generation's rows it hides (deleted, or
replaced by a written passage). Its rows follow the generation's: the generation's `base_count` rows, then
one per written passage. Searched together (retrieval.searcher), the generation's live rows then the
segment's live passages are the collection a compaction writes (retrieval.compaction), in that order.

Dense: the segment's live vectors scanned exactly, merged with the generation's search among its rows not
hidden. BM25: the terms of what it changes (`terms`, tokenized as each write comes: retrieval.bm25_changes)
combined at query time with the generation's BM25, exactly as a rebuild over the live passages scores.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from retrieval.fields import FieldColumns, value_type
from retrieval.filters import Filter, evaluate
from retrieval.segment_terms import ChangedTerms


@dataclass(frozen=True)
class Passage:
    id: str
    text: str
    fields: dict = field(default_factory=dict, hash=False)

    @property
    def id_and_text(self) -> tuple[str, str]:
        return self.id, self.text


@dataclass(frozen=True)
class Change:
    """One write as a segment takes it: `written` passages (ids distinct) with their `vectors`, or ids `deleted`."""

    seq: int
    written: tuple[Passage, ...] = ()
    vectors: np.ndarray | None = field(default=None, compare=False)
    deleted: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False)
class Segment:
    base_count: int
    seq: int = 0  # the last write it holds (retrieval.write_log); 0: none
    passages: tuple[Passage, ...] = ()
    vectors: np.ndarray | None = None  # (len(passages), dimension) float32
    live: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))  # per written passage
    hidden: np.ndarray | None = None  # per generation row: deleted or replaced; None: none
    by_id: Mapping[str, int] = field(default_factory=dict)  # id -> position of its live written passage
    types: Mapping[str, str] = field(default_factory=dict)  # the written passages' field types
    terms: ChangedTerms | None = None  # the terms of what it changes, where the generation has BM25
    _made: dict = field(default_factory=dict, repr=False)  # what `made` built once for this segment
    _building: dict = field(default_factory=dict, repr=False)  # a lock per name `made` builds
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def changes(self) -> bool:
        """Whether it changes the collection at all."""
        return bool(self.passages) or self.hidden is not None

    @property
    def written(self) -> int:
        """Its live written passages."""
        return int(self.live.sum())

    @property
    def size(self) -> int:
        """How much it holds: every passage written, and every generation row it hides."""
        return len(self.passages) + self.hidden_count

    @property
    def hidden_count(self) -> int:
        return 0 if self.hidden is None else int(self.hidden.sum())

    @property
    def count(self) -> int:
        """Passages in the collection it makes of its generation."""
        return self.base_count - self.hidden_count + self.written

    def applied(self, changes: Sequence["Change"], base_rows: Mapping[str, int]) -> "Segment":
        """The segment with `changes` made in order, in one pass: each written passage replaces the passage of its
        id, written before or in the generation, and each deleted id is no longer held (one the collection does not
        hold is no change); `base_rows`: the generation's row of each id they name that it holds."""
        live, by_id, types = self.live.tolist(), dict(self.by_id), dict(self.types)
        hidden = None if self.hidden is None else self.hidden.copy()
        passages, vectors, newly_hidden = list(self.passages), [], []

        def drop(pid: str) -> None:
            nonlocal hidden
            if pid in by_id:
                live[by_id.pop(pid)] = False
            row = base_rows.get(pid)
            if row is not None:
                if hidden is None:
                    hidden = np.zeros(self.base_count, dtype=bool)
                if not hidden[row]:
                    hidden[row] = True
                    newly_hidden.append(row)

        for change in changes:
            for pid in change.deleted:
                drop(pid)
            for passage in change.written:  # ids distinct within a change: dropping one never drops another's
                drop(passage.id)
            for passage in change.written:
                by_id[passage.id] = len(passages)
                passages.append(passage)
                live.append(True)
                for name, value in passage.fields.items():
                    types.setdefault(name, value_type(value))
            if change.written:
                vectors.append(np.asarray(change.vectors, dtype=np.float32))
        if self.terms is not None:
            self.terms.hide(self.hidden_count, newly_hidden)
            self.terms.write(len(self.passages), [passage.text for passage in passages[len(self.passages):]])
        if vectors:
            stacked = np.concatenate(([] if self.vectors is None else [self.vectors]) + vectors)
            vectors_held = np.ascontiguousarray(stacked, dtype=np.float32)
        else:
            vectors_held = self.vectors
        seq = changes[-1].seq if changes else self.seq
        return Segment(self.base_count, seq, tuple(passages), vectors_held, np.array(live, dtype=bool), hidden,
                       by_id, types, self.terms)

    def is_hidden(self, row: int) -> bool:
        return self.hidden is not None and bool(self.hidden[row])

    def collection(self) -> tuple[np.ndarray, np.ndarray]:
        """The collection's rows in its order: the generation's rows not hidden, then the live written passages'
        positions (their rows are base_count + position)."""
        base = np.arange(self.base_count) if self.hidden is None else np.flatnonzero(~self.hidden)
        return base, np.flatnonzero(self.live)

    def base_mask(self, mask: np.ndarray | None) -> np.ndarray | None:
        """The generation's rows a search reads: `mask`'s (None: all) less the hidden ones; None for all."""
        if self.hidden is None:
            return mask
        return ~self.hidden if mask is None else mask & ~self.hidden

    def matching(self, filter: Filter | None) -> np.ndarray:
        """The written passages a search reads: live, and matched by `filter` where one is given."""
        if filter is None or not len(self.passages):
            return self.live
        columns = FieldColumns.of_rows(len(self.passages), self.types, enumerate(p.fields for p in self.passages))
        return self.live & evaluate(filter, columns)

    def dense(self, vectors: np.ndarray, k: int, among: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """The best `k` written passages `among` keeps per query vector, exactly (inner product), as (rows,
        scores): rows base_count + position, best first, equal scores by row."""
        positions = np.flatnonzero(among)
        if not len(positions) or k <= 0:
            return [(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)) for _ in range(len(vectors))]
        candidates = self.vectors if len(positions) == len(self.vectors) else self.vectors[positions]
        scores = np.asarray(vectors, dtype=np.float32) @ candidates.T
        take = min(k, len(positions))
        results = []
        for row_scores in scores:
            kth = np.partition(row_scores, len(row_scores) - take)[len(row_scores) - take]
            found = np.flatnonzero(row_scores >= kth)  # every score tied at the k-th too, ordered by row below
            order = found[np.lexsort((positions[found], -row_scores[found]))][:k]
            results.append((self.base_count + positions[order].astype(np.int64), row_scores[order]))
        return results

    def made(self, name: str, build: Callable[[], Any]) -> Any:
        """`build()`'s result, built on first use and kept with this (immutable) segment; one build at a time per
        name."""
        with self._lock:
            if name in self._made:
                return self._made[name]
            building = self._building.setdefault(name, threading.Lock())
        with building:
            if name not in self._made:
                self._made[name] = build()
            return self._made[name]

    def passage(self, row: int) -> Passage:
        """The written passage at collection row `row` (at least base_count)."""
        return self.passages[row - self.base_count]
