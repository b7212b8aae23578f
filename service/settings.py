"""Every knob of the service in one typed object, read from `SEARCH_*` environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from models.backends import Backend
from retrieval.fields import MAX_SCOPE_FIELDS
from retrieval.load_options import LoadOptions
from retrieval.feedback import MAX_PASSAGES, MAX_WEIGHT, Feedback
from retrieval.request import EVEN_WEIGHT, MODES, Defaults, Fusion


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SEARCH_", extra="ignore")

    index_dir: Path = Field(Path("indexes/demo"), description="Index directory served at start-up.")
    index_root: Path | None = Field(
        None, description="The only folder /admin/reload may load an index from; unset: index_dir's parent.",
    )
    watch_index: bool = Field(
        False, description="Watch the served index's folder (index_dir, or the one /admin/reload last loaded) and "
        "reload it when a new generation is swapped in there (by build --overwrite, build --update, update or ann), "
        "as /admin/reload does: warmed up first, the old one serving until then and kept, with the reason in "
        "/ready, if the new one fails to load.",
    )
    watch_interval_s: float = Field(
        2.0, gt=0, description="With watch_index, how often index_dir's manifest is read, in seconds.",
    )
    device: str = Field("auto", description="Where the encoder and FAISS run: auto, cpu, cuda or cuda:N.")
    backend: Backend | None = Field(
        None, description="The query encoder's backend: torch, or ONNX Runtime on the CPU (onnx; onnx-int8: int8 "
        "weights), exported once into $XDG_CACHE_HOME/dense-search/onnx; unset: the one the index was built with, "
        "except that a torch-built index on the CPU encodes queries on onnx where its vectors equal torch's on probe "
        "queries checked at load (an instance with writes keeps the index's own, for the passages it encodes).",
    )
    rerank_backend: Backend | None = Field(
        None, description="The monoBERT reranker's backend (torch, onnx or onnx-int8), apart from the query "
        "encoder's: int8 reranking beside full-precision queries; unset: SEARCH_BACKEND where set, else the one the "
        "index was built with.",
    )
    query_max_tokens: int | None = Field(
        None, ge=1, description="Query token limit in place of the index's own; unset: the index's.",
    )
    verify_checksums: bool = Field(
        True, description="Check the index files' sha256 against the manifest on load and on reload.",
    )
    index_mmap: bool = Field(
        False, description="On the CPU, memory-map the index's vectors instead of reading them into the process, "
        "so replicas on one host share them through the page cache; ignored on a GPU.",
    )
    gpu_fp16: bool = Field(
        False, description="On a GPU, store the index's vectors as fp16, in half the GPU memory; ignored on the CPU.",
    )
    rerankers: list[Path] = Field(
        default_factory=list,
        description="Reranker folders as a JSON list, at most one per kind (models.reranker.RERANKERS: monobert, "
        "coattention, generative), the first being the default; empty: no reranking.",
    )
    rerank_depth: int = Field(
        100, ge=1, le=1000, description="Passages rescored when a request gives no depth (at most max_rerank_depth).",
    )
    max_rerank_depth: int = Field(1000, ge=1, le=1000, description="Largest depth a request may ask for.")
    rerank_retrieval_weight: float = Field(
        0.0, ge=0, le=100, description="Weight of the first stage's score beside the reranker's when a request "
        "gives none: reranked passages are ordered by z(reranker) + w * z(first stage), each standardised over "
        "them; 0: by the reranker's score alone.",
    )

    default_mode: Literal["auto", *MODES] = Field(
        "auto", description="The retrieval of a request that names no mode: auto is hybrid where the index has a "
        "BM25 index and dense otherwise; dense, bm25 or hybrid for that one (an index that cannot serve it is not "
        "loaded).",
    )
    default_fusion: Fusion = Field(
        "zscore", description="How hybrid fuses its two lists when a request names no fusion: zscore, rrf or "
        "interleave.",
    )
    default_dense_weight: float = Field(
        EVEN_WEIGHT, ge=0, le=1, description="Hybrid zscore: the dense list's weight in the fusion where a request "
        "names none (BM25's: 1 minus it); 0.5 is the mean of the two.",
    )
    default_feedback_passages: int = Field(
        0, ge=0, le=MAX_PASSAGES, description="Hybrid zscore: pseudo-relevance feedback where a request names "
        "none: the even hybrid's top this many passages taken as relevant and the dense list searched again "
        "(retrieval.feedback); 0: none.",
    )
    default_feedback_weight: float = Field(
        1.0, ge=0, le=MAX_WEIGHT, description="Hybrid zscore: the feedback passages' mean vector's weight, added to "
        "the query's, where a request names none (with SEARCH_DEFAULT_FEEDBACK_PASSAGES over 0).",
    )

    exact_search: bool = Field(
        False, description="Answer every search by the full scan, even over an index that carries a candidate "
        "structure (a request may ask it with exact: true).",
    )
    candidates: int | None = Field(
        None, ge=1, le=10_000, description="Candidates per query a structure proposes and the service scores "
        "exactly, unless a request says; unset: the structure's own depth, recorded in the manifest.",
    )

    max_query_chars: int = Field(
        20_000, ge=1, description="Longest query accepted, in characters: an abuse guard only, since tokens past "
        "the query token limit are cut anyway (or refused with truncate: false).",
    )
    max_k: int = Field(1000, ge=1, le=1000, description="Largest k accepted.")
    max_batch_queries: int = Field(64, ge=1, description="Most queries in one /search/batch request.")
    max_body_bytes: int | None = Field(
        None, ge=1, description="Largest request body accepted, in bytes; unset: a full batch of maximal queries, "
        "max_batch_queries x max_query_chars x 6 (each character a JSON escape) plus 64 KiB.",
    )
    max_head_bytes: int = Field(
        32_768, ge=1024, description="Largest request head (request line and headers) accepted, in bytes; past it, "
        "431 and the connection closed.",
    )
    max_headers: int = Field(
        100, ge=1, description="Most header lines in one request; past it, 431 and the connection closed.",
    )
    max_rerank_tokens: int = Field(
        65_536, ge=1, description="Most tokens one /rerank request may make its reranker read (query and passage "
        "of every pair, after the reranker's own truncation); over it, 422.",
    )
    writes: bool = Field(
        False, description="Take writes over HTTP (POST /passages, POST /passages/delete, GET /passages/{id}), each "
        "logged beside index_dir and fsynced before it is answered and searched at once; one instance per index, "
        "and not with watch_index.",
    )
    max_write_passages: int = Field(256, ge=1, description="Most passages in one POST /passages.")
    write_share: float = Field(
        0.25, gt=0, le=1, description="With writes, the most of the model thread's time that encoding written "
        "passages takes while searches are queued or running (with none waiting, writes take all of it): lower "
        "slows searches less under a stream of writes and the writes more under search load.",
    )
    max_scope_fields: int = Field(
        MAX_SCOPE_FIELDS, ge=1, description="With writes and a keys file: most metadata fields the live passages "
        "inside one key's scope may hold (a field counts while one of them holds it); a scoped write is never "
        "refused for fields other scopes hold.",
    )
    compact_passages: int = Field(
        10_000, ge=1, description="With writes, a compaction (the written passages folded into a new generation of "
        "the index, swapped in for replicas to follow, and the log truncated) starts once this many passages were "
        "written or deleted since the last.",
    )
    merge_share: float = Field(
        0.05, ge=0, le=1, description="With writes, a compaction seals the writes beside the index's rows (a new "
        "generation linking the old one's files and holding the writes themselves: its cost follows the writes) "
        "until they hold this share of the rows, then merges them in (every row written again, the candidate "
        "structures extended); 0: merge every time.",
    )
    compact_age_s: float = Field(
        300.0, gt=0, description="With writes, a compaction starts once the oldest write not yet compacted is this "
        "many seconds old.",
    )
    max_write_tokens: int = Field(
        65_536, ge=1, description="Most passage tokens one POST /passages may have encoded (each passage cut at the "
        "index's passage token limit first); over it, 422.",
    )
    api_key: SecretStr | None = Field(
        None, description="Bearer key required on every route but /health and /ready; unset: no key is asked for.",
    )
    api_keys_file: Path | None = Field(
        None, description="A JSON file of scoped API keys (name, key_sha256, routes, filter: docs/serving.md#keys), "
        "re-read when it changes; unset: only api_key.",
    )
    open_docs: bool = Field(False, description="With a key, serve /docs, /redoc and /openapi.json without it.")

    max_concurrent_requests: int = Field(
        512, ge=1, description="Search requests in the service at once, queued or running; past it, 429 at once "
        "with Retry-After (text-embeddings-inference's max_concurrent_requests).",
    )
    retry_after_s: int = Field(1, ge=0, description="The Retry-After of a 429, in seconds.")
    max_batch_tokens: int = Field(
        16_384, ge=1, description="Most query tokens in one forward pass: a micro-batch stops short of it, and a "
        "/search/batch over it is refused (text-embeddings-inference's max_batch_tokens).",
    )
    read_timeout_s: float = Field(
        10.0, gt=0, description="Longest wait, in seconds, for a request's head and for each part of its body (408).",
    )
    write_timeout_s: float = Field(
        30.0, gt=0, description="Longest a client may read nothing of its answer once the send buffers are full, "
        "in seconds, before its connection is aborted so that unread answers do not pin memory.",
    )

    microbatch: bool = Field(True, description="Fuse concurrent /search requests into one forward pass.")
    microbatch_window_ms: float = Field(
        2.0, ge=0, description="How long a lone request waits for others to join, in milliseconds, while traffic "
        "overlaps.",
    )
    microbatch_max: int = Field(64, ge=1, description="Most requests fused into one batch.")
    gc_freeze: bool = Field(
        True, description="Once an index is loaded (and after each reload), exempt every object then alive from "
        "Python's cyclic garbage collection (gc.freeze), so that a full collection does not walk the model's "
        "objects with the GIL held while requests wait.",
    )
    model_thread_nice: int = Field(
        10, ge=0, le=19, description="Added to the nice value (Linux, up to 19) of the thread that runs the model "
        "and of the OpenMP workers it starts, so that on a busy host a forward pass yields the cores to the event "
        "loop accepting, refusing and answering requests.",
    )
    shard_timeout_s: float = Field(
        10.0, gt=0, description="Sharded serving (--ray) only: how long, in seconds, a search waits for every "
        "shard before failing with 503 naming the one that did not answer (or listing it as missing with "
        "allow_partial).",
    )
    drain_timeout_s: float = Field(
        25.0, gt=0, description="How long, in seconds, a stop (Ctrl-C, SIGTERM) lets the requests in the service "
        "(with --ray, in the ingress replicas) be answered while it takes no new ones, before it exits (a request "
        "still in it then is cut off): keep it under the grace period of whatever sends SIGTERM (docker stop's 10 s "
        "unless stop_grace_period says more, Kubernetes' terminationGracePeriodSeconds).",
    )

    access_log: bool = Field(
        False, description="Log a line per request (uvicorn's access log); off by default, since /metrics already "
        "counts requests by route and status.",
    )
    otlp_endpoint: str | None = Field(
        None, description="OTLP/HTTP URL to export a span per request to, with queue, encode, retrieve and rerank "
        "under it (e.g. http://collector:4318/v1/traces; a bare http://host:4318 gets /v1/traces); unset: no "
        "tracing.",
    )
    service_name: str = Field("dense-search", min_length=1, description="service.name of the exported spans.")
    allocator: Literal["auto", "jemalloc", "system"] = Field(
        "auto", description="The malloc of `python -m service`, and with --ray of its ingress and shard replicas: "
        "jemalloc (the process starts again with it preloaded, since glibc's heap fragments under steady load), "
        "system (the C library's, or what LD_PRELOAD gives), or auto (jemalloc where libjemalloc2 is installed "
        "and LD_PRELOAD names nothing, else system).",
    )
    host: str = Field("127.0.0.1", description="Address the service listens on.")
    port: int = Field(8000, ge=1, le=65535, description="Port the service listens on.")

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

    @model_validator(mode="after")
    def _one_writer(self) -> "ServiceSettings":
        # A writer's index changes only through its writes: a generation swapped in from outside would drop them.
        if self.writes and self.watch_index:
            raise ValueError("SEARCH_WRITES and SEARCH_WATCH_INDEX exclude each other: a writer's index changes "
                             "only through its writes")
        return self

    @property
    def load(self) -> LoadOptions:
        """How the index is loaded; SEARCH_INDEX_MMAP false leaves mapping to the index (mapped where a candidate
        structure is loaded), as LoadOptions' default does."""
        return LoadOptions(self.device, self.verify_checksums, self.index_mmap or None, self.gpu_fp16)

    @property
    def defaults(self) -> Defaults:
        """What a request naming no mode or fusion runs."""
        feedback = (Feedback(self.default_feedback_passages, self.default_feedback_weight)
                    if self.default_feedback_passages else None)
        return Defaults(None if self.default_mode == "auto" else self.default_mode, self.default_fusion,
                        self.default_dense_weight, feedback)

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
