"""The search engine: encode -> retrieve (-> rerank, where rerankers are configured) with per-stage
timings. Plain Python: the HTTP layer, tests and benchmarks all drive this same object."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from models.reranker import Reranker, load_reranker, reranker_kind
from retrieval.index_format import INDEX_FILE, PASSAGES_FILE, read_manifest
from retrieval.rerank import rerank
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
    score_kind: str  # what `Hit.score` is (see Searcher.score_kind and Reranker.score_kind)
    timings: StageTimings = field(default_factory=StageTimings)


class ReloadError(Exception):
    """The new index could not be loaded; the old one keeps serving."""


class SearchEngine:
    """Owns the current Searcher; `prepare` then `install` swap in another atomically (a search in flight
    keeps the one it took).
    With rerankers (by kind: monobert, coattention, generative), `rerank_depth` rescoring by one of
    them follows retrieval; the first one given is the default."""

    def __init__(self, searcher: Searcher, rerankers: dict[str, Reranker] | None = None,
                 query_max_tokens: int | None = None) -> None:
        self._searcher = searcher
        self.rerankers = dict(rerankers or {})
        self.query_max_tokens = query_max_tokens  # SEARCH_QUERY_MAX_TOKENS: kept for indexes loaded later

    @classmethod
    def open(
        cls, index_dir: Path, *, device: str = "auto", query_max_tokens: int | None = None,
        verify_checksums: bool = True, rerankers: Sequence[Path] = (),
    ) -> "SearchEngine":
        """`rerankers`: reranker folders (see models.reranker), at most one of each kind."""
        manifest = read_manifest(index_dir, verify_checksums=verify_checksums)
        encoder = encoder_for(manifest, device, query_max_tokens)
        loaded: dict[str, Reranker] = {}
        for folder in rerankers:
            kind = reranker_kind(folder)
            if kind in loaded:
                raise ValueError(f"two {kind} rerankers configured ({loaded[kind].name} and {folder}); keep one")
            loaded[kind] = load_reranker(folder, device=device)
        return cls(Searcher(index_dir, encoder, device=device), loaded, query_max_tokens)

    @property
    def searcher(self) -> Searcher:
        return self._searcher

    def search(self, query: str, k: int, **retrieval) -> SearchResult:
        return self.search_batch([query], k, **retrieval)[0]

    def search_batch(
        self, queries: Sequence[str], k: int, rerank_depth: int | None = None, reranker: str | None = None,
        **retrieval,
    ) -> list[SearchResult]:
        """All queries through one encoder forward pass and one search of each index; with
        `rerank_depth`, the top `rerank_depth` (>= k) are rescored by `reranker` (a kind; default:
        the first configured) and the best k kept. `retrieval`: mode, fusion, lead (see Searcher).
        ValueError for what cannot be served."""
        searcher = self._searcher
        depth = self.check_rerank(k, rerank_depth, reranker)
        searcher.check(depth, **retrieval)
        started = time.perf_counter()
        vectors = searcher.encode(queries) if retrieval.get("mode", "dense") != "bm25" else None
        encoded = time.perf_counter()
        hits = searcher.hits(searcher.rank(queries, vectors, depth, **retrieval))
        retrieved = time.perf_counter()
        score_kind = searcher.score_kind(**retrieval)
        if rerank_depth is not None:
            model = self.rerankers[reranker or self.default_reranker]
            hits = [rerank(model, query, found, k) for query, found in zip(queries, hits)]
            score_kind = model.score_kind
        reranked = time.perf_counter()
        timings = StageTimings(
            encode=1000 * (encoded - started),
            retrieve=1000 * (retrieved - encoded),
            rerank=1000 * (reranked - retrieved) if rerank_depth is not None else 0.0,
            total=1000 * (reranked - started),
        )
        return [SearchResult(query, found, score_kind, timings) for query, found in zip(queries, hits)]

    @property
    def default_reranker(self) -> str | None:
        return next(iter(self.rerankers), None)

    def check_rerank(self, k: int, rerank_depth: int | None, reranker: str | None = None) -> int:
        """The retrieval depth for a request; ValueError when it asks a reranker that is absent or
        a depth smaller than k."""
        if rerank_depth is None:
            return k
        if not self.rerankers:
            raise ValueError("rerank: no reranker is configured on this service")
        if reranker is not None and reranker not in self.rerankers:
            raise ValueError(f"reranker: {reranker!r} is not configured here; configured: {', '.join(self.rerankers)}")
        if rerank_depth < k:
            raise ValueError(f"rerank: depth {rerank_depth} is smaller than k {k}; rescore at least k passages")
        return rerank_depth

    def warm_up(self) -> None:
        """A real query through every stage, so the first user request pays no lazy initialisation."""
        self.search("warm-up query", 1)
        for name in self.rerankers:
            self.search("warm-up query", 1, rerank_depth=2, reranker=name)

    def prepare(self, index_dir: Path, *, verify_checksums: bool = True) -> Searcher:
        """Load `index_dir` beside the serving one (reusing the current encoder where it matches).
        Safe to run while searches go on: it encodes nothing."""
        current = self._searcher
        device = str(current.encoder.device)  # "cpu", "cuda" or "cuda:N": the device it was given
        try:
            manifest = read_manifest(index_dir, verify_checksums=verify_checksums)
            try:
                return Searcher(index_dir, current.encoder, device=device)
            except EncoderMismatch:  # the new index was built with another model: load that one
                return Searcher(index_dir, encoder_for(manifest, device, self.query_max_tokens), device=device)
        except Exception as error:  # noqa: BLE001 - whatever failed, the old index must keep serving
            raise ReloadError(f"{index_dir}: {error}") from error

    def install(self, candidate: Searcher) -> None:
        """Warm `candidate` up with a real query, then make it the serving searcher in one assignment."""
        try:
            SearchEngine(candidate, self.rerankers, self.query_max_tokens).warm_up()
        except Exception as error:  # noqa: BLE001
            raise ReloadError(f"{candidate.index_dir}: warm-up query failed: {error}") from error
        self._searcher = candidate

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
            "bm25": manifest.bm25 is not None,
            "rerankers": {kind: model.name for kind, model in self.rerankers.items()},
        }
