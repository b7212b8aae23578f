"""Library-level search over an index directory: `search(query, k)` and `batch_search(queries, k)`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from models.encoder import BiEncoder
from retrieval import dense_index
from retrieval.index_format import INDEX_FILE, PASSAGES_FILE, Manifest, read_manifest
from retrieval.passage_store import PassageStore

MAX_K = 1000
# The fields an encoder must share with the index it searches; names and token limits may differ.
MATCHED_FIELDS = ("dimension", "pooling", "similarity", "query_segment_id", "passage_segment_id", "weights_sha256")


@dataclass(frozen=True)
class Hit:
    id: str
    text: str
    score: float
    rank: int  # 1-based


class EncoderMismatch(ValueError):
    """The encoder is not the one the index was built with."""


def check_encoder(manifest: Manifest, encoder: BiEncoder) -> None:
    built, given = manifest.encoder.model_dump(), encoder.spec.to_dict()
    differences = [f"{f}: index {built[f]!r}, encoder {given[f]!r}" for f in MATCHED_FIELDS if built[f] != given[f]]
    if differences:
        raise EncoderMismatch(
            f"index built with encoder {manifest.encoder.name!r} does not match encoder "
            f"{encoder.spec.name!r} ({encoder.path}): " + "; ".join(differences)
        )


def encoder_for(manifest: Manifest, device: str = "auto", query_max_tokens: int | None = None) -> BiEncoder:
    """The encoder an index was built with, configured as it was (the query token limit may be changed)."""
    record = manifest.encoder
    return BiEncoder(
        record.path,
        device=device,
        query_max_tokens=query_max_tokens or record.query_max_tokens,
        passage_max_tokens=record.passage_max_tokens,
        query_segment_id=record.query_segment_id,
        passage_segment_id=record.passage_segment_id,
    )


def validate_k(k: int) -> None:
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k must be between 1 and {MAX_K}, got {k}")


class Searcher:
    """Encode -> exact inner-product search -> passages, sorted by score (ties by row)."""

    def __init__(
        self,
        index_dir: str | Path,
        encoder: BiEncoder | None = None,
        *,
        device: str = "auto",
        verify_checksums: bool = False,
    ) -> None:
        self.index_dir = Path(index_dir)
        self.manifest = read_manifest(self.index_dir, verify_checksums=verify_checksums)
        self.encoder = encoder if encoder is not None else encoder_for(self.manifest, device)
        check_encoder(self.manifest, self.encoder)
        self.index = dense_index.load_index(self.index_dir / INDEX_FILE, device)
        self.passages = PassageStore(self.index_dir / PASSAGES_FILE)

    @property
    def count(self) -> int:
        return self.manifest.count

    def search(self, query: str, k: int = 10) -> list[Hit]:
        return self.batch_search([query], k)[0]

    def batch_search(self, queries: Sequence[str], k: int = 10) -> list[list[Hit]]:
        validate_k(k)
        return self.retrieve(self.encoder.encode_queries(queries), k)

    def retrieve(self, query_vectors: np.ndarray, k: int) -> list[list[Hit]]:
        """Search already-encoded queries; one list of at most k hits per vector."""
        validate_k(k)
        scores, rows = dense_index.search(self.index, query_vectors, min(k, self.count))
        results = []
        for score_row, index_row in zip(scores, rows):
            keep = index_row >= 0
            found = self.passages.get(index_row[keep].tolist())
            results.append(
                [
                    Hit(id=pid, text=text, score=float(score), rank=rank)
                    for rank, ((pid, text), score) in enumerate(zip(found, score_row[keep]), start=1)
                ]
            )
        return results
