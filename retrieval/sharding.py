"""One index split into `build --shard i/N` shards, searched apart and merged exactly.

Shard i of N holds the corpus records i, i + N, i + 2N, ... (`Shard`), each row with the corpus
line it came from. A whole index stores its rows in corpus line order (a build streams the file,
and `merge` restores that order), so the corpus line is the whole index's row order: merging the
shards' own top-k lists by score, ties by line (as dense_index.search ranks), gives the whole index's
top-k (`merge_top_k`).
`ShardIndex` is the search side of one shard directory, with the loading checks of a `Searcher`
but no encoder: it takes query vectors. A shard answers through its own candidate structure where the
caller names one: the candidates are scored exactly from the shard's stored vectors (retrieval.candidates),
so its list carries exact scores and the merge stays exact; only recall is approximate.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

from retrieval.dense import check_candidates, pick_structure
from retrieval.filters import Filter
from retrieval.generation import load_generation
from retrieval.index_format import MANIFEST_FILE, IndexFormatError, Manifest
from retrieval.load_options import LoadOptions


@dataclass(frozen=True)
class Shard:
    """Which records of a corpus one `build --shard i/N` job keeps. The records of a corpus are its lines
    that are neither blank nor the TSV header: its passages and its bad lines. Shard i of N keeps the records
    at positions i, i + N, i + 2N, ... (0-based, round-robin), so every job streams the same file, needs no
    coordination, and each bad line is reported (or, with --skip-bad, counted) by exactly one shard;
    index_builder.merge puts the shards' rows back in corpus line order."""

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


def shard_folder(out: str | Path, index: int) -> Path:
    """Where `build --shards N --out OUT` puts shard `index`."""
    return Path(out) / f"shard-{index}"


def expand_shard_dirs(directories: Sequence[str | Path]) -> list[Path]:
    """The directories given, with each folder that `build --shards N` wrote (no manifest of its own,
    `shard-0` inside) replaced by its shard-0 ... shard-{N-1}, so `--shards OUT` means all of them."""
    expanded = []
    for directory in map(Path, directories):
        if (directory / MANIFEST_FILE).exists() or not shard_folder(directory, 0).is_dir():
            expanded.append(directory)
            continue
        count = 0
        while shard_folder(directory, count).is_dir():
            count += 1
        expanded.extend(shard_folder(directory, i) for i in range(count))
    return expanded


class ShardHit(NamedTuple):
    """One passage a shard found: its score, its corpus line (the whole index's row order), id and text, and
    the metadata fields asked for (None: none asked)."""

    score: float
    line: int
    id: str
    text: str
    fields: dict | None = None


def merge_top_k(lists: Sequence[Sequence[ShardHit]], k: int) -> list[ShardHit]:
    """The top `k` of the shards' own top-k lists (each best first), as one flat index over all their
    passages ranks them (dense_index.search): by score, and among equal scores (duplicate passages) the
    earlier corpus line first, which also decides which of those tied at the k-th score are kept."""
    return heapq.nsmallest(k, (hit for hits in lists for hit in hits), key=lambda hit: (-hit.score, hit.line))


def build_identity(manifest: Manifest) -> str:
    """What tells one build of a shard from another: its manifest's own sha256 (read_manifest computes it for a
    format-1 manifest without one)."""
    return manifest.manifest_sha256


class OtherBuild(ValueError):
    """A shard replica holds another build than the one the ingress checked at start."""


def shard_agreement(manifest: Manifest) -> dict:
    """What every shard of one build must share. The encoder's path may differ from job to job; its weights may not."""
    encoder = manifest.encoder.model_dump(exclude={"path"})
    return {
        **{f"encoder {name}": value for name, value in encoder.items()},
        "corpus format": manifest.corpus.format,
        "corpus sha256": manifest.corpus.sha256,
        "--bm25": manifest.bm25 is not None,
    }


def check_shard_set(manifests: Sequence[tuple[str, Manifest]]) -> list[Shard]:
    """The `Shard` of each (name, manifest), once they are known to be all N shards of one build
    (one N, one encoder, one corpus file and format, each i once); ValueError names what is wrong."""
    if not manifests:
        raise ValueError("no shards given")
    found = []
    for name, manifest in manifests:
        if manifest.shard is None:
            raise ValueError(f"{name}: not a shard (its manifest names none; "
                             "build shards with --shard i/N or --shards N)")
        found.append(Shard.parse(manifest.shard))
    (first_name, first), first_shard = manifests[0], found[0]
    expected = shard_agreement(first)
    holders: dict[int, str] = {}
    for (name, manifest), shard in zip(manifests, found):
        if shard.count != first_shard.count:
            raise ValueError(f"{name} is shard {shard} but {first_name} is shard {first_shard}: N differs")
        for field, value in shard_agreement(manifest).items():
            if value != expected[field]:
                raise ValueError(f"{name}: {field} {value!r} differs from {first_name}'s {expected[field]!r}")
        if shard.index in holders:
            raise ValueError(f"{holders[shard.index]} and {name} are both shard {shard}")
        holders[shard.index] = name
    missing = [f"{i}/{first_shard.count}" for i in range(first_shard.count) if i not in holders]
    if missing:
        raise ValueError(f"shard {', '.join(missing)} missing (given {len(found)} of {first_shard.count})")
    return found


class ShardIndex:
    """One shard directory's vectors, passages and candidate structures, loaded and checked as a `Searcher`
    loads an index (retrieval.generation, with `load`: retrieval.load_options; a damaged or foreign structure is
    an IndexFormatError naming the reason); `search` takes encoded queries."""

    def __init__(self, index_dir: str | Path, load: LoadOptions = LoadOptions()) -> None:
        self.index_dir = Path(index_dir)
        loaded = load_generation(self.index_dir, load)
        if loaded.sealed:  # a shard searches its rows alone; writes over HTTP are served by one whole index
            raise IndexFormatError(f"{self.index_dir}: holds {len(loaded.sealed)} writes over HTTP sealed beside its "
                                   "rows, which a shard does not serve: serve it whole (python -m service)")
        self.manifest, self.passages, self.dense = loaded.manifest, loaded.passages, loaded.dense
        self.index, self.structures = self.dense.index, self.dense.structures

    def search(self, vectors: np.ndarray, k: int, build: str | None = None, *, structure: str | None = None,
               candidates: int | None = None, filter: Filter | None = None,
               fields: tuple[str, ...] | None = None) -> list[list[ShardHit]]:
        """This shard's top `k` per query vector, best first (fewer where the shard holds fewer).
        `build`: the `build_identity` the caller checked; OtherBuild if this folder now holds another
        (a replica started later, on another node or after the folder was replaced, loads what is there then).
        `structure`: the kind of a candidate structure loaded here to answer through, its `candidates` rows
        per query (default its recorded depth; at least k, at most the shard's rows) scored exactly
        (retrieval.candidates.structures.search); None, the default: the exact scan. The caller names it, so that every
        shard of a search answers alike. ValueError for a kind not loaded or candidates out of bounds.
        `filter` (parsed by the caller against the fields of every shard together): only the passages it
        matches, exactly (retrieval.filtered_search; a field this shard's passages never have is absent from
        each), the structure used only where the filter keeps enough rows; `fields`: the metadata fields to
        return with each hit."""
        if build is not None and build != build_identity(self.manifest):
            raise OtherBuild(f"{self.index_dir} holds another build of shard {self.manifest.shard} than the one "
                             f"checked at start (manifest sha256 {build_identity(self.manifest)[:12]}, expected "
                             f"{build[:12]}): deploy the new shards as a new application")
        check_candidates(candidates)
        chosen = pick_structure(self.structures, exact=structure is None, structure=structure)
        if min(k, self.manifest.count) == 0:
            return [[] for _ in range(len(vectors))]
        restriction = None if filter is None else self.dense.restrictions.of(filter)
        results = []
        for found in self.dense.search(vectors, k, restriction, chosen, candidates):
            records = self.passages.records([row for row, _ in found])
            stored = self.passages.fields([row for row, _ in found]) if fields is not None else [None] * len(found)
            results.append([ShardHit(score, line, pid, text, _chosen(values, fields))
                            for (_, score), (pid, text, line), values in zip(found, records, stored)])
        return results


def _chosen(stored: dict | None, fields: tuple[str, ...] | None) -> dict | None:
    return None if fields is None else {name: stored[name] for name in fields if name in stored}
