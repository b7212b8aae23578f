"""The HTTP layer: routes translate JSON to SearchEngine calls and errors to status codes, nothing more."""

from __future__ import annotations

import asyncio
import base64
import functools
import hmac
import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request, Response
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic_core import to_json

from models.reranker import reranker_kind
from service import errors, limits
from service.admission import Admission
from service.engine import ReloadError, SearchEngine, SearchPlan, SearchResult
from service.errors import NotFound, OverLimit, Unauthorized
from service.monitoring import Monitor
from service.page import mount_page
from service.runtime import Runtime
from service.schemas import (
    BatchSearchRequest,
    BatchSearchResponse,
    EmbeddingsRequest,
    EmbeddingsResponse,
    IndexInfo,
    ReloadRequest,
    RerankRequest,
    RerankResponse,
    SearchRequest,
    SearchResponse,
    Stats,
    Status,
)
from service.settings import ServiceSettings
from service.tracing import Tracing

log = logging.getLogger("service")
ANSWER_SLICE_BYTES = 65_536  # asyncio's default high-water mark for a transport's send buffer


class _RequestCounter:
    """ASGI middleware: counts every response by route template and status, refused ones included."""

    def __init__(self, app, monitor: Monitor, paths: set[str]) -> None:
        self.app, self.monitor, self.paths = app, monitor, paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def watched_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        finally:
            route = scope.get("route")
            path = route.path if route is not None else scope["path"]
            self.monitor.observe_request(path if path in self.paths else "unmatched", status)


def plan(settings: ServiceSettings, engine: SearchEngine, request: SearchRequest | BatchSearchRequest) -> SearchPlan:
    """The request checked once, into the plan the engine runs (OverLimit: 422, NotServable: 400)."""
    limits.check_k(settings, request.k)
    if request.rerank and request.depth is None and request.k > settings.max_rerank_depth:
        raise OverLimit(("k",), f"k={request.k} is over the max_rerank_depth limit of {settings.max_rerank_depth} "
                                "(SEARCH_MAX_RERANK_DEPTH): a reranked request rescores at least k passages", request.k)
    default = max(min(settings.rerank_depth, settings.max_rerank_depth), request.k)  # k <= the limit here
    depth = (request.depth or default) if request.rerank else None
    return engine.plan(request.k, rerank_depth=depth, reranker=request.reranker if request.rerank else None,
                       max_rerank_depth=settings.max_rerank_depth, allow_partial=request.allow_partial,
                       **request.retrieval())


async def _disconnect(receive) -> None:
    """Returns once the client has gone (read after the body: the server then reports only that)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_gone(http: Request, work):
    """`work`'s result, or None when the client disconnects first: `work` is cancelled then, so a
    request still queued for the model is dropped before it reaches it."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(http.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the route itself is cancelled (shutdown): so is its work
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


def _spec_with_limits(app: FastAPI, spec, settings: ServiceSettings, runtime: Runtime) -> dict:
    """FastAPI's spec (`spec()`), with the limits that are settings written into the request schemas,
    and the served encoder's dimension once an index is in, so that every request the spec allows is
    one this service accepts."""
    if app.openapi_schema is None:
        schemas = spec()["components"]["schemas"]
        for name in ("SearchRequest", "BatchSearchRequest"):
            fields = schemas[name]["properties"]
            fields["k"]["maximum"] = settings.max_k
            if not settings.rerankers:
                fields["rerank"] = {"const": False, "default": False, "description": "no reranker is configured"}
            fields["depth"]["anyOf"][0]["maximum"] = settings.max_rerank_depth
        schemas["SearchRequest"]["properties"]["query"]["maxLength"] = settings.max_query_chars
        queries = schemas["BatchSearchRequest"]["properties"]["queries"]
        queries["maxItems"] = settings.max_batch_queries
        queries["items"]["maxLength"] = settings.max_query_chars
        one, many = schemas["EmbeddingsRequest"]["properties"]["input"]["anyOf"]
        one["maxLength"] = many["items"]["maxLength"] = settings.max_query_chars
        many.update(minItems=1, maxItems=settings.max_batch_queries)
        if "RerankRequest" in schemas:  # in the spec only with a reranker configured
            fields = schemas["RerankRequest"]["properties"]
            # A reranker the service has, or none for the default: a kind it lacks is a 400.
            fields["model"] = {"anyOf": [{"type": "string", "enum": [reranker_kind(f) for f in settings.rerankers]},
                                         {"type": "null"}], "default": None, "description": "a configured reranker's kind"}
            fields["query"]["maxLength"] = settings.max_query_chars
            fields["texts"].update(maxItems=settings.max_rerank_depth)
            fields["texts"]["items"]["maxLength"] = settings.max_query_chars
            fields["documents"].update(maxItems=settings.max_rerank_depth)
            text, document = fields["documents"]["items"]["anyOf"]
            text["maxLength"] = schemas["RerankDocument"]["properties"]["text"]["maxLength"] = settings.max_query_chars
    if runtime.engine is not None:  # read anew: a reload may change it
        dimension = runtime.engine.searcher.manifest.dimension
        app.openapi_schema["components"]["schemas"]["EmbeddingsRequest"]["properties"]["dimensions"] = {
            "anyOf": [{"const": dimension}, {"type": "null"}], "default": None,
            "description": "OpenAI's: only the encoder's own dimension is served (the vectors are not shortened)"}
    return app.openapi_schema


class SlicedResponse(Response):
    """A response whose body is written ANSWER_SLICE_BYTES at a time, each once the client has read
    enough of the last (uvicorn waits for the send buffer to drain before each write): an answer its
    client does not read keeps its request in the service, counted against the concurrency cap, and
    sits in memory once, instead of being copied whole into the send buffer and forgotten."""

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body = self.body
        for start in range(0, max(len(body), 1), ANSWER_SLICE_BYTES):
            end = start + ANSWER_SLICE_BYTES
            await send({"type": "http.response.body", "body": body[start:end], "more_body": end < len(body)})


def _json(body: dict) -> Response:
    """`body` serialised once, in Rust (hits are `Hit` dataclasses, the shape of `SearchHit`). Returning
    a model instead makes FastAPI validate every passage again before serialising it. The declared
    response_model still documents the shape; tests check the passage fields, and the OpenAPI fuzz
    test checks unreranked bodies against the spec. A NaN or infinite score becomes null, as
    pydantic's own serialiser wrote it: always valid JSON."""
    return SlicedResponse(to_json(body, inf_nan_mode="null"), media_type="application/json")


def _shards(result: SearchResult) -> dict:
    """The `shards` field of a sharded engine's answer; nothing for one index, whose answers keep their shape."""
    return {"shards": result.shards} if result.shards is not None else {}


def create_app(settings: ServiceSettings | None = None, engine: SearchEngine | None = None,
               tracer_provider=None) -> FastAPI:
    """The app for `settings`; pass a loaded `engine` to skip loading (it is warmed up here), an
    OpenTelemetry `tracer_provider` to trace into it instead of SEARCH_OTLP_ENDPOINT's."""
    settings = settings or ServiceSettings()
    tracing = Tracing.from_settings(settings, tracer_provider)
    runtime = Runtime(settings, engine, tracing)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        log.info("settings: %s", settings.describe())
        runtime.start()
        yield
        await runtime.close()

    # With a key, the docs and the spec need it too, unless SEARCH_OPEN_DOCS opens them.
    docs_open = settings.api_key is None or settings.open_docs
    app = FastAPI(title="dense-search", version="0.1.0", lifespan=lifespan, telemetry=tracing.fastapi_config(),
                  description="Dense retrieval (RepBERT bi-encoder, exact FAISS search) over one index directory.",
                  **({} if docs_open else {"docs_url": None, "redoc_url": None, "openapi_url": None}))
    app.state.runtime = runtime
    bearer = HTTPBearer(auto_error=False, description="the SEARCH_API_KEY value")

    def require_key(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        expected = settings.api_key.get_secret_value().encode()
        given = credentials.credentials.encode() if credentials is not None else b""
        if not hmac.compare_digest(given, expected):
            raise Unauthorized("missing or wrong API key")

    # Without a key the spec declares no security scheme, since none is enforced.
    protected = [Depends(require_key)] if settings.api_key is not None else []

    def responses(errors: dict[int, str] | None = None, search: bool = False) -> dict:
        """The error answers a route may give, for the spec (422 FastAPI adds itself)."""
        described = {503: "the index is loading, or failed to load", **(errors or {})}
        if settings.api_key is not None:
            described[401] = "missing or wrong API key"
        if search:
            described[408] = "the request body stopped arriving (SEARCH_READ_TIMEOUT_S)"
            described[429] = "overloaded: retry after the Retry-After header's seconds (SEARCH_MAX_CONCURRENT_REQUESTS)"
        return {status: {"description": text} for status, text in sorted(described.items())}

    if not docs_open:
        @app.get("/openapi.json", include_in_schema=False, dependencies=protected)
        async def openapi() -> JSONResponse:
            return JSONResponse(app.openapi())

        @app.get("/docs", include_in_schema=False, dependencies=protected)
        async def docs() -> HTMLResponse:
            return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

        @app.get("/redoc", include_in_schema=False, dependencies=protected)
        async def redoc() -> HTMLResponse:
            return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")

    mount_page(app, settings)

    @app.get("/health", response_model=Status, summary="the process is alive")
    async def health() -> Status:
        return Status(status="alive")

    @app.get("/ready", response_model=Status, responses={503: {"model": Status}},
             summary="the index is loaded and a real query has run")
    async def ready(response: Response) -> Status:
        if runtime.engine is None:
            response.status_code = 503
            return Status(status="failed" if runtime.load_error else "loading", detail=runtime.load_error)
        return Status(status="ready", index=IndexInfo(**runtime.engine.describe()))

    # HEAD too, as load balancers' and probes' checks often ask (uvicorn sends no body for it).
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)
    app.add_api_route("/ready", ready, methods=["HEAD"], include_in_schema=False)

    @app.post("/search", response_model=SearchResponse, dependencies=protected,
              responses=responses({400: "rerank without a reranker, or a mode the index lacks"}, search=True))
    async def search(request: SearchRequest, http: Request) -> Response:
        limits.check_query(settings, request.query)
        engine = runtime.ready_engine()
        tokens = engine.tokenize(request.query, request.truncate)
        result = await unless_gone(http, runtime.search(request.query, plan(settings, engine, request), tokens))
        if result is None:
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        return _json({"query": request.query, "results": result.hits, "score_kind": result.score_kind,
                      "latency_ms": result.timings.as_dict(), **_shards(result)})

    @app.post("/search/batch", response_model=BatchSearchResponse, dependencies=protected,
              responses=responses({400: "a mode the index lacks"}, search=True))
    async def search_batch(request: BatchSearchRequest) -> Response:
        limits.check_batch(settings, request.queries)
        engine = runtime.ready_engine()
        tokens = [engine.tokenize(query, request.truncate, ("queries", position))
                  for position, query in enumerate(request.queries)]
        limits.check_batch_tokens(settings, sum(len(query.ids) for query in tokens))
        results = await runtime.search_batch(request.queries, plan(settings, engine, request), tokens)
        return _json({"results": [{"query": r.query, "results": r.hits} for r in results],
                      "score_kind": results[0].score_kind, "latency_ms": results[0].timings.as_dict(),
                      **_shards(results[0])})

    @app.post("/v1/embeddings", response_model=EmbeddingsResponse, dependencies=protected,
              responses=responses(), summary="OpenAI's embeddings API, by the served index's encoder")
    async def embeddings(request: EmbeddingsRequest, http: Request) -> Response:
        texts = [request.input] if isinstance(request.input, str) else request.input
        if not texts:
            raise OverLimit(("input",), "input must hold at least one text")
        limits.check_batch(settings, texts, "input")
        engine = runtime.ready_engine()
        dimension = engine.searcher.manifest.dimension
        if request.dimensions is not None and request.dimensions != dimension:
            raise OverLimit(("dimensions",), f"dimensions={request.dimensions}: this encoder's vectors have {dimension} "
                                             "dimensions, and are not shortened", request.dimensions)
        tokens = [engine.tokenize(text, request.truncate, ("input", position), request.input_type)
                  for position, text in enumerate(texts)]
        used = sum(len(text.ids) for text in tokens)
        limits.check_batch_tokens(settings, used, "input")
        vectors = await unless_gone(http, runtime.embed(texts, tokens))
        if vectors is None:
            return Response(status_code=499)  # as /search: its client has gone
        if request.encoding_format == "base64":
            data = [base64.b64encode(vector.astype("<f4").tobytes()).decode() for vector in vectors]
        else:
            data = vectors.tolist()
        return _json({"object": "list", "model": engine.searcher.manifest.encoder.name,
                      "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
                      "usage": {"prompt_tokens": used, "total_tokens": used}})

    @app.post("/rerank", response_model=RerankResponse, dependencies=protected, include_in_schema=bool(settings.rerankers),
              responses=responses({400: "no reranker is configured, or not the one asked for"}),
              summary="rescore passages against a query (text-embeddings-inference's and Cohere's shape)")
    async def rerank(request: RerankRequest, http: Request) -> Response:
        limits.check_query(settings, request.query)
        if (request.texts is None) == (request.documents is None):
            raise OverLimit(("texts",), "send the passages as texts or as documents (one of them)")
        field = "texts" if request.texts is not None else "documents"
        texts = request.texts if request.texts is not None else [
            text if isinstance(text, str) else text.text for text in request.documents]
        limits.check_documents(settings, texts, field)
        engine = runtime.ready_engine()
        reranker = engine.reranker(request.model)
        # Off the event loop: a thousand long texts take a tokenizer a while.
        pair_tokens = await asyncio.to_thread(reranker.pair_tokens, request.query, texts)
        limits.check_rerank_tokens(settings, sum(pair_tokens), field)
        scores = await unless_gone(http, runtime.rescore(request.query, texts, request.model, pair_tokens))
        if scores is None:
            return Response(status_code=499)  # as /search: its client has gone
        kind = request.model or engine.default_reranker
        order = sorted(range(len(texts)), key=lambda i: -float(scores[i]))[: request.top_n]
        show = request.return_documents or request.return_text
        return _json({"object": "rerank", "model": engine.rerankers[kind].name,
                      "score_kind": engine.rerankers[kind].score_kind,
                      "results": [{"index": i, "relevance_score": float(scores[i]),
                                   **({"document": {"text": texts[i]}} if show else {})} for i in order]})

    @app.get("/metrics", dependencies=protected, response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"},
                        **({401: {"description": "missing or wrong API key"}} if settings.api_key else {})})
    async def metrics() -> Response:
        return Response(runtime.monitor.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats", response_model=Stats, dependencies=protected, responses=responses())
    async def stats() -> Stats:
        engine = runtime.ready_engine()
        return Stats(**runtime.monitor.stats(), index=IndexInfo(**engine.describe()))

    @app.post("/admin/reload", response_model=IndexInfo, dependencies=protected,
              responses=responses({404: "no such folder in the index root"}))
    async def reload(request: ReloadRequest) -> IndexInfo:
        runtime.ready_engine()
        root = settings.reload_root
        try:
            target = (root / request.index).resolve()
            inside = target.is_relative_to(root) and target != root
            found = inside and target.is_dir()
        except (ValueError, OSError) as error:  # a NUL byte, a name too long for the file system
            raise OverLimit(("index",), f"index is not a usable folder name: {error}") from None
        if not inside:
            raise OverLimit(("index",), f"index must name a folder inside the index root {root}", request.index)
        if not found:
            raise NotFound(f"index: no folder {request.index!r} in the index root {root}")
        try:
            return IndexInfo(**await runtime.reload(target))
        except ReloadError as error:
            raise OverLimit(("index",), f"reload failed, the previous index keeps serving: {error}") from None

    app.openapi = functools.partial(_spec_with_limits, app, app.openapi, settings, runtime)
    errors.install(app)
    app.add_middleware(limits.BodyLimits, max_bytes=settings.body_limit, timeout_s=settings.read_timeout_s)
    # Outside the body limits: an overloaded service refuses before reading a byte of the body.
    app.add_middleware(Admission, occupancy=runtime.occupancy)
    app.add_middleware(_RequestCounter, monitor=runtime.monitor, paths={r.path for r in app.routes})
    return app
