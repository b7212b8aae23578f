"""Library-level search over an index directory: `search(query, k)` and `batch_search(queries, k)`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple, Sequence, get_args

import faiss
import numpy as np

from models.backends import Backend
from models.checkpoint import resolve_device
from models.encoder import BiEncoder, Tokens
from retrieval import candidates, dense_index, filtered_search
from retrieval.bm25_index import BM25_DIR, Bm25Index
from retrieval.fields import chosen_fields
from retrieval.filters import Filter, parse_filter
from retrieval.fusion import interleave, reciprocal_rank_fusion, standardised_score_fusion
from retrieval.index_format import (
    INDEX_FILE,
    PASSAGES_FILE,
    IndexFormatError,
    Manifest,
    candidates_file,
    generation_id,
    read_manifest,
)
from retrieval.passage_store import PassageStore
from retrieval.pinned import PinnedFolder

MAX_K = 1000
MAX_CANDIDATES = candidates.MAX_CANDIDATES
log = logging.getLogger("retrieval")
Mode = Literal["dense", "bm25", "hybrid"]
Fusion = Literal["interleave", "rrf", "zscore"]
MODES: tuple[str, ...] = get_args(Mode)
FUSIONS: tuple[str, ...] = get_args(Fusion)
# The fields an encoder must share with the index it searches; names and token limits may differ.
MATCHED_FIELDS = ("dimension", "pooling", "similarity", "query_segment_id", "passage_segment_id", "weights_sha256",
                  "query_prefix", "passage_prefix")


@dataclass(frozen=True)
class Hit:
    id: str
    text: str
    score: float
    rank: int  # 1-based
    retrieval_score: float | None = None  # set when a reranker rescored the hit: its first-stage score
    rerank_score: float | None = None  # and the reranker's own (`score` is a blend of both where asked)


@dataclass(frozen=True)
class HitWithFields(Hit):
    """A Hit with the passage's metadata fields a search asked for (`fields`): those it has, by name."""

    fields: dict = field(default_factory=dict, hash=False)


class NoBm25Index(ValueError):
    """BM25 or hybrid retrieval asked of an index built without --bm25."""


class EncoderMismatch(ValueError):
    """The encoder is not the one the index was built with."""


def check_encoder(manifest: Manifest, encoder: BiEncoder) -> None:
    """EncoderMismatch unless `encoder` is the index's model; a warning where its ONNX export differs
    from the one that encoded the passages (another onnxruntime's int8 rounding, say)."""
    built, given = manifest.encoder.model_dump(), encoder.spec.to_dict()
    differences = [f"{f}: index {built[f]!r}, encoder {given[f]!r}" for f in MATCHED_FIELDS if built[f] != given[f]]
    if differences:
        raise EncoderMismatch(
            f"index built with encoder {manifest.encoder.name!r} does not match encoder "
            f"{encoder.spec.name!r} ({encoder.path}): " + "; ".join(differences)
        )
    record = manifest.encoder
    if encoder.backend == record.backend != "torch" and encoder.export_sha256 != record.export_sha256:
        log.warning("%s: the passages were encoded by a %s export with sha256 %s, the queries use one with %s",
                    manifest.encoder.name, record.backend, record.export_sha256, encoder.export_sha256)


def encoder_for(manifest: Manifest, device: str = "auto", query_max_tokens: int | None = None,
                backend: Backend | None = None) -> BiEncoder:
    """The encoder an index was built with, configured as it was, prefixes included (the query token
    limit and the backend may be changed)."""
    record = manifest.encoder
    if backend is None:  # the index's own, where it can run: an ONNX-built index served on a GPU uses torch
        backend = record.backend if resolve_device(device).type == "cpu" else "torch"
    return BiEncoder(
        record.path,
        device=device,
        backend=backend,
        query_max_tokens=query_max_tokens or record.query_max_tokens,
        passage_max_tokens=record.passage_max_tokens,
        query_segment_id=record.query_segment_id,
        passage_segment_id=record.passage_segment_id,
        query_prefix=record.query_prefix,
        passage_prefix=record.passage_prefix,
    )


def check_rows(index_dir: Path, manifest: Manifest, index, passages: PassageStore) -> None:
    """IndexFormatError unless the manifest, the FAISS index and the passage store agree on the rows
    (count, and rows 0 .. count - 1) and the vectors' dimension: a mismatch would serve short lists or 500s."""
    if index.d != manifest.dimension:
        raise IndexFormatError(f"{index_dir}: {INDEX_FILE} holds {index.d}-d vectors, the manifest says "
                               f"{manifest.dimension}-d")
    stored, low, high = passages.row_range()
    if not manifest.count == index.ntotal == stored or (stored and (low, high) != (0, stored - 1)):
        raise IndexFormatError(
            f"{index_dir}: the manifest counts {manifest.count} passages, {INDEX_FILE} holds {index.ntotal} "
            f"vectors and {PASSAGES_FILE} {stored} rows ({low} .. {high}); they must agree, rows 0 .. count - 1"
        )


def structures_served(device: str) -> bool:
    """Whether an index searched on `device` loads its candidate structures: on the CPU only, since a GPU
    scans every vector faster than a CPU structure proposes candidates. A GPU this faiss cannot use counts
    as the CPU here: dense_index.load_index says so, after the manifest's checks."""
    try:
        return not dense_index.stays_on_gpu(device)
    except RuntimeError:
        return True


def read_index_manifest(index_dir: Path, device: str, verify_checksums: bool) -> Manifest:
    """The index's manifest (index_format.read_manifest), with every file's checksum checked here (where
    `verify_checksums`) but those `load_index_data` checks from the bytes it loads: index.faiss, and the
    structures loaded on `device`."""
    structure_files = tuple(candidates_file(kind) for kind in candidates.KINDS) if structures_served(device) else ()
    return read_manifest(index_dir, verify_checksums=verify_checksums, hashed_on_load=(INDEX_FILE, *structure_files))


class IndexData(NamedTuple):
    index: faiss.Index  # the exact vectors
    passages: PassageStore
    structures: dict[str, candidates.Structure]  # by kind, in the manifest's order; none on a GPU


def load_index_data(index_dir: Path, manifest: Manifest, device: str, *, verify_checksums: bool,
                    mmap: bool | None = None, fp16: bool = False) -> IndexData:
    """The vectors, passages and candidate structures of the index whose manifest `read_index_manifest`
    read, loaded and checked as a Searcher serves them (`mmap`, `fp16`: see Searcher): the rows agree
    (check_rows), and each structure listed is the one of these vectors, its file checked from the bytes
    read where `verify_checksums` (candidates.load). IndexFormatError says what is wrong."""
    records = manifest.candidates if structures_served(device) else []
    files = manifest.files
    index = dense_index.load_index(index_dir / INDEX_FILE, device, mmap=mmap if mmap is not None else bool(records),
                                   fp16=fp16, expected=files[INDEX_FILE] if verify_checksums else None)
    passages = PassageStore(index_dir / PASSAGES_FILE)
    check_rows(index_dir, manifest, index, passages)
    structures = {record.kind: candidates.load(index_dir / record.file, record, index,
                                               files[record.file] if verify_checksums else None)
                  for record in records}
    return IndexData(index, passages, structures)


def pick_structure(structures: dict[str, candidates.Structure], exact: bool = False,
                   structure: str | None = None) -> candidates.Structure | None:
    """The structure a search answers through: None where `exact` or none is loaded, else `structure`'s
    kind (default: the first loaded); ValueError naming those loaded for a kind that is not."""
    if structure is not None and structure not in structures:
        raise ValueError(f"structure {structure!r} is not loaded (loaded: {', '.join(structures) or 'none'})")
    if exact or not structures:
        return None
    return structures[structure] if structure is not None else next(iter(structures.values()))


def check_candidates(depth: int | None) -> None:
    """ValueError unless `depth`, the candidates rescored per query, is None or within 1 .. MAX_CANDIDATES."""
    if depth is not None and not 1 <= depth <= MAX_CANDIDATES:
        raise ValueError(f"candidates must be between 1 and {MAX_CANDIDATES}, got {depth}")


def validate_k(k: int) -> None:
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k must be between 1 and {MAX_K}, got {k}")


def dense_score_kind(manifest: Manifest) -> str:
    """What a dense hit's score is: `cosine` or `inner_product`, as the encoder's similarity."""
    return "cosine" if manifest.similarity == "cosine" else "inner_product"


class Searcher:
    """Encode -> inner-product search (and/or BM25, fused) -> passages, sorted by score.

    `mode` picks the retriever: "dense" (the bi-encoder), "bm25" (exact match, when the index
    was built with --bm25) or "hybrid" (both, combined by `fusion`: "interleave", paper 000
    eq. 6, with `lead` deciding which list goes first; "rrf", reciprocal rank fusion over
    each list's top `fusion_depth`; or "zscore", the mean of each passage's standardised scores over
    the same lists).
    The dense list comes from the index's candidate structure where its manifest lists one and the
    vectors stay on the CPU (the first listed; `structure` names another): `candidates` rows per query
    proposed by it, then scored exactly from the stored vectors (retrieval.candidates.search), so every
    score is the exact one; `exact` asks for the full scan instead. `answered_by` says which was used.
    `mmap` memory-maps the vectors of an index kept on the CPU (None, the default: where a candidate
    structure is used, so the process holds the structure, not the vectors); `fp16` stores them as fp16
    on a GPU (see dense_index.load_index); each is ignored where it does not apply. Both are kept as
    attributes, as given, so an index loaded to replace this one can be loaded alike.
    `verify_checksums`: the vectors served are the bytes of index.faiss the manifest records, checked
    from what FAISS loads (dense_index.read_verified); the other files are hashed before they are opened
    (index_format.read_manifest), so a rewrite in between is not caught there."""

    def __init__(
        self,
        index_dir: str | Path,
        encoder: BiEncoder | None = None,
        *,
        device: str = "auto",
        verify_checksums: bool = False,
        mmap: bool | None = None,
        fp16: bool = False,
    ) -> None:
        self.index_dir = Path(index_dir)
        self.mmap, self.fp16 = mmap, fp16
        pinned = PinnedFolder(self.index_dir)  # every file below is opened through it, now: one generation
        with pinned.reading():
            self.manifest = read_index_manifest(pinned.root, device, verify_checksums)
            self.generation = generation_id(self.manifest)
            self.encoder = encoder if encoder is not None else encoder_for(self.manifest, device)
            check_encoder(self.manifest, self.encoder)  # before the vectors load
            self.index, self.passages, self.structures = load_index_data(
                pinned.root, self.manifest, device, verify_checksums=verify_checksums, mmap=mmap, fp16=fp16)
            self.bm25 = Bm25Index(pinned.path(BM25_DIR)) if self.manifest.bm25 is not None else None
            # The metadata fields as columns, read once, over which each filter is one vectorised mask.
            self.field_types = dict(self.manifest.fields)
            self.restrictions = filtered_search.Restrictions(self.passages.field_columns(self.field_types, self.count))
            self.scan = filtered_search.scan_index(self.index, pinned.path(INDEX_FILE), self.field_types)

    @property
    def count(self) -> int:
        return self.manifest.count

    def parse_filter(self, filter) -> Filter | None:
        """`filter` (as JSON gives it, or already parsed) checked against this index's fields; None for
        none. retrieval.filters.FilterError names what does not fit."""
        return None if filter is None else parse_filter(filter, self.field_types)

    def search(self, query: str, k: int = 10, **retrieval) -> list[Hit]:
        return self.batch_search([query], k, **retrieval)[0]

    def batch_search(self, queries: Sequence[str], k: int = 10, **retrieval) -> list[list[Hit]]:
        """One list of at most k hits per query; `retrieval`: mode, fusion, lead, fusion_depth, exact,
        candidates, structure, filter (see `rank`), and `fields`: the metadata fields to return with each
        hit (names, or True for all; see `hits`)."""
        fields = chosen_fields(retrieval.pop("fields", None), self.field_types)
        self.check(k, **retrieval)
        vectors = self.encode(queries) if retrieval.get("mode", "dense") != "bm25" else None
        return self.hits(self.rank(queries, vectors, k, **retrieval), fields)

    def check(self, k: int, mode: str = "dense", fusion: str = "interleave", lead: str = "dense",
              candidates: int | None = None, structure: str | None = None, filter=None, **_) -> None:
        """ValueError (NoBm25Index for a missing BM25, FilterError for a filter that does not fit) unless this
        index can serve the request."""
        validate_k(k)
        if mode not in MODES or fusion not in FUSIONS or lead not in ("dense", "bm25"):
            raise ValueError(f"mode must be one of {MODES}, fusion one of {FUSIONS}, lead dense or bm25")
        if mode != "dense" and self.bm25 is None:
            raise NoBm25Index(f"mode {mode!r} needs a BM25 index; {self.index_dir} was built without --bm25")
        check_candidates(candidates)
        pick_structure(self.structures, structure=structure)  # ValueError for a kind not loaded
        self.parse_filter(filter)

    def answered_by(self, exact: bool = False, structure: str | None = None, mode: str = "dense", filter=None,
                    **_) -> str:
        """How a request with these options (those of `rank`) is answered: "exact" (every vector scanned, or
        mode bm25, or a filter too selective for the structure: retrieval.filtered_search) or
        "approximate:KIND" (the dense list from a structure's candidates, scored exactly)."""
        chosen = self._structure(exact, structure)
        if chosen is None or mode == "bm25":
            return "exact"
        if filter is not None and not filtered_search.through_structure(self._restriction(filter), chosen):
            return "exact"
        return f"approximate:{chosen.kind}"

    def _restriction(self, filter) -> filtered_search.Restriction | None:
        return None if filter is None else self.restrictions.of(self.parse_filter(filter))

    def _structure(self, exact: bool, structure: str | None) -> candidates.Structure | None:
        return pick_structure(self.structures, exact, structure)

    def score_kind(self, mode: str = "dense", fusion: str = "interleave", **_) -> str:
        """What a hit's score is for a retrieval set-up: `cosine` or `inner_product` (dense, as the
        encoder's similarity), `bm25`, `rrf` (reciprocal rank fusion), `zscore` (the mean of standardised
        scores) or `interleave` (1 / position)."""
        if mode == "dense":
            return dense_score_kind(self.manifest)
        return "bm25" if mode == "bm25" else fusion

    def encode(self, queries: Sequence[str], tokens: Sequence[Tokens] | None = None) -> np.ndarray:
        """The queries' vectors; from `tokens` (the queries tokenized) where this encoder made them:
        an index reloaded since with another model tokenizes afresh."""
        return self.encoder.encode_texts(queries, tokens)

    def rank(
        self,
        queries: Sequence[str],
        vectors: np.ndarray | None,
        k: int,
        mode: Mode = "dense",
        fusion: Fusion = "interleave",
        lead: Literal["dense", "bm25"] = "dense",
        fusion_depth: int = MAX_K,
        exact: bool = False,
        candidates: int | None = None,
        structure: str | None = None,
        filter=None,
    ) -> list[list[tuple[int, float]]]:
        """(row, score) lists, best first; `vectors` are the encoded queries (unused for bm25).
        The dense list: exact where `exact` or no structure is loaded, else `structure`'s (default: the
        first loaded) `candidates` rows per query (default: its recorded depth; raised to the list's length,
        at most MAX_CANDIDATES) scored exactly; see `answered_by`. `filter` (retrieval.filters): only the
        passages it matches, the top k among them (in hybrid modes both lists filtered before fusion)."""
        self.check(k, mode, fusion, lead, candidates, structure, filter)
        chosen = self._structure(exact, structure)
        restriction = self._restriction(filter)
        if mode == "dense":
            return self._dense(vectors, k, chosen, candidates, restriction)
        if mode == "bm25":
            return self._bm25(queries, k, restriction)
        depth = k if fusion == "interleave" else max(k, min(fusion_depth, MAX_K))
        fused = []
        for dense, lexical in zip(self._dense(vectors, depth, chosen, candidates, restriction),
                                  self._bm25(queries, depth, restriction)):
            lists = [[row for row, _ in dense], [row for row, _ in lexical]]
            if fusion == "rrf":
                fused.append(reciprocal_rank_fusion(lists, k))
            elif fusion == "zscore":
                fused.append(standardised_score_fusion([dense, lexical], k))
            else:
                first, second = lists if lead == "dense" else lists[::-1]
                fused.append(interleave(first, second, k))
        return fused

    def _bm25(self, queries: Sequence[str], k: int,
              restriction: filtered_search.Restriction | None) -> list[list[tuple[int, float]]]:
        if restriction is None:
            return self.bm25.search(queries, k)
        return self.bm25.search_among(queries, k, restriction.mask)

    def _dense(self, vectors: np.ndarray, k: int, structure: candidates.Structure | None = None,
               depth: int | None = None,
               restriction: filtered_search.Restriction | None = None) -> list[list[tuple[int, float]]]:
        k = min(k, self.count)
        if restriction is not None:
            scores, rows = filtered_search.search(self.index, vectors, k, restriction, structure, depth, self.scan)
        elif structure is None or k == 0:
            scores, rows = dense_index.search(self.index, vectors, k)
        else:
            scores, rows = candidates.search(structure, self.index, vectors, k, depth)
        return [[(int(r), float(s)) for r, s in zip(row, score) if r >= 0] for row, score in zip(rows, scores)]

    def hits(self, ranked: list[list[tuple[int, float]]], fields: Sequence[str] | None = None) -> list[list[Hit]]:
        """Attach ids and texts to ranked rows; with `fields` (names), HitWithFields holding those each
        passage has."""
        results = []
        for ranking in ranked:
            rows = [row for row, _ in ranking]
            found = self.passages.get(rows)
            hits = [Hit(id=pid, text=text, score=score, rank=rank)
                    for rank, ((pid, text), (_, score)) in enumerate(zip(found, ranking), start=1)]
            results.append(hits if fields is None else with_fields(hits, self.passages.fields(rows), fields))
        return results


def with_fields(hits: Sequence[Hit], stored: Sequence[dict], fields: Sequence[str]) -> list[HitWithFields]:
    """`hits` with the `fields` (names) each passage's `stored` fields hold."""
    return [HitWithFields(**vars(hit), fields={name: values[name] for name in fields if name in values})
            for hit, values in zip(hits, stored)]
