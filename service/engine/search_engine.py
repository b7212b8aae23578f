"""The search engine: encode -> retrieve (-> rerank, where rerankers are configured) with per-stage
timings. Plain Python: the HTTP layer, tests and benchmarks all drive this same object."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from models.backends import Backend
from models.encoder import InputType, Tokens
from models.reranker import Reranker, load_reranker, reranker_kind
from retrieval.fields import UnknownField, chosen_fields
from retrieval.filters import Filter, FilterError, conjunction, parse_filter
from retrieval.index_format import INDEX_FILE, PASSAGES_FILE, Manifest, read_manifest
from retrieval.load_options import LoadOptions
from retrieval.request import Defaults, Retrieval
from retrieval.rerank import BLEND, rerank
from retrieval.scopes import scope_fields
from retrieval.searcher import EncoderMismatch, Hit, Searcher, encoder_for, own_backend, reranker_backend
from service.errors import NotServable, OverLimit
from service.settings import ServiceSettings

STAGES = ("queue", "encode", "retrieve", "rerank", "total")


@dataclass
class StageTimings:
    """Milliseconds per stage; in a fused batch every request reports the batch's encode and retrieve."""

    queue: float = 0.0
    encode: float = 0.0
    retrieve: float = 0.0
    rerank: float = 0.0
    total: float = 0.0
    # time.perf_counter() when the engine run began (encode's start; the stages follow one another):
    # where tracing places them in time. Not a stage: as_dict leaves it out.
    started_at: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {stage: round(getattr(self, stage), 3) for stage in STAGES}


@dataclass
class SearchResult:
    query: str
    hits: list[Hit]
    score_kind: str  # what `Hit.score` is (see Searcher.score_kind and Reranker.score_kind)
    timings: StageTimings = field(default_factory=StageTimings)
    batch_size: int = 1  # queries run together with it, itself included: its micro-batch, or its client's batch
    # Sharded serving only: {"answered": [...], "missing": [...]}, shards as "i/N"; None for one index.
    shards: dict[str, list[str]] | None = None
    searched: str = "exact"  # or "approximate:KIND" (Searcher.answered_by)
    generation: str = ""  # the index generation that answered (index_format.generation_id), all of it from one
    mode: str = "dense"  # the retrieval that ran (retrieval.request.Retrieval.mode)


@dataclass(frozen=True)
class SearchPlan:
    """A request checked once (`SearchEngine.plan`): the engine runs it without checking again, and
    the micro-batcher fuses requests of equal plans only (`fusing_key`)."""

    k: int
    # What the first stage retrieves (retrieval.request.Retrieval), checked against the index: its k is the
    # plan's `depth`. None in a plan made by hand: the dense exact default.
    retrieval: Retrieval | None = None
    rerank_depth: int | None = None  # with a reranker: passages rescored (the rest of k follow unscored)
    reranker: str | None = None  # a configured reranker's kind
    retrieval_weight: float = 0.0  # with a reranker: the first stage's weight in the blend (0: reranker alone)
    allow_partial: bool = False  # sharded serving: answer from the shards that answered (one index: no effect)

    def __post_init__(self) -> None:
        if self.retrieval is None:
            object.__setattr__(self, "retrieval", Retrieval(max(self.rerank_depth or 0, self.k)))

    @property
    def depth(self) -> int:
        """Passages retrieved: k, or the rerank depth where it is deeper."""
        return self.retrieval.k

    @property
    def mode(self) -> str:
        return self.retrieval.mode

    @property
    def fusing_key(self) -> "SearchPlan":
        # k included: FAISS and BM25 choose among passages tied at the k-th place (duplicate passages,
        # equal BM25 statistics) by k, so fused at a neighbour's larger k an answer could change with
        # whoever it was fused with. Equal plans give each request the answer it gets alone.
        return self


@contextmanager
def refusals():
    """The searcher's refusals as the service's: OverLimit for a filter or a field to return that does not fit
    the index, NotServable for anything else it cannot serve (a mode it lacks, say)."""
    try:
        yield
    except FilterError as error:
        raise OverLimit(("filter", *error.path), str(error)) from None
    except UnknownField as error:
        raise OverLimit(("fields", error.position), str(error)) from None
    except ValueError as error:
        raise NotServable(f"mode: {error}") from None


class ReloadError(Exception):
    """The new index could not be loaded; the old one keeps serving."""


def load_rerankers(folders: Sequence[Path], device: str, backend: Backend) -> dict[str, Reranker]:
    """Reranker folders by kind (see models.reranker), at most one of each kind, in the order given."""
    loaded: dict[str, Reranker] = {}
    for folder in folders:
        kind = reranker_kind(folder)
        if kind in loaded:
            raise ValueError(f"two {kind} rerankers configured ({loaded[kind].name} and {folder}); keep one")
        loaded[kind] = load_reranker(folder, device=device, backend=backend)
    return loaded


# A sent retrieval's answer: the hits per query and the shards that answered (None: one index).
Fetch = Callable[[], tuple[list[list[Hit]], dict | None]]


class Run:
    """A search between its stages (SearchEngine.start): encoded, retrieval sent. `wait` takes the hits
    (for shards, blocking until they answer, on any thread: `waits`); `finish` reranks where the plan
    asks (the model's work: `reranks`) and times every stage."""

    def __init__(self, engine: "SearchEngine", queries: list[str], plan: SearchPlan, searcher,
                 started: float, encoded: float, fetch: Fetch) -> None:
        self.engine, self.queries, self.plan = engine, queries, plan
        # All of the run is answered by the searcher (the generation) it started with.
        self.score_kind, self.generation = searcher.score_kind(plan.retrieval), searcher.generation
        self.searched = searcher.answered_by(plan.retrieval)
        self.started, self.encoded, self._fetch = started, encoded, fetch
        self.waits, self.reranks = engine.waits, plan.rerank_depth is not None
        self.hits: list[list[Hit]] = []
        self.shards: dict | None = None
        self.retrieved = encoded

    def wait(self) -> None:
        self.hits, self.shards = self._fetch()
        self.retrieved = time.perf_counter()

    def finish(self) -> list[SearchResult]:
        hits, score_kind, plan = self.hits, self.score_kind, self.plan
        reranking = time.perf_counter()  # after `wait`, once the model thread is free for it
        if self.reranks:
            model = self.engine.rerankers[plan.reranker]
            hits = [rerank(model, query, found, plan.k, plan.retrieval_weight, plan.rerank_depth)
                    for query, found in zip(self.queries, hits)]
            score_kind = BLEND if plan.retrieval_weight else model.score_kind
        reranked = time.perf_counter()
        timings = StageTimings(
            encode=1000 * (self.encoded - self.started),
            retrieve=1000 * (self.retrieved - self.encoded),
            rerank=1000 * (reranked - reranking) if self.reranks else 0.0,
            total=1000 * (reranked - self.started),
            started_at=self.started,
        )
        return [SearchResult(query, found, score_kind, timings, len(self.queries), self.shards, self.searched,
                             self.generation, mode=plan.mode)
                for query, found in zip(self.queries, hits)]

    def complete(self) -> list[SearchResult]:
        """`wait` then `finish`, here."""
        self.wait()
        return self.finish()


class SearchEngine:
    """Owns the current Searcher; `prepare` then `install` swap in another atomically (a search in flight
    keeps the one it took).
    With rerankers (by kind: models.reranker.RERANKERS), `rerank_depth` rescoring by one of
    them follows retrieval; the first one given is the default."""

    def __init__(self, searcher: Searcher, rerankers: dict[str, Reranker] | None = None,
                 query_max_tokens: int | None = None, backend: Backend | None = None) -> None:
        self._searcher = searcher
        self.rerankers = dict(rerankers or {})
        # SEARCH_QUERY_MAX_TOKENS and SEARCH_BACKEND (None: the index's own), kept for indexes loaded later.
        self.query_max_tokens, self.backend = query_max_tokens, backend

    @classmethod
    def open(
        cls, index_dir: Path, *, load: LoadOptions = LoadOptions(), query_max_tokens: int | None = None,
        rerankers: Sequence[Path] = (), backend: Backend | None = None, rerank_backend: Backend | None = None,
        defaults: Defaults = Defaults(), encodes_passages: bool = False,
    ) -> "SearchEngine":
        """`load`: how the index is loaded (retrieval.load_options; its device is the models' too); `defaults`:
        what a request naming no mode or fusion runs (retrieval.request.Defaults);
        `rerankers`: reranker folders (see models.reranker), at most one of each kind; `backend`: the query
        encoder's (default: retrieval.searcher.encoder_for's; the index's own where the engine
        `encodes_passages` for writes, so written passages are encoded as the others were);
        `rerank_backend`: a monoBERT reranker's (default: `backend` where given, else the index's own)."""
        manifest = read_manifest(index_dir)  # the Searcher verifies, from the bytes it loads
        if encodes_passages and backend is None:
            backend = own_backend(manifest, load.device)
        encoder = encoder_for(manifest, load.device, query_max_tokens, backend)
        loaded = load_rerankers(rerankers, load.device,
                                reranker_backend(manifest, load.device, backend, rerank_backend))
        return cls(Searcher(index_dir, encoder, load, defaults), loaded, query_max_tokens, backend)

    @classmethod
    def served(cls, settings: ServiceSettings) -> "SearchEngine":
        """The engine `python -m service` serves under `settings` (its index, models and defaults): the
        one place they are read, for the service and for offline evaluations that must answer as it does."""
        return cls.open(settings.index_dir, load=settings.load, query_max_tokens=settings.query_max_tokens,
                        rerankers=settings.rerankers, backend=settings.backend, rerank_backend=settings.rerank_backend,
                        defaults=settings.defaults, encodes_passages=settings.writes)

    @property
    def searcher(self) -> Searcher:
        return self._searcher

    def plan(self, k: int, *, rerank_depth: int | None = None, reranker: str | None = None,
             retrieval_weight: float = 0.0, max_rerank_depth: int | None = None, allow_partial: bool = False,
             scope: dict | None = None, **options) -> SearchPlan:
        """`k` hits retrieved by `options` (those of Searcher.request: mode, fusion, lead, exact, candidates,
        structure, filter, fields; TypeError for any other), with `rerank_depth` the top `rerank_depth`
        (<= `max_rerank_depth`; the rest of k follow in retrieval order) rescored by `reranker` (a kind; default:
        the first configured) and ordered by its score, or by its blend with the first stage's at
        `retrieval_weight` (retrieval.rerank.reordered), checked once: NotServable for what this service or its
        index cannot do, OverLimit for a value past a limit or not usable (a filter that does not fit the
        index's fields, a field to return it lacks). `allow_partial` matters to a sharded engine only. `scope`: a
        filter every hit must match besides the request's (an API key's: service/http/keys.py), ANDed with it."""
        if rerank_depth is not None:
            if not self.rerankers:
                raise NotServable("rerank: no reranker is configured on this service (set SEARCH_RERANKERS)")
            if reranker is not None and reranker not in self.rerankers:
                raise NotServable(f"reranker: {reranker!r} is not configured here; "
                                  f"configured: {', '.join(self.rerankers)}")
            if max_rerank_depth is not None and rerank_depth > max_rerank_depth:
                raise OverLimit(("depth",), f"depth={rerank_depth} is over the max_rerank_depth limit of "
                                            f"{max_rerank_depth} (SEARCH_MAX_RERANK_DEPTH)", rerank_depth)
            reranker = reranker or self.default_reranker
        with refusals():
            bound = None if scope is None else self._searcher.parse_filter(scope)
            if bound is not None:
                options = self._within_scope(bound, options)
            retrieval = self._searcher.request(max(rerank_depth or 0, k), **options)
            if bound is not None:
                retrieval = replace(retrieval, filter=conjunction(bound, retrieval.filter))
        return SearchPlan(k, retrieval, rerank_depth=rerank_depth, reranker=reranker, allow_partial=allow_partial,
                          retrieval_weight=retrieval_weight if rerank_depth is not None else 0.0)

    def _within_scope(self, scope: Filter, options: dict) -> dict:
        """`options` with their filter and fields checked against the fields `scope` sees (retrieval.scopes), so
        that a refusal names no field outside it, and `fields: true` meaning those. Over shards (which take no
        writes, so hold only an operator's fields) against the collection's."""
        searcher = self._searcher
        if not isinstance(searcher, Searcher):
            return options
        seen, checked = scope_fields(searcher, scope), dict(options)
        if options.get("filter") is not None:
            checked["filter"] = parse_filter(options["filter"], seen)
        if options.get("fields") is True:
            checked["fields"] = list(seen)
        elif options.get("fields"):
            chosen_fields(options["fields"], seen)
        return checked

    def evaluate_filter(self, plan: SearchPlan) -> None:
        """The plan's filter evaluated over the served index's rows now (kept in its Searcher's restrictions),
        so the search that runs the plan on the model thread finds the rows it matches already known."""
        if plan.retrieval.filter is not None:
            self._searcher.restrictions.of(plan.retrieval.filter)

    def tokenize(self, text: str, truncate: bool = True, field: tuple = ("query",),
                 input_type: InputType = "query") -> Tokens:
        """`text` tokenized for the serving encoder as a query (or passage); with `truncate` false, a
        text over its token limit is an OverLimit naming `field` instead of being cut."""
        encoder = self._searcher.encoder
        tokens = encoder.tokenize(text, input_type)
        limit = encoder.token_limit(input_type)
        if not truncate and tokens.count > limit:
            source = "query_max_tokens, or SEARCH_QUERY_MAX_TOKENS" if input_type == "query" else "passage_max_tokens"
            prefixed = f" with its prefix {encoder.prefix(input_type)!r}" if encoder.prefix(input_type) else ""
            raise OverLimit(field, f"{input_type} is {tokens.count} tokens{prefixed}, over the {input_type} token "
                                   f"limit of {limit} (the index's {source}); send truncate: true to cut it")
        return tokens

    def embed(self, texts: Sequence[str], tokens: Sequence[Tokens]) -> np.ndarray:
        """The serving encoder's vectors of `texts` (`tokens`: them tokenized by `tokenize`, all of one
        input type), as the index holds them: an index reloaded since tokenizes them afresh."""
        return self._searcher.encoder.encode_texts(texts, tokens, tokens[0].input_type)

    def reranker(self, kind: str | None = None) -> Reranker:
        """A configured reranker (a kind; default: the first): NotServable where none is configured or
        that kind is not."""
        if not self.rerankers:
            raise NotServable("no reranker is configured on this service (set SEARCH_RERANKERS)")
        if kind is not None and kind not in self.rerankers:
            raise NotServable(f"model: {kind!r} is not configured here; configured: {', '.join(self.rerankers)}")
        return self.rerankers[kind or self.default_reranker]

    def rescore(self, query: str, texts: Sequence[str], reranker: str | None = None) -> np.ndarray:
        """One score per text by a configured reranker (see `reranker`)."""
        return self.reranker(reranker).score(query, list(texts))

    def search(self, query: str, k: int, **options) -> SearchResult:
        return self.search_batch([query], k, **options)[0]

    def search_batch(self, queries: Sequence[str], k: int, **options) -> list[SearchResult]:
        """`run` with the plan of `k` and `options` (see `plan`)."""
        return self.run(queries, self.plan(k, **options))

    def run(self, queries: Sequence[str], plan: SearchPlan,
            tokens: Sequence[Tokens] | None = None) -> list[SearchResult]:
        """All queries through one encoder forward pass and one search of each index, then the
        rerank the plan asks for; `tokens`: the queries already tokenized (`tokenize`)."""
        return self.start(queries, plan, tokens).complete()

    def start(self, queries: Sequence[str], plan: SearchPlan, tokens: Sequence[Tokens] | None = None) -> Run:
        """`run` up to what other processes do for it: the queries encoded and their retrieval sent (for
        one index, done). The served engine calls it on the model thread and waits for the rest elsewhere."""
        searcher = self._searcher  # the run's one generation, whatever is swapped in meanwhile
        # The plan was checked against the index served when it was made; a reload may have come since.
        with refusals():
            retrieval = searcher.rebased(plan.retrieval)
        plan = plan if retrieval == plan.retrieval else replace(plan, retrieval=retrieval)
        started = time.perf_counter()
        vectors = searcher.encode(queries, tokens) if plan.retrieval.reads_dense else None
        encoded = time.perf_counter()
        return Run(self, list(queries), plan, searcher, started, encoded, self._send(searcher, queries, vectors, plan))

    def _send(self, searcher, queries: Sequence[str], vectors: np.ndarray | None, plan: SearchPlan) -> Fetch:
        """Retrieval begun, and the call that returns its hits and shards. One index is searched here, so
        the call only hands its hits over (`waits` is false)."""
        found = searcher.hits(searcher.rank(queries, vectors, plan.retrieval), plan.retrieval.fields), None
        return lambda: found

    # Whether `Run.wait` waits for other processes (shards): then it is worth running off the model thread.
    waits = False

    def answered_by(self, plan: SearchPlan) -> str:
        """How the plan's dense list is found: "exact" or "approximate:KIND" (see Searcher.answered_by)."""
        return self._searcher.answered_by(plan.retrieval)

    @property
    def default_reranker(self) -> str | None:
        return next(iter(self.rerankers), None)

    def warm_up(self) -> None:
        """A real query through every stage, so the first user request pays no lazy initialisation."""
        self.search("warm-up query", 1)
        for name in self.rerankers:
            self.search("warm-up query", 1, rerank_depth=2, reranker=name)

    def followed(self) -> tuple[Path, Manifest] | None:
        """The folder and manifest of the index served, which SEARCH_WATCH_INDEX follows."""
        return self._searcher.index_dir, self._searcher.manifest

    def prepare(self, index_dir: Path) -> Searcher:
        """Load `index_dir` beside the serving one, as it was loaded (reusing the current encoder where its
        model, backend and token limits match).
        Safe to run while searches go on: it encodes nothing."""
        current = self._searcher
        device = str(current.encoder.device)  # "cpu", "cuda" or "cuda:N": the device it was given
        try:
            manifest = read_manifest(index_dir)  # the Searcher verifies, from the bytes it loads
            record, spec = manifest.encoder, current.encoder.spec
            # The token limits are the new index's own (SEARCH_QUERY_MAX_TOKENS still overriding the query's).
            same_limits = spec.passage_max_tokens == record.passage_max_tokens and (
                self.query_max_tokens is not None or spec.query_max_tokens == record.query_max_tokens)
            # With no backend asked, an index built on the same backend gets the same default.
            same_backend = (current.encoder.backend == self.backend if self.backend is not None
                            else current.manifest.encoder.backend == record.backend)
            if same_limits and same_backend:
                try:
                    return Searcher(index_dir, current.encoder, current.load, current.defaults)
                except EncoderMismatch:  # the new index was built with another model: load that one
                    pass
            encoder = encoder_for(manifest, device, self.query_max_tokens, self.backend)
            return Searcher(index_dir, encoder, current.load, current.defaults)
        except Exception as error:  # noqa: BLE001 - whatever failed, the old index must keep serving
            raise ReloadError(f"{index_dir}: {error}") from error

    def install(self, candidate: Searcher) -> None:
        """Warm `candidate` up with a real query, then make it the serving searcher in one assignment."""
        try:
            SearchEngine(candidate, self.rerankers, self.query_max_tokens, self.backend).warm_up()
        except Exception as error:  # noqa: BLE001
            raise ReloadError(f"{candidate.index_dir}: warm-up query failed: {error}") from error
        self._searcher = candidate

    @property
    def write_sequence(self) -> int:
        """The last write over HTTP the serving searcher holds (retrieval.writes); 0 for none."""
        return self._searcher.segment.seq

    def serve(self, searcher: Searcher) -> None:
        """Make `searcher` (the served generation with writes over HTTP: retrieval.writes) the serving one, in one
        assignment."""
        self._searcher = searcher

    def describe(self) -> dict:
        searcher = self._searcher
        manifest = searcher.manifest
        return {
            "index_dir": str(searcher.index_dir),
            "generation": searcher.generation,
            "count": searcher.count,
            "write_sequence": self.write_sequence,
            "index_bytes": sum(manifest.files[name].bytes for name in (INDEX_FILE, PASSAGES_FILE)),
            "model": manifest.encoder.name,
            "similarity": manifest.similarity,
            "dimension": manifest.dimension,
            "built_at": manifest.built_at,
            "bm25": manifest.bm25 is not None,
            "backend": searcher.encoder.backend,
            "query_prefix": manifest.encoder.query_prefix,
            "passage_prefix": manifest.encoder.passage_prefix,
            "rerankers": {kind: model.name for kind, model in self.rerankers.items()},
            "candidates": self.candidate_cards(),
            "fields": dict(manifest.fields),
        }

    def candidate_cards(self) -> list[dict]:
        """The candidate structures in use, each with its recall card (retrieval.candidates)."""
        searcher = self._searcher
        return [record.model_dump() for record in searcher.manifest.candidates if record.kind in searcher.structures]
