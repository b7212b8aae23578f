"""Incremental builds: the index at DIR brought up to date as a whole new generation, re-encoding only the
passages whose text it does not hold.

`build --corpus NEW --out DIR --update` is a build of NEW through `index_builder.build` (the same chunks,
checks, resume in `.DIR.partial/`, writer and swap) whose encoder is a `ReusingEncoder`: a passage whose
text the old index holds, by content hash (retrieval.text_hashes), gets the stored vector, and the rest
are encoded, a chunk's at once. Its rows are NEW's, in NEW's order, as a full build of NEW makes them.
The diff form, `update --index DIR --add FILE --delete IDS` (index_builder.update), builds the --add file
the same way beside DIR and then writes the old rows with the changes applied.

Stored vectors are reused only where the old manifest's encoder record agrees with this encoder on every
field a passage's vector depends on (`VECTOR_FIELDS`); otherwise the update is refused, naming the fields,
since mixing vectors of two encoders would give an index no full build can make. Either way BM25 (where
the old index has it) and the candidate structures its manifest lists are built again over the new rows.
"""

from __future__ import annotations

import sqlite3
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import faiss
import numpy as np
from tqdm import tqdm

from index_builder.ann import AnnOptions, AnnReport
from index_builder.build import BuildOptions, PassageEncoder, build_index, encoder_record
from index_builder.errors import BuildError
from models.encoder import BiEncoder
from retrieval import out_lock
from retrieval.candidates.recall import HELD_OUT, RECALL_SAMPLE
from retrieval.index_format import INDEX_FILE, MANIFEST_FILE, PASSAGES_FILE, EncoderRecord, Manifest, read_manifest
from retrieval.sharding import shard_folder
from retrieval.text_hashes import HashLookup, index_text_hashes, text_sha256

# The encoder record's fields a passage's vector depends on; the query's settings, the model's name and the
# folder its weights are read from do not change it.
VECTOR_FIELDS = ("weights_sha256", "dimension", "pooling", "similarity", "passage_segment_id", "passage_max_tokens",
                 "passage_prefix", "backend", "export_sha256")
QUERY_FIELDS = ("query_segment_id", "query_max_tokens", "query_prefix")


def check_updatable(index_dir: Path, verify_checksums: bool = True) -> Manifest:
    """The manifest of the one whole index at `index_dir` (its files' sha256 checked against it unless
    `verify_checksums` is off); BuildError or IndexFormatError (one line) for a folder an update cannot
    start from."""
    if not index_dir.exists():
        raise BuildError(f"{index_dir}: no index to update (build it first, without --update)")
    if not (index_dir / MANIFEST_FILE).is_file() and shard_folder(index_dir, 0).is_dir():
        raise BuildError(f"{index_dir} holds the shards of a build --shards N; an update takes one whole index "
                         "(rebuild the shards with build --shards N --overwrite)")
    manifest = read_manifest(index_dir, verify_checksums=verify_checksums)
    if manifest.shard is not None:
        raise BuildError(f"{index_dir} is shard {manifest.shard} of a sharded build; an update takes one whole "
                         "index (rebuild the shards, or update the merged index)")
    if manifest.sealed_writes:
        raise BuildError(f"{index_dir} holds {manifest.sealed_writes} writes over HTTP sealed beside its rows, which "
                         f"an update of the rows would lose: merge them first (python -m index_builder compact "
                         f"--index {index_dir})")
    return manifest


def check_same_vectors(index_dir: Path, old: EncoderRecord, new: EncoderRecord) -> None:
    """BuildError naming each field, with both values, where `new` would encode a passage otherwise than the
    encoder that made `index_dir`'s vectors; a note on stderr where only the query settings change (the new
    manifest records this encoder's)."""
    changed = [f"{name} {getattr(old, name)!r} here, {getattr(new, name)!r} now" for name in VECTOR_FIELDS
               if getattr(old, name) != getattr(new, name)]
    if changed:
        raise BuildError(f"{index_dir} was encoded by another encoder ({'; '.join(changed)}): an update keeps "
                         "stored vectors only under the same one; pass the index's own settings, or rebuild "
                         "with --overwrite")
    queries = [f"{name} {getattr(old, name)!r} -> {getattr(new, name)!r}" for name in QUERY_FIELDS
               if getattr(old, name) != getattr(new, name)]
    if queries:
        print(f"note: the updated {index_dir} records other query settings: {'; '.join(queries)}", file=sys.stderr)


class OldIndex:
    """The index being updated: its manifest, its passages' content hashes and its vectors (memory-mapped)."""

    def __init__(self, folder: Path, manifest: Manifest) -> None:
        self.folder, self.manifest = folder, manifest
        self.lookup = HashLookup(index_text_hashes(folder, manifest))
        self.flat = faiss.read_index(str(folder / INDEX_FILE), faiss.IO_FLAG_MMAP_IFC)

    def vectors(self, rows: np.ndarray) -> np.ndarray:
        """The stored vectors of `rows`, in the order given."""
        if not len(rows):
            return np.empty((0, self.flat.d), dtype=np.float32)
        return self.flat.reconstruct_batch(np.ascontiguousarray(rows, dtype=np.int64))


class ReusingEncoder:
    """A PassageEncoder (index_builder.build) that gives each passage whose text `old` holds its stored vector
    and has `encoder` encode the others, in one call per chunk. `encoded` counts what it encoded."""

    def __init__(self, encoder: PassageEncoder, old: OldIndex) -> None:
        self.encoder, self.old = encoder, old
        self.spec, self.source = encoder.spec, encoder.source
        self.backend, self.export_sha256 = encoder.backend, encoder.export_sha256
        self.encoded = 0

    @property
    def dimension(self) -> int:
        return self.encoder.dimension

    def encode_passages(self, passages: Sequence[str], progress: tqdm | None = None) -> np.ndarray:
        rows = self.old.lookup.rows(text_sha256(passages))
        found = rows >= 0
        vectors = np.empty((len(passages), self.dimension), dtype=np.float32)
        vectors[found] = self.old.vectors(rows[found])
        missing = np.flatnonzero(~found)
        if len(missing):
            vectors[missing] = self.encoder.encode_passages([passages[i] for i in missing], progress=progress)
        if progress is not None:
            progress.update(int(found.sum()))
        self.encoded += len(missing)
        return vectors


def rebuilt_structures(manifest: Manifest, given: Sequence[AnnOptions] = ()) -> list[AnnOptions]:
    """The candidate structures `manifest` lists, to be built again with the same kind, parameters and depth
    (a kind in `given` takes the flags given instead), then `given`. Recall is measured on held-out passages
    (the queries file a card names may be gone) as many as before, or the default where the old index had
    fewer passages than that."""
    kinds = {options.kind for options in given}
    structures = []
    for record in manifest.candidates:
        if record.kind in kinds:
            continue
        if record.recall_queries != HELD_OUT:
            print(f"note: {record.kind}'s recall is measured again on held-out passages, not {record.recall_queries}",
                  file=sys.stderr)
        capped = record.recall_queries != HELD_OUT or record.sample >= manifest.count
        structures.append(AnnOptions.of(record.kind, record.params, candidates=record.depth,
                                        sample=max(record.sample, RECALL_SAMPLE) if capped else record.sample))
    return [*structures, *given]


@dataclass
class UpdateReport:
    out: Path
    passages: int
    kept: int  # rows whose vector this run did not encode: stored ones reused (and, resumed, an earlier run's)
    encoded: int
    dropped: int  # passages of the old index whose id the new one does not hold
    seconds: float
    skipped: int = 0
    resumed_chunks: int = 0
    detail: str = ""  # the diff form's counts
    ann: list[AnnReport] = field(default_factory=list)

    def summary(self) -> str:
        notes = [self.detail] if self.detail else []
        notes += [f"{self.skipped} bad lines skipped"] if self.skipped else []
        notes += [f"resumed after {self.resumed_chunks} chunks"] if self.resumed_chunks else []
        return "\n".join([
            f"updated {self.out}: {self.passages} passages; kept {self.kept}, encoded {self.encoded}, "
            f"dropped {self.dropped} in {self.seconds:.1f} s" + (f" ({'; '.join(notes)})" if notes else ""),
            *(report.summary() for report in self.ann),
        ])


def build_update(options: BuildOptions, encoder: PassageEncoder) -> UpdateReport:
    """`build --update`: `options.out` rebuilt from `options.corpus`, each passage whose text the index there
    holds keeping its stored vector (see the module). BuildError or IndexFormatError for an `out` that holds
    no whole index, another encoder, or any input a build refuses."""
    if options.shard is not None or options.shards is not None:
        raise BuildError("--update writes one whole index: drop --shard and --shards")
    started = time.perf_counter()
    with out_lock.hold(options.out, "build"):
        old = OldIndex(options.out, check_updatable(options.out))
        check_same_vectors(options.out, old.manifest.encoder, encoder_record(encoder))
        reusing = ReusingEncoder(encoder, old)
        dropped: list[int] = []
        build = build_index(replace(
            options, overwrite=True, bm25=options.bm25,
            ann=rebuilt_structures(old.manifest, options.ann),
            before_publish=lambda work: dropped.append(missing_ids(options.out, work)),
        ), reusing)
    return UpdateReport(build.out, build.passages, build.passages - reusing.encoded, reusing.encoded, dropped[0],
                        time.perf_counter() - started, build.skipped, build.resumed_chunks, ann=build.ann)


def missing_ids(old: Path, new: Path) -> int:
    """Passages of the index in `old` whose id the passage store in `new` does not hold."""
    connection = sqlite3.connect(f"{(new / PASSAGES_FILE).resolve().as_uri()}?mode=ro", uri=True)
    try:
        connection.execute("ATTACH DATABASE ? AS old", (f"{(old / PASSAGES_FILE).resolve().as_uri()}?mode=ro",))
        query = "SELECT COUNT(*) FROM old.passages WHERE id NOT IN (SELECT id FROM main.passages)"
        return connection.execute(query).fetchone()[0]
    finally:
        connection.close()


def index_encoder(manifest: Manifest, model: Path | None = None, device: str = "auto",
                  batch_size: int | None = None) -> PassageEncoder:
    """The encoder `manifest` records, configured as it was (`model`: its folder, where it has moved)."""
    record = manifest.encoder
    return BiEncoder(model or record.path, device=device, batch_size=batch_size, backend=record.backend,
                     query_max_tokens=record.query_max_tokens, passage_max_tokens=record.passage_max_tokens,
                     query_segment_id=record.query_segment_id, passage_segment_id=record.passage_segment_id,
                     query_prefix=record.query_prefix, passage_prefix=record.passage_prefix)
