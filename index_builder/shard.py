"""Which records of a corpus one `build --shard i/N` job keeps.

The records of a corpus are its lines that are neither blank nor the TSV
header: its passages and its bad lines. Shard i of N keeps the records at
positions i, i + N, i + 2N, ... (0-based, round-robin), so every job streams
the same file, needs no coordination, and each bad line is reported (or, with
--skip-bad, counted) by exactly one shard. `index_builder.merge` puts the
shards' rows back in corpus line order.
"""

from __future__ import annotations

from retrieval.sharding import Shard

__all__ = ["Shard"]  # kept in retrieval, where sharded serving reads it too
