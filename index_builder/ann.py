"""`python -m index_builder ann` and `build --ann`: an approximate candidate structure (retrieval/candidates/)
over an index's stored vectors, with its recall card, added without encoding anything again.

On a published index the structure is written in a new generation beside it, `.NAME.ann/` (hard links to
the index's files, the new structure, the manifest resealed), swapped into place as a build is, under the
same `--out` lock. A HNSW build saves its graph there every few minutes; rerunning the same command
resumes it. `build --ann` adds it in the build's work folder, before the index is published. Given the
folder of a `build --shards N`, `ann` adds one to each shard in turn, over the shard's own vectors, as
`build --shards N --ann` does: a sharded service answers through each shard's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from index_builder.errors import BuildError
from retrieval import out_lock
from retrieval import index_writer
from retrieval.candidates.recall import HELD_OUT, RECALL_SAMPLE, RECALL_THRESHOLD
from retrieval.candidates.registry import KINDS, params_by_name
from retrieval.candidates.structures import MAX_CANDIDATES, structure_params
from retrieval.index_format import CandidateRecord, Manifest, read_manifest
from retrieval.readers import read_queries
from retrieval.sharding import check_shard_set, expand_shard_dirs


@dataclass
class AnnOptions:
    kind: str
    params: dict[str, int] = field(default_factory=dict)  # the kind's parameters set (retrieval/candidates/KIND.py)
    candidates: int | None = None  # rescored per query by default (default: the kind's)
    queries: Path | None = None  # recall measured on these queries, else on held-out passages
    sample: int = RECALL_SAMPLE
    recall_threshold: float = RECALL_THRESHOLD
    device: str = "auto"  # where --queries are encoded

    @classmethod
    def of(cls, kind: str, params: dict[str, int], **others) -> AnnOptions:
        """Options for a `kind` structure built again with a manifest's `params`: those the kind takes (not
        those it worked out from them at build, as pq's code bits)."""
        return cls(kind, {name: value for name, value in params.items() if name in KINDS[kind].params}, **others)

    def structure_params(self, manifest: Manifest | None = None) -> dict[str, int]:
        """The structure's parameters; BuildError for flags that do not apply to the kind, or (given the
        index's `manifest`) to its vectors."""
        known = params_by_name()
        try:
            params = structure_params(self.kind, self.params,
                                      label=lambda name: known[name][0].flag if name in known else name)
            if manifest is not None:
                KINDS[self.kind].check(KINDS[self.kind].chosen(params, manifest.count, manifest.dimension),
                                       manifest.dimension)
        except ValueError as error:
            raise BuildError(str(error)) from None
        if self.candidates is not None and not 1 <= self.candidates <= MAX_CANDIDATES:
            raise BuildError(f"--candidates must be between 1 and {MAX_CANDIDATES}, got {self.candidates}")
        if self.sample < 1:
            raise BuildError(f"--sample must be at least 1, got {self.sample}")
        return params


@dataclass
class AnnReport:
    index_dir: Path
    passages: int
    record: CandidateRecord
    bytes: int

    def summary(self) -> str:
        record = self.record
        return (f"{record.kind} over {self.index_dir}: {self.passages} passages in {record.seconds:.1f} s; "
                f"recall@10 {record.recall_at_10:.4f}, recall@100 {record.recall_at_100:.4f} "
                f"({record.sample} {record.recall_queries}, {record.depth} candidates); "
                f"{record.file} {self.bytes / 2**20:.1f} MiB")


def add_in_place(folder: Path, options: AnnOptions, progress: bool = True, published: Path | None = None,
                 queries: tuple[np.ndarray | None, str] | None = None) -> AnnReport:
    """Adds the structure to the finished, unpublished index in `folder` (see index_writer.write_candidates)
    and warns on stderr where its recall@10 is under the threshold, naming the flag that raises it and the
    index as `published` (where `folder` will be moved; default `folder`). `queries`: the recall queries
    already encoded, and their name (default: `_query_vectors`)."""
    params = options.structure_params(read_manifest(folder))
    query_vectors, name = queries or _query_vectors(folder, options)
    record = index_writer.write_candidates(folder, options.kind, params, depth=options.candidates,
                                           query_vectors=query_vectors, queries=name, sample=options.sample,
                                           progress=progress)
    if record.recall_at_10 < options.recall_threshold:
        hint = KINDS[record.kind].recall_hint(record.params, record.depth)
        print(f"warning: {published or folder}: {record.kind} recall@10 {record.recall_at_10:.4f} is under "
              f"{options.recall_threshold} (--recall-threshold): {hint}", file=sys.stderr)
    return AnnReport(published or folder, read_manifest(folder).count, record, (folder / record.file).stat().st_size)


def add_structure(index_dir: Path, options: AnnOptions, progress: bool = True,
                  queries: tuple[np.ndarray | None, str] | None = None) -> AnnReport:
    """`ann`: the structure added to the published index at `index_dir` as a new generation, swapped in
    atomically. BuildError while another build or `ann` writes `index_dir`; IndexFormatError for a folder
    that is not a whole index (every file's checksum is checked first). `queries`: see add_in_place."""
    options.structure_params()  # bad flags fail before the lock and the checksums
    with out_lock.hold(index_dir, "ann"):
        options.structure_params(read_manifest(index_dir, verify_checksums=True))
        work = index_dir.parent / f".{index_dir.name}.ann"
        checkpoint = index_writer.checkpoint_file(options.kind)
        index_writer.link_generation(index_dir, work, keep=(checkpoint, checkpoint + ".json"))
        report = add_in_place(work, options, progress, published=index_dir, queries=queries)
        index_writer.move_into_place(work, index_dir)
    return report


def add_structures(index_dir: Path, options: AnnOptions, progress: bool = True) -> list[AnnReport]:
    """`ann --index DIR`: [add_structure(DIR)] for an index; for the folder of a `build --shards N` (no
    manifest, shard-0 ... inside: retrieval.sharding.expand_shard_dirs), the structure added to each shard,
    over its own vectors, one shard after another under the folder's lock as well, once the folder is
    known to hold all N shards of one build (BuildError naming what is wrong). Each shard is swapped in as
    it is done: a run stopped midway leaves the shards before with the structure, which a sharded service
    does not use until every shard has it; rerunning the command finishes them (rebuilding those done)."""
    shards = expand_shard_dirs([index_dir])
    if shards == [index_dir]:
        return [add_structure(index_dir, options, progress)]
    options.structure_params()
    with out_lock.hold(index_dir, "ann"):
        try:
            check_shard_set([(str(shard), read_manifest(shard)) for shard in shards])
        except ValueError as error:
            raise BuildError(f"{index_dir} does not hold the shards of one build: {error}") from None
        queries = _query_vectors(shards[0], options)  # one encoder for every shard (check_shard_set)
        return [add_structure(shard, options, progress, queries) for shard in shards]


def _query_vectors(folder: Path, options: AnnOptions) -> tuple[np.ndarray | None, str]:
    """--queries encoded by the index's own encoder, and the file's name; (None, held-out) without it."""
    if options.queries is None:
        return None, HELD_OUT
    from retrieval.searcher import encoder_for  # only here: held-out passages need no model

    queries = read_queries(options.queries)
    if not queries:
        raise BuildError(f"{options.queries}: no queries")
    encoder = encoder_for(read_manifest(folder), options.device)
    return encoder.encode_queries(list(queries.values())), options.queries.name
