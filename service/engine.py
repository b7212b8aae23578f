"""The search engine: encode -> retrieve (-> rerank, once a reranker is configured) with per-stage
timings. Plain Python: the HTTP layer, tests and benchmarks all drive this same object."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from retrieval.index_format import INDEX_FILE, PASSAGES_FILE, read_manifest
from retrieval.searcher import EncoderMismatch, Hit, Searcher, encoder_for

STAGES = ("queue", "encode", "retrieve", "rerank", "total")


@dataclass
class StageTimings:
    """Milliseconds per stage; in a fused batch every request reports the batch's encode and retrieve."""

    queue: float = 0.0
    encode: float = 0.0
    retrieve: float = 0.0
    rerank: float = 0.0
    total: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {stage: round(getattr(self, stage), 3) for stage in STAGES}


@dataclass
class SearchResult:
    query: str
    hits: list[Hit]
    timings: StageTimings = field(default_factory=StageTimings)


class ReloadError(Exception):
    """The new index could not be loaded; the old one keeps serving."""


class SearchEngine:
    """Owns the current Searcher; `reload` swaps in another atomically (a search in flight keeps the one it took)."""

    def __init__(self, searcher: Searcher) -> None:
        self._searcher = searcher

    @classmethod
    def open(
        cls, index_dir: Path, *, device: str = "auto", query_max_tokens: int | None = None, verify_checksums: bool = True
    ) -> "SearchEngine":
        manifest = read_manifest(index_dir, verify_checksums=verify_checksums)
        encoder = encoder_for(manifest, device, query_max_tokens)
        return cls(Searcher(index_dir, encoder, device=device))

    @property
    def searcher(self) -> Searcher:
        return self._searcher

    def search(self, query: str, k: int) -> SearchResult:
        return self.search_batch([query], k)[0]

    def search_batch(self, queries: Sequence[str], k: int) -> list[SearchResult]:
        """All queries through one encoder forward pass and one FAISS search."""
        searcher = self._searcher
        started = time.perf_counter()
        vectors = searcher.encoder.encode_queries(queries)
        encoded = time.perf_counter()
        hits = searcher.retrieve(vectors, k)
        retrieved = time.perf_counter()
        timings = StageTimings(
            encode=1000 * (encoded - started),
            retrieve=1000 * (retrieved - encoded),
            total=1000 * (retrieved - started),
        )
        return [SearchResult(query, found, timings) for query, found in zip(queries, hits)]

    def warm_up(self) -> None:
        """A real query through every stage, so the first user request pays no lazy initialisation."""
        self.search("warm-up query", 1)

    def prepare(self, index_dir: Path, *, verify_checksums: bool = True) -> Searcher:
        """Load `index_dir` beside the serving one (reusing the current encoder where it matches).
        Safe to run while searches go on: it encodes nothing."""
        current = self._searcher
        device = current.encoder.device.type
        try:
            manifest = read_manifest(index_dir, verify_checksums=verify_checksums)
            try:
                return Searcher(index_dir, current.encoder, device=device)
            except EncoderMismatch:  # the new index was built with another model: load that one
                return Searcher(index_dir, encoder_for(manifest, device), device=device)
        except Exception as error:  # noqa: BLE001 - whatever failed, the old index must keep serving
            raise ReloadError(f"{index_dir}: {error}") from error

    def install(self, candidate: Searcher) -> None:
        """Warm `candidate` up with a real query, then make it the serving searcher in one assignment."""
        try:
            SearchEngine(candidate).warm_up()
        except Exception as error:  # noqa: BLE001
            raise ReloadError(f"{candidate.index_dir}: warm-up query failed: {error}") from error
        self._searcher = candidate

    def reload(self, index_dir: Path, *, verify_checksums: bool = True) -> None:
        """prepare + install; on ReloadError the old index keeps serving."""
        self.install(self.prepare(index_dir, verify_checksums=verify_checksums))

    def describe(self) -> dict:
        searcher = self._searcher
        manifest = searcher.manifest
        return {
            "index_dir": str(searcher.index_dir),
            "count": manifest.count,
            "index_bytes": sum(manifest.files[name].bytes for name in (INDEX_FILE, PASSAGES_FILE)),
            "model": manifest.encoder.name,
            "similarity": manifest.similarity,
            "dimension": manifest.dimension,
            "built_at": manifest.built_at,
        }
