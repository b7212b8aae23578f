"""`compact`: every write over HTTP an index holds outside its rows (sealed beside them, or in the log beside
its folder) merged into the rows of a new generation, as a writer's compaction past its merge share does
(retrieval.compaction), with no service running; an `update`, which rewrites the rows alone, needs it first."""

from __future__ import annotations

from pathlib import Path

from index_builder.build_update import index_encoder
from retrieval.compaction import compact
from retrieval.index_format import read_manifest
from retrieval.load_options import LoadOptions
from retrieval.searcher import Searcher
from retrieval.writes import Writes


def compact_index(index_dir: Path, model: Path | None = None) -> str:
    """The one-line summary of merging `index_dir`'s writes into its rows (see the module), on the CPU (nothing is
    encoded: the writes hold their vectors); `model`: the index's model folder, where it has moved.
    out_lock.InUse while a writer or a build holds the folder."""
    encoder = index_encoder(read_manifest(index_dir), model, "cpu")
    writes = Writes.open(Searcher(index_dir, encoder, LoadOptions(device="cpu")))
    try:
        report = compact(writes, progress=True)
    finally:
        writes.close()
    return report.summary() if report is not None else f"{index_dir}: no write outside its rows; nothing to compact"
