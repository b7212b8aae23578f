"""Request and response bodies of the HTTP API. Static bounds live here; limits that are
settings (query length, batch size, k) are checked against the settings in `limits`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.json_schema import SkipJsonSchema

from models.reranker import RERANKERS
from retrieval.candidates.structures import MAX_CANDIDATES
from retrieval.feedback import MAX_PASSAGES, MAX_WEIGHT, Feedback
from retrieval.filters import FIELD_OPERATORS, LOGICAL_OPERATORS
from retrieval.request import FUSIONS, MAX_K, Fusion, Mode
from retrieval.rerank import BLEND


def _integral(value):
    """A number without a fraction as an int (JSON Schema's integer: 195.0 is one); anything else as given,
    for the strict check to refuse (a string, a boolean)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


RerankerKind = Literal[tuple(RERANKERS)]
RERANKED = {reranker.score_kind: f"{kind}'s {reranker.score_meaning}" for kind, reranker in RERANKERS.items()}
ScoreKind = Literal[("cosine", "inner_product", "bm25", *FUSIONS, *RERANKED, BLEND)]
SCORE_KIND_DESCRIPTION = (
    "what `score` holds: cosine or inner_product (dense retrieval, by the encoder's similarity), bm25, "
    f"{', '.join(FUSIONS)} for hybrid fusion (interleave: 1 / position); when reranked, the reranker's score: "
    + ", ".join(f"{score_kind} ({meaning})" for score_kind, meaning in RERANKED.items())
    + f"; {BLEND} when reranked with a retrieval_weight: z(reranker) + retrieval_weight * z(first stage), each "
    "score standardised over the reranked passages"
)


MODE_DESCRIPTION = ("the retrieval that ran: the request's mode, or where it named none the default "
                    "(SEARCH_DEFAULT_MODE: hybrid where the index has BM25, dense otherwise)")


SEARCHED_DESCRIPTION = ("how the dense list was found: exact (every vector scanned; also bm25 mode) or "
                        "approximate:KIND (a candidate structure's candidates, each scored exactly)")


FILTER_DESCRIPTION = (
    "only passages whose metadata fields match, in the MongoDB-style grammar of Pinecone and Chroma: "
    '{"source": "pubmed"}, {"year": {"$gte": 2020}}, {"lang": {"$in": ["en", "de"]}}; operators '
    f"{' '.join(FIELD_OPERATORS)} on a field, {' '.join(LOGICAL_OPERATORS)} over filters; several keys mean all of "
    "them. The results "
    "are the top k among the matching passages, exactly; none match: no results. An unknown field, a value of "
    "another type than the field's or an unknown operator is a 422 naming it")


class FeedbackOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    passages: int = Field(ge=0, le=MAX_PASSAGES, description=(
        "how many of the even hybrid's top passages are taken as relevant; 0: no feedback"))
    weight: float = Field(1.0, ge=0, le=MAX_WEIGHT, description=(
        "their mean vector's weight, added to the query's before the dense list is searched again"))

    @field_validator("passages", mode="before")
    @classmethod
    def _whole(cls, value):
        return _integral(value)

    def feedback(self) -> Feedback | Literal[False]:
        return Feedback(self.passages, self.weight) if self.passages else False


class RetrievalOptions(BaseModel):
    # Strict types: `"candidates": "5"`, `"exact": "yes"` or `"fields": 1` is a 422 naming the field, not a guess;
    # an unknown key (`"fliter"`) a 422 naming it, not an unfiltered answer.
    model_config = ConfigDict(strict=True, extra="forbid")

    mode: Mode | None = Field(None, description="dense (bi-encoder), bm25 (exact match) or hybrid (both, fused); "
                              "default SEARCH_DEFAULT_MODE: hybrid where the index has BM25, dense otherwise")
    fusion: Fusion | None = Field(None, description="hybrid only: zscore (the mean of each passage's standardised "
                                  "dense and BM25 scores), rrf, or interleave (paper 000 eq. 6); default "
                                  "SEARCH_DEFAULT_FUSION: zscore")
    lead: Literal["dense", "bm25"] = Field("dense", description="hybrid interleave only: which list goes first")
    exact: bool = Field(False, description="scan every vector even where the index carries a candidate structure "
                                           "(an approximate answer's scores are exact either way)")
    candidates: int | None = Field(None, ge=1, le=MAX_CANDIDATES, description=(
        "with a candidate structure: how many candidates per query are scored exactly (default SEARCH_CANDIDATES, "
        "else the structure's own)"))
    dense_weight: float | None = Field(None, ge=0, le=1, description=(
        "hybrid zscore only: the dense list's weight in the fusion, BM25's being 1 - dense_weight (default "
        "SEARCH_DEFAULT_DENSE_WEIGHT: 0.5, the mean of the two)"))
    feedback: FeedbackOptions | None = Field(None, description=(
        "hybrid zscore only: pseudo-relevance feedback on the dense list (the query vector plus `weight` x the mean "
        "vector of the even hybrid's top `passages`, searched again and fused anew); default "
        "SEARCH_DEFAULT_FEEDBACK_PASSAGES and SEARCH_DEFAULT_FEEDBACK_WEIGHT (0 passages: none)"))
    filter: dict[str, Any] | None = Field(None, description=FILTER_DESCRIPTION)
    fields: list[str] | bool = Field(False, description=(
        "metadata fields to return with each hit (`fields` of a hit: those the passage has): a list of names, or "
        "true for all the index's fields (/ready lists them); default none. An unknown name is a 422"))

    @field_validator("k", "depth", "candidates", mode="before", check_fields=False)
    @classmethod
    def _whole(cls, value):
        return _integral(value)

    def retrieval(self) -> dict:
        return {"mode": self.mode, "fusion": self.fusion, "lead": self.lead, "exact": self.exact,
                "candidates": self.candidates, "filter": self.filter, "fields": self.fields,
                "dense_weight": self.dense_weight,
                "feedback": None if self.feedback is None else self.feedback.feedback()}


TRUNCATE = Field(True, description=(
    "cut a query past the index's query token limit (as text-embeddings-inference does); false: such a "
    "query is refused with 422 naming the limit and its token count"))


# Declared in the spec, checked by `limits.check_query` (whose message says more than a pattern's): a
# character that is not whitespace as Python's str.isspace has it (ECMA's \S differs, e.g. on U+001E).
NOT_BLANK = {"minLength": 1, "pattern": (
    "[^\\t\\n\\u000b\\f\\r\\u001c-\\u001f \\u0085\\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000]")}


ALLOW_PARTIAL = Field(False, description=(
    "sharded serving only: when a shard does not answer, return the other shards' results (the response's "
    "`shards` lists which answered) instead of a 503 naming it; ignored by a service over one index"))


RETRIEVAL_WEIGHT = Field(None, ge=0, le=100, description=(
    "when reranked: the first stage's weight beside the reranker's, w in z(reranker) + w * z(first stage), each "
    "score standardised over the reranked passages; 0: the reranker's order alone (default "
    "SEARCH_RERANK_RETRIEVAL_WEIGHT)"))


class ShardsReport(BaseModel):
    """Sharded serving only: the shards (as `i/N`) whose passages the results are drawn from."""

    answered: list[str]
    missing: list[str] = Field(description="shards that did not answer (only with allow_partial: true)")


class SearchRequest(RetrievalOptions):
    query: str = Field(description="free text; not empty, at most SEARCH_MAX_QUERY_CHARS characters",
                       json_schema_extra=NOT_BLANK)
    k: int = Field(10, ge=1, le=MAX_K, description="passages to return")
    truncate: bool = TRUNCATE
    rerank: bool = Field(False, description="rescore the top `depth` passages with the configured reranker")
    depth: int | None = Field(
        None, ge=1, le=MAX_K, description="passages the reranker rescores (default SEARCH_RERANK_DEPTH); "
        "below it, the rest of the k follow in retrieval order, with no rerank_score"
    )
    reranker: RerankerKind | None = Field(None, description="which configured reranker (default: the first)")
    retrieval_weight: float | None = RETRIEVAL_WEIGHT
    allow_partial: bool = ALLOW_PARTIAL


class BatchSearchRequest(RetrievalOptions):
    queries: list[str] = Field(min_length=1, description="at most SEARCH_MAX_BATCH_QUERIES queries",
                               json_schema_extra={"items": {"type": "string", **NOT_BLANK}})
    k: int = Field(10, ge=1, le=MAX_K)
    truncate: bool = TRUNCATE
    rerank: bool = False
    depth: int | None = Field(None, ge=1, le=MAX_K)
    reranker: RerankerKind | None = None
    retrieval_weight: float | None = RETRIEVAL_WEIGHT
    allow_partial: bool = ALLOW_PARTIAL


class SearchHit(BaseModel):
    id: str
    text: str
    score: float = Field(description="higher is better; its kind is the response's `score_kind` (below a rerank "
                                     "`depth` under k: the first stage's)")
    rank: int
    retrieval_score: float | None = Field(None, description="when reranked: the first-stage score")
    rerank_score: float | None = Field(None, description="when reranked: the reranker's score (also `score` "
                                                         "unless blended with a retrieval_weight); null below `depth`")
    fields: dict[str, bool | float | str | list[str]] | None = Field(
        None, description="only when the request asks `fields`: those the passage has, by name")


class Latency(BaseModel):
    """Milliseconds. `queue` is the wait for a micro-batch; `total` is queue + encode + retrieve + rerank."""

    queue: float
    encode: float
    retrieve: float
    rerank: float
    total: float


class SearchResponse(BaseModel):
    query: str
    results: list[SearchHit]
    mode: Mode = Field(description=MODE_DESCRIPTION)
    score_kind: ScoreKind = Field(description=SCORE_KIND_DESCRIPTION)
    latency_ms: Latency
    search: str = Field(description=SEARCHED_DESCRIPTION)
    shards: ShardsReport | None = Field(None, description="sharded serving only (absent otherwise)")


class BatchItem(BaseModel):
    query: str
    results: list[SearchHit]


class BatchSearchResponse(BaseModel):
    results: list[BatchItem]
    mode: Mode = Field(description=MODE_DESCRIPTION)
    score_kind: ScoreKind = Field(description=SCORE_KIND_DESCRIPTION)
    latency_ms: Latency
    search: str = Field(description=SEARCHED_DESCRIPTION)
    shards: ShardsReport | None = Field(None, description="sharded serving only (absent otherwise)")


class ReloadRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    index: str = Field(
        description="index directory, relative to SEARCH_INDEX_ROOT; a name outside it, or an unusable one, is "
        "a 422, a folder that is not there a 404",
        # The spec's promise: a plain folder name that fits any file system (63 characters of at most 4
        # UTF-8 bytes each, under the usual 255); the server also takes a path below the root.
        json_schema_extra={"pattern": "^[^/\\u0000]*[^/.\\u0000][^/\\u0000]*$", "maxLength": 63},
    )


class IndexInfo(BaseModel):
    index_dir: str
    generation: str  # the generation served (index_format.generation_id): each answer's X-Index-Generation
    count: int  # passages served, writes over HTTP included
    write_sequence: int = 0  # the last write over HTTP searched (SEARCH_WRITES); 0: none
    index_bytes: int
    model: str
    similarity: str
    dimension: int
    built_at: str
    bm25: bool
    backend: str  # what encodes the queries: torch, onnx or onnx-int8
    query_prefix: str = ""  # the index's: what the encoder puts before each query
    passage_prefix: str = ""  # and before each passage (/v1/embeddings with input_type passage)
    rerankers: dict[str, str]  # kind -> checkpoint folder name
    candidates: list[dict] = []  # the index's candidate structures with their recall cards (retrieval.candidates)
    fields: dict[str, str] = {}  # the passages' metadata fields a filter may name, with their types
    shards: list[str] | None = None  # sharded serving: the shards served, as i/N (absent over one index)


class Status(BaseModel):
    status: str
    detail: str | None = None
    index: IndexInfo | None = None


class Stats(BaseModel):
    queries_served: int
    window: int
    latency_ms: dict[str, dict[str, float]]
    rerank_ms: dict[str, dict[str, float]]  # per reranker kind
    index: IndexInfo


class EmbeddingsRequest(BaseModel):
    """OpenAI's embeddings request (input, model, encoding_format, dimensions, user: what its clients send);
    `input_type` as Cohere's API names it, and `truncate`. Any other key is a 422 naming it, as OpenAI refuses
    an unrecognized request argument."""

    model_config = ConfigDict(extra="forbid")

    input: Annotated[str, Field(json_schema_extra=NOT_BLANK)] | list[Annotated[str, Field(json_schema_extra=NOT_BLANK)]] = Field(
        description="a text or a list of texts (at most SEARCH_MAX_BATCH_QUERIES); "
                                   "each not empty, at most SEARCH_MAX_QUERY_CHARS characters")
    model: str | None = Field(None, description="accepted for compatibility; the served index's encoder answers")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: lists of numbers; base64: little-endian float32 bytes (the openai client's default)")
    input_type: Literal["query", "passage"] = Field(
        "query", description="encode as a query or as a passage (segment id and token limit of that kind)")
    truncate: bool = TRUNCATE
    dimensions: int | None = Field(None, ge=1, description="OpenAI's: only the encoder's own dimension is served "
                                                          "(the vectors are not shortened); any other is a 422")
    user: str | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingsUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingsUsage


class RerankDocument(BaseModel):
    text: str


class RerankRequest(BaseModel):
    """The rerank request text-embeddings-inference (`texts`, `return_text`) and Infinity or Cohere
    (`documents`, `top_n`, `return_documents`) accept."""

    query: str = Field(description="not empty, at most SEARCH_MAX_QUERY_CHARS characters", json_schema_extra=NOT_BLANK)
    # Exactly one of texts and documents (the spec says so with oneOf); neither may be null. Strict types.
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra={"oneOf": [{"required": ["texts"]},
                                                                                        {"required": ["documents"]}]})

    texts: list[str] | SkipJsonSchema[None] = Field(
        None, description="the passages to score (or `documents`); at most SEARCH_MAX_RERANK_DEPTH")
    documents: list[str | RerankDocument] | SkipJsonSchema[None] = Field(
        None, description="the passages to score, as strings or {text} (or `texts`); at most SEARCH_MAX_RERANK_DEPTH")
    top_n: int | None = Field(None, ge=1, description="return only the best top_n (default: all)")
    return_documents: bool = Field(False, description="include each passage's text (`document.text`)")
    return_text: bool = Field(False, description="the same, text-embeddings-inference's name")
    truncate: Literal[True] = Field(True, description="rerankers cut texts at their own token limits: only true")
    raw_scores: bool = Field(False, description="accepted for compatibility: scores are always the reranker's own")
    model: RerankerKind | None = Field(None, description="which configured reranker (default: the first)")

    @field_validator("top_n", mode="before")
    @classmethod
    def _whole(cls, value):
        return _integral(value)

    @field_validator("texts", "documents", mode="before")
    @classmethod
    def _not_null(cls, value):
        if value is None:
            raise ValueError("send a list of passages, or leave the field out")
        return value


class RerankResult(BaseModel):
    index: int = Field(description="the passage's position in the request")
    relevance_score: float = Field(description="the reranker's score (its kind: the response's `score_kind`)")
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    object: Literal["rerank"] = "rerank"
    model: str
    score_kind: ScoreKind = Field(description=SCORE_KIND_DESCRIPTION)
    results: list[RerankResult]


class UpsertRequest(BaseModel):
    """Passages to write, each a JSON object as a JSONL corpus line holds one: `id`, `text`, an optional `title`
    (put before the text, as a build does) and any metadata fields a filter may name."""

    model_config = ConfigDict(extra="forbid")

    passages: list[dict[str, Any]] = Field(
        min_length=1, description="at most SEARCH_MAX_WRITE_PASSAGES; each replaces the passage of its id where the "
        "collection holds one; the batch is written whole or not at all")


class DeleteRequest(BaseModel):
    """The passages to delete: by id, or those a filter matches (one of them)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"oneOf": [{"required": ["ids"]},
                                                                           {"required": ["filter"]}]})

    ids: list[str] | SkipJsonSchema[None] = Field(None, description="ids to delete (those not held are no change)")
    filter: dict[str, Any] | SkipJsonSchema[None] = Field(None, description=FILTER_DESCRIPTION)


class WriteResponse(BaseModel):
    seq: int = Field(description="the write's sequence number (the last write's, for a delete that deleted nothing)")
    upserted: int = 0
    deleted: int = 0
    count: int | None = Field(description="passages in the collection once the write is in (null for a scoped key)")


class PassageResponse(BaseModel):
    id: str
    text: str
    fields: dict[str, Any]
