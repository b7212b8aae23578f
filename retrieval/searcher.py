"""Library-level search over an index directory: `search(query, k)` and `batch_search(queries, k)`."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, Sequence

import numpy as np

from models.backends import Backend
from models.checkpoint import resolve_device
from models.encoder import BiEncoder, Tokens
from retrieval import bm25_changes, filtered_search
from retrieval.candidates.kind import Structure
from retrieval.dense import check_candidates, pick_structure
from retrieval.feedback import Feedback, fed_back
from retrieval.fields import chosen_fields
from retrieval.filters import Filter, parse_filter
from retrieval.fusion import FUSION_RULES, RowScores, as_pairs, standardised_row_fusion
from retrieval.generation import load_generation
from retrieval.index_format import Manifest
from retrieval.load_options import LoadOptions
from retrieval.request import FUSIONS, LEADS, MAX_K, MODES, Defaults, Fusion, Lead, Mode, Retrieval
from retrieval.segment import Change, Passage, Segment
from retrieval.segment_terms import ChangedTerms
from retrieval.write_log import Record

log = logging.getLogger("retrieval")
# The fields an encoder must share with the index it searches; names and token limits may differ.
MATCHED_FIELDS = ("dimension", "pooling", "similarity", "query_segment_id", "passage_segment_id", "weights_sha256",
                  "query_prefix", "passage_prefix")
# How far (relative to the norm) an ONNX fp32 query vector may lie from torch's for queries to be encoded on ONNX
# by default: float rounding lies near 1e-6, so this admits the same model and refuses a faulty export.
DRIFT_TOLERANCE = 1e-4


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
    """BM25 or hybrid retrieval asked of an index built with --no-bm25."""


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
    limit and the backend may be changed). `backend` None: the index's own where it can run (an
    ONNX-built index searched on a GPU uses torch), except that a torch-built index searched on the CPU
    encodes its queries with ONNX fp32, a forward pass about twice as fast, where the export gives
    torch's vectors on the probe queries (`prefer_onnx_queries`)."""
    record = manifest.encoder
    encoder = BiEncoder(
        record.path,
        device=device,
        backend=backend or own_backend(manifest, device),
        query_max_tokens=query_max_tokens or record.query_max_tokens,
        passage_max_tokens=record.passage_max_tokens,
        query_segment_id=record.query_segment_id,
        passage_segment_id=record.passage_segment_id,
        query_prefix=record.query_prefix,
        passage_prefix=record.passage_prefix,
    )
    if backend is None and record.backend == "torch" and encoder.device.type == "cpu":
        prefer_onnx_queries(encoder)
    return encoder


def own_backend(manifest: Manifest, device: str = "auto") -> Backend:
    """The backend the index's passages were encoded with, where it runs on `device` (else torch: an
    ONNX-built index searched on a GPU)."""
    return manifest.encoder.backend if resolve_device(device).type == "cpu" else "torch"


def reranker_backend(manifest: Manifest, device: str = "auto", backend: Backend | None = None,
                     rerank_backend: Backend | None = None) -> Backend:
    """A reranker's backend: `rerank_backend` where asked, else the queries' `backend` where asked, else the
    index's own (the default query backend's probe vouches for the query encoder only)."""
    return rerank_backend or backend or own_backend(manifest, device)


def prefer_onnx_queries(encoder: BiEncoder) -> None:
    """Switch `encoder` (on torch, on the CPU) to ONNX fp32 where its query vectors lie within
    DRIFT_TOLERANCE of torch's on the probe queries; else leave it on torch, saying why in a log line."""
    try:
        encoder.use_backend("onnx")
        drift = encoder.drift()
    except Exception as error:  # noqa: BLE001 - an export or a runtime that fails leaves torch, which works
        encoder.use_backend("torch")
        log.warning("%s: queries encoded with torch: the ONNX export failed (%s)", encoder.spec.name,
                    str(error) or type(error).__name__)
        return
    if drift > DRIFT_TOLERANCE:
        encoder.use_backend("torch")
        log.warning("%s: queries encoded with torch: ONNX's query vectors lie %.1e from torch's (tolerance %.0e)",
                    encoder.spec.name, drift, DRIFT_TOLERANCE)
        return
    log.info("%s: queries encoded with ONNX Runtime fp32 (within %.1e of torch's vectors)", encoder.spec.name, drift)


def validate_k(k: int) -> None:
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k must be between 1 and {MAX_K}, got {k}")


def dense_score_kind(manifest: Manifest) -> str:
    """What a dense hit's score is: `cosine` or `inner_product`, as the encoder's similarity."""
    return "cosine" if manifest.similarity == "cosine" else "inner_product"


class Searcher:
    """Encode -> inner-product search (and/or BM25, fused) -> passages, sorted by score.

    `mode` picks the retriever: "dense" (the bi-encoder), "bm25" (exact match, where the index
    has a BM25 index: built unless --no-bm25) or "hybrid" (both, combined by `fusion`: "interleave", paper 000
    eq. 6, with `lead` deciding which list goes first; "rrf", reciprocal rank fusion over
    each list's top `fusion_depth`; or "zscore", the mean of each passage's standardised scores over
    the same lists). A search naming no mode or fusion runs `defaults` (retrieval.request.Defaults: hybrid
    z-score where the index has BM25, dense otherwise).
    The dense list comes from the index's candidate structure where its manifest lists one and the
    vectors stay on the CPU (the first listed; `structure` names another): `candidates` rows per query
    proposed by it, then scored exactly from the stored vectors (retrieval.candidates.structures.search), so every
    score is the exact one; `exact` asks for the full scan instead. `answered_by` says which was used.
    `load`: how the index is loaded (retrieval.load_options), kept as an attribute so that an index loaded to
    replace this one is loaded alike (and `defaults` kept alike)."""

    def __init__(self, index_dir: str | Path, encoder: BiEncoder | None = None,
                 load: LoadOptions = LoadOptions(), defaults: Defaults = Defaults()) -> None:
        self.index_dir, self.load, self.defaults = Path(index_dir), load, defaults

        def take_encoder(manifest: Manifest) -> None:
            self.encoder = encoder if encoder is not None else encoder_for(manifest, load.device)
            check_encoder(manifest, self.encoder)

        loaded = load_generation(self.index_dir, load, before_vectors=take_encoder, bm25=True)
        self.manifest, self.passages, self.dense = loaded.manifest, loaded.passages, loaded.dense
        self.bm25 = loaded.bm25
        self.generation = loaded.generation_id
        self.field_types = dict(self.manifest.fields)
        # What writes over HTTP changed since the generation's rows: its sealed writes, replayed (none for most).
        self.segment = Segment(self.manifest.count, self.manifest.write_sequence)
        self.scope_counts: dict = {}  # per scope, the generation's rows holding each field (retrieval.scopes)
        if loaded.sealed:
            replayed = self.writable().with_writes(loaded.sealed)
            self.segment, self.field_types = replayed.segment, replayed.field_types
        self.sealed_size = self.segment.size  # what of the segment the generation holds (Segment.size)

    def with_segment(self, segment: Segment) -> "Searcher":
        """This generation with `segment` (its writes since) searched beside it: another Searcher sharing
        everything loaded; the fields the segment's passages add are known to its filters."""
        written = copy.copy(self)
        written.segment, written.field_types = segment, {**segment.types, **self.manifest.fields}
        return written

    def writable(self) -> "Searcher":
        """This searcher as writes start from it (retrieval.writes): its segment keeps the terms of what it
        changes where the generation has BM25 (whose own terms are derived here, before any write waits on them)."""
        if self.bm25 is None or self.segment.terms is not None:  # sealed writes were replayed with their terms
            return self
        self.base_terms()
        terms = ChangedTerms(lambda rows: [text for _, text in self.passages.get(list(rows))])
        return self.with_segment(Segment(self.manifest.count, self.segment.seq, terms=terms))

    def with_writes(self, records: Sequence[Record]) -> "Searcher":
        """This searcher with `records` (retrieval.write_log, in order) made by its segment, in one pass."""
        named = [item["id"] for record in records for item in record.upsert]
        named += [pid for record in records for pid in record.delete]
        changes = [Change(record.seq, tuple(Passage(**item) for item in record.upsert), record.vectors, record.delete)
                   for record in records]
        return self.with_segment(self.segment.applied(changes, self.passages.rows_of(list(dict.fromkeys(named)))))

    @property
    def index(self):
        """The exact vectors (see DenseIndex)."""
        return self.dense.index

    @property
    def structures(self) -> dict[str, Structure]:
        return self.dense.structures

    @property
    def restrictions(self) -> filtered_search.Restrictions:
        """Each filter's matching rows, over the fields' columns read once at load."""
        return self.dense.restrictions

    @property
    def count(self) -> int:
        """Passages in the collection: the generation's, changed by its segment."""
        return self.segment.count

    def live_rows(self, ids: Sequence[str]) -> dict[str, int]:
        """The collection row of each of `ids` it holds: a written passage's (retrieval.segment), else the
        generation's where the segment does not hide it."""
        segment, base_rows = self.segment, self.passages.rows_of(ids)
        found = {}
        for pid in ids:
            if pid in segment.by_id:
                found[pid] = segment.base_count + segment.by_id[pid]
            elif pid in base_rows and not segment.is_hidden(base_rows[pid]):
                found[pid] = base_rows[pid]
        return found

    def passages_with_fields(self, ids: Sequence[str]) -> list[HitWithFields]:
        """Those of `ids` the collection holds (rank from 1, score 0: not a search's hits) with all their fields."""
        (found,) = self.hits([[(row, 0.0) for row in self.live_rows(ids).values()]], tuple(self.field_types))
        return found

    def passage(self, pid: str) -> HitWithFields | None:
        """The passage `pid` with its fields; None where the collection does not hold it."""
        found = self.passages_with_fields([pid])
        return found[0] if found else None

    def parse_filter(self, filter) -> Filter | None:
        """`filter` (as JSON gives it, or already parsed) checked against this index's fields; None for
        none. retrieval.filters.FilterError names what does not fit."""
        return None if filter is None else parse_filter(filter, self.field_types)

    def search(self, query: str, k: int = 10, **options) -> list[Hit]:
        """`batch_search` of one query."""
        return self.batch_search([query], k, **options)[0]

    def batch_search(self, queries: Sequence[str], k: int = 10, **options) -> list[list[Hit]]:
        """One list of at most k hits per query; `options`: those of `request` (TypeError for any other)."""
        return self.run(queries, self.request(k, **options))

    def request(self, k: int = 10, *, mode: Mode | None = None, fusion: Fusion | None = None, lead: Lead = "dense",
                exact: bool = False, candidates: int | None = None, structure: str | None = None, filter=None,
                fields=None, fusion_depth: int = MAX_K, dense_weight: float | None = None,
                feedback: Feedback | Literal[False] | None = None) -> Retrieval:
        """A search of `k` passages per query (see retrieval.request.Retrieval), checked against this index:
        ValueError for what it cannot serve (NoBm25Index for a missing BM25, FilterError for a `filter` that
        does not fit its fields, UnknownField for a field to return it lacks). `mode`, `fusion`, `dense_weight`
        and `feedback`: None for this searcher's `defaults` (`feedback` False: none). `filter`: as JSON gives it, or
        parsed; `fields`: names, or True for all the index's fields."""
        validate_k(k)
        defaulted = mode is None
        mode, fusion = self.defaults.resolve(mode, fusion, self.bm25 is not None)
        if mode not in MODES or fusion not in FUSIONS or lead not in LEADS:
            raise ValueError(f"mode must be one of {MODES}, fusion one of {FUSIONS}, lead dense or bm25")
        self._servable(mode, structure)
        check_candidates(candidates)
        dense_weight = self.defaults.dense_weight if dense_weight is None else dense_weight
        if not 0 <= dense_weight <= 1:
            raise ValueError(f"dense_weight must be between 0 and 1, got {dense_weight}")
        return Retrieval(k, mode, fusion, lead, bool(exact), candidates, structure, self.parse_filter(filter),
                         chosen_fields(fields, self.field_types), fusion_depth, dense_weight=float(dense_weight),
                         feedback=self.defaults.feedback if feedback is None else feedback or None,
                         defaulted=defaulted)

    def rebased(self, retrieval: Retrieval) -> Retrieval:
        """`retrieval`, made against this index or one it has replaced since, as this index runs it: a mode
        left to the default is this index's default (hybrid where it has BM25, dense otherwise); then
        `check`ed."""
        if retrieval.defaulted:
            retrieval = replace(retrieval, mode=self.defaults.resolve(None, retrieval.fusion, self.bm25 is not None)[0])
        self.check(retrieval)
        return retrieval

    def check(self, retrieval: Retrieval) -> None:
        """ValueError (as `request`'s) unless this index can serve `retrieval`, made against it or against an
        index it has replaced since."""
        self._servable(retrieval.mode, retrieval.structure)
        if retrieval.filter is not None:
            retrieval.filter.check(self.field_types)
        if retrieval.fields is not None:
            chosen_fields(list(retrieval.fields), self.field_types)

    def _servable(self, mode: str, structure: str | None) -> None:
        """NoBm25Index where `mode` needs BM25 and this index has none; ValueError for a `structure` not loaded."""
        if mode != "dense" and self.bm25 is None:
            raise NoBm25Index(f"mode {mode!r} needs a BM25 index; {self.index_dir} has none (built with --no-bm25)")
        pick_structure(self.structures, structure=structure)

    def run(self, queries: Sequence[str], retrieval: Retrieval,
            tokens: Sequence[Tokens] | None = None) -> list[list[Hit]]:
        """Each query's hits by `retrieval` (made by `request`); `tokens`: the queries already tokenized."""
        vectors = self.encode(queries, tokens) if retrieval.reads_dense else None
        return self.hits(self.rank(queries, vectors, retrieval), retrieval.fields)

    def answered_by(self, retrieval: Retrieval) -> str:
        """How `retrieval` is answered: "exact" (every vector scanned, or mode bm25, or a filter too selective
        for the structure: retrieval.filtered_search) or "approximate:KIND" (the dense list from a structure's
        candidates, scored exactly)."""
        chosen = self._structure(retrieval)
        if chosen is None or retrieval.mode == "bm25":
            return "exact"
        restriction = self.generation_rows(retrieval.filter)
        if restriction is not None and not filtered_search.through_structure(restriction, chosen):
            return "exact"
        return f"approximate:{chosen.kind}"

    def _structure(self, retrieval: Retrieval) -> Structure | None:
        return pick_structure(self.structures, retrieval.exact, retrieval.structure)

    def score_kind(self, retrieval: Retrieval) -> str:
        """What a hit's score is: `cosine` or `inner_product` (dense, as the encoder's similarity), `bm25`,
        `rrf` (reciprocal rank fusion), `zscore` (the mean of standardised scores) or `interleave` (1 / position)."""
        if retrieval.mode == "dense":
            return dense_score_kind(self.manifest)
        return "bm25" if retrieval.mode == "bm25" else retrieval.fusion

    def encode(self, queries: Sequence[str], tokens: Sequence[Tokens] | None = None) -> np.ndarray:
        """The queries' vectors; from `tokens` (the queries tokenized) where this encoder made them:
        an index reloaded since with another model tokenizes afresh."""
        return self.encoder.encode_texts(queries, tokens)

    def rank(self, queries: Sequence[str], vectors: np.ndarray | None,
             retrieval: Retrieval) -> list[list[tuple[int, float]]]:
        """(row, score) lists, best first, by `retrieval` (see retrieval.request.Retrieval and `answered_by`);
        `vectors` are the encoded queries (unused for bm25). With a filter, only the passages it matches, the
        top k among them (in hybrid modes both lists filtered before fusion)."""
        k, chosen = retrieval.k, self._structure(retrieval)
        restriction = self.generation_rows(retrieval.filter)
        written = self.segment.matching(retrieval.filter)
        retrievers = {
            "dense": lambda depth: self._dense(vectors, depth, restriction, chosen, retrieval.candidates, written),
            "bm25": lambda depth: self._bm25(queries, depth, restriction, written),
        }
        if retrieval.mode in retrievers:
            return [as_pairs(found) for found in retrievers[retrieval.mode](k)]
        rule = FUSION_RULES[retrieval.fusion]  # hybrid: the two composed
        depth = max(k, min(retrieval.fusion_depth, MAX_K)) if rule.deep else k
        dense_lists, lexical_lists = retrievers["dense"](depth), retrievers["bm25"](depth)
        if retrieval.weighs:  # z-score: both lists as arrays to the end (standardised_row_fusion)
            feedback = retrieval.feedback
            if feedback is not None:  # searched again from the even hybrid's top passages (retrieval.feedback)
                relevant = [self.vectors_of([row for row, _ in standardised_row_fusion(dense, lexical,
                                                                                       feedback.passages)])
                            for dense, lexical in zip(dense_lists, lexical_lists)]
                dense_lists = self._dense(fed_back(vectors, relevant, feedback.weight), depth, restriction, chosen,
                                          retrieval.candidates, written)
            return [standardised_row_fusion(dense, lexical, k, retrieval.dense_weight)
                    for dense, lexical in zip(dense_lists, lexical_lists)]
        return [rule.fuse(as_pairs(dense), as_pairs(lexical), k, retrieval.lead)
                for dense, lexical in zip(dense_lists, lexical_lists)]

    def vectors_of(self, rows: Sequence[int]) -> np.ndarray:
        """The stored vectors of collection `rows` (the generation's, or its segment's written passages'), in
        their order: a (len(rows), dimension) float32 array."""
        base_count, rows = self.segment.base_count, np.asarray(rows, dtype=np.int64)
        out = np.empty((len(rows), self.manifest.dimension), dtype=np.float32)
        stored = rows < base_count
        if stored.any():
            out[stored] = self.index.reconstruct_batch(rows[stored])
        if not stored.all():
            out[~stored] = self.segment.vectors[rows[~stored] - base_count]
        return out

    def generation_rows(self, filter: Filter | None) -> filtered_search.Restriction | None:
        """The generation's rows a search reads: those `filter` matches (None: all), less those the segment
        hides; None for every row."""
        segment = self.segment
        matched = None if filter is None else self.restrictions.of(filter)
        if segment.hidden is None:
            return matched
        if matched is None:  # every unfiltered search of this segment reads the same rows
            return segment.made("unfiltered rows", lambda: filtered_search.Restriction(segment.base_mask(None)))
        return filtered_search.Restriction(segment.base_mask(matched.mask))

    def _dense(self, vectors: np.ndarray, k: int, restriction: filtered_search.Restriction | None,
               structure: Structure | None, candidates: int | None, written: np.ndarray) -> list[RowScores]:
        """The generation's dense lists, merged with the segment's `written` passages' (exact) ones."""
        scores, rows = self.dense.search_arrays(vectors, k, restriction, structure, candidates)
        found = [(row[row >= 0], score[row >= 0]) for row, score in zip(rows, scores)]
        if not written.any():
            return found
        merged = []
        for (base_rows, base_scores), (mine_rows, mine_scores) in zip(found, self.segment.dense(vectors, k, written)):
            rows, scores = np.concatenate([base_rows, mine_rows]), np.concatenate([base_scores, mine_scores])
            order = np.lexsort((rows, -scores))[:k]  # by score, equal scores by row
            merged.append((rows[order], scores[order]))
        return merged

    def _bm25(self, queries: Sequence[str], k: int, restriction: filtered_search.Restriction | None,
              written: np.ndarray) -> list[RowScores]:
        mask = None if restriction is None else restriction.mask
        segment = self.segment
        if segment.changes:  # the generation's BM25 and the segment's terms, scored over the live collection
            return bm25_changes.search(self.base_terms(), segment, queries, k, mask, written)
        return self.bm25.search_arrays(queries, k, mask)

    def base_terms(self) -> bm25_changes.BaseTerms:
        """What scoring BM25 beside writes reads of the generation's (retrieval.bm25_changes), derived once."""
        return bm25_changes.BaseTerms.of(self.bm25, self.passages.texts)

    def hits(self, ranked: list[list[tuple[int, float]]], fields: Sequence[str] | None = None) -> list[list[Hit]]:
        """Attach ids and texts to ranked rows; with `fields` (names), HitWithFields holding those each
        passage has."""
        results, base_count = [], self.segment.base_count
        for ranking in ranked:
            rows = [row for row, _ in ranking]
            stored = [row for row in rows if row < base_count]
            found = dict(zip(stored, self.passages.get(stored)))
            texts = [found[row] if row < base_count else self.segment.passage(row).id_and_text for row in rows]
            hits = [Hit(id=pid, text=text, score=score, rank=rank)
                    for rank, ((pid, text), (_, score)) in enumerate(zip(texts, ranking), start=1)]
            if fields is not None:
                values = dict(zip(stored, self.passages.fields(stored)))
                hits = with_fields(hits, [values[row] if row < base_count else self.segment.passage(row).fields
                                          for row in rows], fields)
            results.append(hits)
        return results


def with_fields(hits: Sequence[Hit], stored: Sequence[dict], fields: Sequence[str]) -> list[HitWithFields]:
    """`hits` with the `fields` (names) each passage's `stored` fields hold."""
    return [HitWithFields(**vars(hit), fields={name: values[name] for name in fields if name in values})
            for hit, values in zip(hits, stored)]
