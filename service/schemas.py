"""Request and response bodies of the HTTP API. Static bounds live here; limits that are
settings (query length, batch size, k) are checked against the settings in `limits`."""

from __future__ import annotations

from pydantic import BaseModel, Field

from retrieval.searcher import MAX_K


class SearchRequest(BaseModel):
    query: str = Field(description="free text; not empty, at most SEARCH_MAX_QUERY_CHARS characters")
    k: int = Field(10, ge=1, le=MAX_K, description="passages to return")
    rerank: bool = Field(False, description="rescore the top `depth` passages with the configured reranker")
    depth: int | None = Field(None, ge=1, le=MAX_K, description="passages the reranker rescores")


class BatchSearchRequest(BaseModel):
    queries: list[str] = Field(min_length=1, description="at most SEARCH_MAX_BATCH_QUERIES queries")
    k: int = Field(10, ge=1, le=MAX_K)


class Passage(BaseModel):
    id: str
    text: str
    score: float
    rank: int


class Latency(BaseModel):
    """Milliseconds. `queue` is the wait for a micro-batch; `total` is queue + encode + retrieve + rerank."""

    queue: float
    encode: float
    retrieve: float
    rerank: float
    total: float


class SearchResponse(BaseModel):
    query: str
    results: list[Passage]
    latency_ms: Latency


class BatchItem(BaseModel):
    query: str
    results: list[Passage]


class BatchSearchResponse(BaseModel):
    results: list[BatchItem]
    latency_ms: Latency


class ReloadRequest(BaseModel):
    index: str = Field(description="index directory, relative to SEARCH_INDEX_ROOT")


class IndexInfo(BaseModel):
    index_dir: str
    count: int
    index_bytes: int
    model: str
    similarity: str
    dimension: int
    built_at: str


class Status(BaseModel):
    status: str
    detail: str | None = None
    index: IndexInfo | None = None


class Stats(BaseModel):
    queries_served: int
    window: int
    latency_ms: dict[str, dict[str, float]]
    index: IndexInfo
