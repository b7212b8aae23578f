"""The terms of what one writer's writes change since its generation (retrieval.segment): each written passage's
terms and length, and those of the generation's passages they hide, tokenized as each write comes (as
retrieval.bm25_index tokenizes), for BM25 beside writes (retrieval.bm25_changes)."""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from typing import Callable, Sequence

import numpy as np

from retrieval.bm25_index import stems


class ChangedTerms:
    """The terms of what one writer's segments change (retrieval.segment): appended to as writes come, shared by
    the chain of segments each write makes, read by each segment up to its own length (its first `positions`
    written passages, the first `hidden` generation rows it hides, in the order they were hidden). Only the newest
    segment is extended (one writer, under its lock); a write that was not applied is cut off by the next one
    (`write` and `hide` start where the segment they extend ends)."""

    def __init__(self, base_texts: Callable[[Sequence[int]], list[str]]) -> None:
        self.base_texts = base_texts  # the generation's texts of the rows given
        self._lock = threading.Lock()
        self._written: dict[str, tuple[list[int], list[int]]] = {}  # term -> (positions, term frequencies)
        self._written_terms: list[Counter] = []  # per position
        self.written_lengths: list[int] = []  # per position
        self._hidden: dict[str, list[int]] = {}  # term -> the order (0, 1, ...) in which rows holding it were hidden
        self._hidden_terms: list[Counter] = []
        self._hidden_total: list[int] = [0]  # the hidden rows' lengths summed: the first n rows' at [n]

    def write(self, start: int, texts: Sequence[str]) -> None:
        """Adds the passages written at positions start, start + 1, ... (their texts)."""
        counted = [Counter(terms) for terms in stems(texts)]
        with self._lock:
            self._cut(self._written_terms, start, lambda term: self._written[term])
            del self.written_lengths[start:]
            for position, counts in enumerate(counted, start):
                for term, frequency in counts.items():
                    positions, frequencies = self._written.setdefault(term, ([], []))
                    positions.append(position)
                    frequencies.append(frequency)
                self._written_terms.append(counts)
                self.written_lengths.append(sum(counts.values()))

    def hide(self, start: int, rows: Sequence[int]) -> None:
        """Adds the generation's `rows` as hidden, the (start + 1)-th onwards."""
        counted = [Counter(terms) for terms in stems(self.base_texts(rows))] if len(rows) else []
        with self._lock:
            self._cut(self._hidden_terms, start, lambda term: (self._hidden[term],))
            del self._hidden_total[start + 1:]
            for order, counts in enumerate(counted, start):
                for term in counts:
                    self._hidden.setdefault(term, []).append(order)
                self._hidden_terms.append(counts)
                self._hidden_total.append(self._hidden_total[-1] + sum(counts.values()))

    @staticmethod
    def _cut(per_entry: list[Counter], start: int, lists: Callable[[str], tuple[list, ...]]) -> None:
        """Drops the entries from `start` on (each term's list ends with them, in order)."""
        for counts in reversed(per_entry[start:]):
            for term in counts:
                for values in lists(term):
                    values.pop()
        del per_entry[start:]

    def terms(self) -> list[str]:
        """Every term a written passage has held."""
        return list(self._written)

    def written_postings(self, term: str, positions: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, term frequencies) of the first `positions` written passages holding `term`, live or not."""
        found = self._written.get(term)
        if found is None:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
        held, frequencies = found
        end = bisect.bisect_left(held, positions)
        return np.array(held[:end], dtype=np.int64), np.array(frequencies[:end], dtype=np.float64)

    def hidden_holding(self, term: str, hidden: int) -> int:
        """How many of the first `hidden` hidden rows hold `term`."""
        return bisect.bisect_left(self._hidden.get(term, ()), hidden)

    def hidden_length(self, hidden: int) -> int:
        return self._hidden_total[hidden]
