"""Which records of a corpus one `build --shard i/N` job keeps.

The records of a corpus are its lines that are neither blank nor the TSV
header: its passages and its bad lines. Shard i of N keeps the records at
positions i, i + N, i + 2N, ... (0-based, round-robin), so every job streams
the same file, needs no coordination, and each bad line is reported (or, with
--skip-bad, counted) by exactly one shard. `index_builder.merge` puts the
shards' rows back in corpus line order.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    index: int  # i, from 0
    count: int  # N

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard must be i/N with 0 <= i < N, got {self}")

    @classmethod
    def parse(cls, text: str) -> Shard:
        """'1/4' -> Shard(1, 4); ValueError names what is wrong."""
        try:
            index, count = (int(part) for part in text.split("/"))
        except ValueError:
            raise ValueError(f"shard must look like i/N (e.g. 0/4), got {text!r}") from None
        return cls(index, count)

    def keeps(self, position: int) -> bool:
        """Whether the record at `position` (0-based, among the corpus's records) belongs to this shard."""
        return position % self.count == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"
