"""Every knob of the service in one typed object, read from `SEARCH_*` environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from models.backends import Backend


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SEARCH_", extra="ignore")

    index_dir: Path = Field(Path("indexes/demo"), description="index directory served at start-up")
    index_root: Path | None = Field(None, description="folder /admin/reload may load from (default: index_dir's parent)")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N, for the encoder and FAISS")
    backend: Backend | None = Field(
        None, description="the query encoder's: torch, or ONNX Runtime on the CPU (onnx; onnx-int8: int8 weights), "
        "exported once into $XDG_CACHE_HOME/dense-search/onnx; default: the one the index was built with",
    )
    query_max_tokens: int | None = Field(None, ge=1, description="override the index's query token limit")
    verify_checksums: bool = Field(True, description="check the index files' sha256 against the manifest on load")
    index_mmap: bool = Field(
        False, description="on the CPU, memory-map the index's vectors instead of reading them into the process: "
        "start-up reads no vectors (verify_checksums still reads the file once, into the page cache) and replicas "
        "on one host share them through the page cache; ignored on a GPU",
    )
    gpu_fp16: bool = Field(
        False, description="on a GPU, store the index's vectors as fp16: half the GPU memory, scores within about "
        "1e-4 of fp32 and nDCG@10 unchanged on Cranfield and SciFact (bench/fp16.py); ignored on the CPU",
    )
    rerankers: list[Path] = Field(
        default_factory=list,
        description="reranker folders as a JSON list, at most one per kind (monobert, coattention, generative); "
        "the first is the default; empty: no reranking",
    )
    rerank_depth: int = Field(100, ge=1, le=1000, description="passages rescored when a request gives no depth (at most max_rerank_depth)")
    max_rerank_depth: int = Field(1000, ge=1, le=1000, description="largest depth a request may ask for")

    max_query_chars: int = Field(
        20_000, ge=1, description="longest query accepted, in characters: an abuse guard only, since tokens "
        "past the query token limit are cut anyway (or refused with truncate: false)",
    )
    max_k: int = Field(1000, ge=1, le=1000, description="largest k accepted")
    max_batch_queries: int = Field(64, ge=1, description="most queries in one /search/batch request")
    max_body_bytes: int | None = Field(
        None, ge=1, description="largest request body accepted, in bytes (default: a full batch of maximal "
        "queries, each character written as a 6-byte JSON escape, plus 64 KiB)",
    )
    max_head_bytes: int = Field(
        32_768, ge=1024, description="largest request head (request line and headers) accepted, in bytes; past it, "
        "431 and the connection closed",
    )
    max_headers: int = Field(100, ge=1, description="most header lines in one request; past it, 431 and the connection closed")
    max_rerank_tokens: int = Field(
        65_536, ge=1, description="most tokens one /rerank request may make its reranker read (query and passage "
        "of every pair, after the reranker's own truncation); over it, 422",
    )
    api_key: SecretStr | None = Field(None, description="bearer key for every route but /health and /ready")
    open_docs: bool = Field(False, description="with a key: serve /docs, /redoc and /openapi.json without it")

    max_concurrent_requests: int = Field(
        512, ge=1, description="search requests in the service at once (queued or running); past it, 429 at once "
        "with Retry-After (text-embeddings-inference's max_concurrent_requests)",
    )
    retry_after_s: int = Field(1, ge=0, description="the Retry-After of a 429, in seconds")
    max_batch_tokens: int = Field(
        16_384, ge=1, description="most query tokens in one forward pass: a micro-batch stops short of it, and a "
        "/search/batch over it is refused (text-embeddings-inference's max_batch_tokens)",
    )
    read_timeout_s: float = Field(
        10.0, gt=0, description="longest wait for a request's head, and for each part of its body (408)",
    )
    write_timeout_s: float = Field(
        30.0, gt=0, description="longest a client may read nothing of its answer once the send buffers are "
        "full; then the connection is aborted, so unread answers do not pin memory",
    )

    microbatch: bool = Field(True, description="fuse concurrent /search requests into one forward pass")
    microbatch_window_ms: float = Field(
        2.0, ge=0, description="how long a lone request waits for others to join, while traffic overlaps"
    )
    microbatch_max: int = Field(64, ge=1, description="most requests fused into one batch")
    stats_window: int = Field(1000, ge=1, description="requests kept for /stats percentiles")
    gc_freeze: bool = Field(
        True, description="once an index is loaded (and after each reload), keep every object alive then out of "
        "Python's cyclic garbage collections (gc.freeze): a full one otherwise walks the model's 400,000 objects, "
        "a quarter of a second with the GIL held, stalling every request under load",
    )
    model_thread_nice: int = Field(
        10, ge=0, le=19, description="added to the nice value of the thread that runs the model, and of the OpenMP "
        "workers it starts (Linux, up to 19; the event loop keeps the process's own): on a busy host a forward pass "
        "then yields the cores to the loop, so accepting, refusing and answering requests does not wait for them",
    )
    shard_timeout_s: float = Field(
        10.0, gt=0, description="sharded serving (--ray): how long a search waits for every shard; a shard that has "
        "not answered by then fails the request with 503 naming it (or is listed as missing with allow_partial)",
    )

    access_log: bool = Field(
        False, description="log a line per request (uvicorn's access log); off by default because under load it "
        "costs about a tenth of the event loop's time, and /metrics already counts requests by route and status",
    )
    otlp_endpoint: str | None = Field(
        None, description="OTLP/HTTP traces URL (e.g. http://collector:4318/v1/traces; a bare http://host:4318 gets "
        "/v1/traces): a span per request, with queue, encode, retrieve and rerank under it; unset: no tracing",
    )
    service_name: str = Field("dense-search", min_length=1, description="service.name of the exported spans")
    allocator: Literal["auto", "jemalloc", "system"] = Field(
        "auto", description="malloc of `python -m service`: jemalloc (the process starts again with it preloaded: "
        "glibc's heap fragments under steady load and RSS grows), system (the C library's, or what LD_PRELOAD "
        "gives), or auto: jemalloc where it is installed (libjemalloc2) and LD_PRELOAD names nothing, else system; "
        "with --ray, of the ingress and shard replicas too",
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)

    @field_validator("api_key")
    @classmethod
    def _key_not_empty(cls, key: SecretStr | None) -> SecretStr | None:
        # An empty key would match a request without one: authentication silently off.
        if key is not None and not key.get_secret_value().strip():
            raise ValueError("is set but empty: set a key, or unset SEARCH_API_KEY to serve without one")
        return key

    @field_validator("otlp_endpoint")
    @classmethod
    def _endpoint_is_http(cls, endpoint: str | None) -> str | None:
        url = urlsplit(endpoint) if endpoint is not None else None
        if url is not None and (url.scheme not in ("http", "https") or not url.hostname):
            raise ValueError(f"{endpoint!r} is not an http(s) URL, e.g. http://collector:4318/v1/traces")
        return endpoint

    @property
    def body_limit(self) -> int:
        """max_body_bytes, or what a full /search/batch of queries at max_query_chars takes."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return self.max_batch_queries * self.max_query_chars * 6 + 65_536

    @property
    def reload_root(self) -> Path:
        return (self.index_root or self.index_dir.parent).resolve()

    def describe(self) -> str:
        """One line for the start-up log; the API key shows as '**********'."""
        return " ".join(f"{name}={value}" for name, value in self.model_dump().items())
