"""/search and /search/batch: a query (or a client's batch) checked into a plan, run by the engine."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request, Response

from service.engine.runtime import Runtime
from service.engine.search_engine import SearchEngine, SearchPlan, SearchResult
from service.http import limits
from service.http.routes.access import Access, key_of
from service.http.routes.answers import GONE, json_answer, unless_gone
from service.http.routes.bodies import JsonOffLoopRoute
from service.http.schemas import BatchSearchRequest, BatchSearchResponse, SearchRequest, SearchResponse
from service.settings import ServiceSettings


def plan(settings: ServiceSettings, engine: SearchEngine, request: SearchRequest | BatchSearchRequest,
         scope: dict | None = None) -> SearchPlan:
    """The request checked once, into the plan the engine runs (OverLimit: 422, NotServable: 400), within `scope`
    (the key's filter, ANDed with the request's)."""
    limits.check_k(settings, request.k)
    default = min(settings.rerank_depth, settings.max_rerank_depth)
    depth = (request.depth or default) if request.rerank else None
    retrieval = request.retrieval()
    retrieval["exact"] = retrieval["exact"] or settings.exact_search
    if retrieval["candidates"] is None:
        retrieval["candidates"] = settings.candidates
    weight = settings.rerank_retrieval_weight if request.retrieval_weight is None else request.retrieval_weight
    return engine.plan(request.k, rerank_depth=depth, reranker=request.reranker if request.rerank else None,
                       retrieval_weight=weight, max_rerank_depth=settings.max_rerank_depth,
                       allow_partial=request.allow_partial, scope=scope, **retrieval)


def answer(settings: ServiceSettings, engine: SearchEngine, request: SearchRequest) -> SearchResult:
    """One /search request answered in this thread by the steps the route takes, less the micro-batcher (whose
    company changes no answer): for offline evaluations that must answer as the service does."""
    limits.check_query(settings, request.query)
    tokens = engine.tokenize(request.query, request.truncate)
    planned = plan(settings, engine, request)
    if request.filter is not None:
        engine.evaluate_filter(planned)
    return engine.run([request.query], planned, [tokens])[0]


def _shards(result: SearchResult) -> dict:
    """The `shards` field of a sharded engine's answer; nothing for one index, whose answers keep their shape."""
    return {"shards": result.shards} if result.shards is not None else {}


def router(runtime: Runtime, access: Access) -> APIRouter:
    settings = access.settings
    routes = APIRouter(dependencies=access.guard("search"), route_class=JsonOffLoopRoute)

    @routes.post("/search", response_model=SearchResponse,
                 responses=access.responses({400: "rerank without a reranker, or a mode the index lacks"}, search=True))
    async def search(request: SearchRequest, http: Request) -> Response:
        limits.check_query(settings, request.query)
        engine = runtime.ready_engine()
        tokens = engine.tokenize(request.query, request.truncate)
        scope = key_of(http).scope
        planned = await runtime.plan(functools.partial(plan, settings, engine, request, scope),
                                     request.filter is not None or scope is not None)
        result = await unless_gone(http, runtime.search(request.query, planned, tokens))
        if result is None:
            return Response(status_code=GONE)
        return json_answer({"query": request.query, "results": result.hits, "mode": result.mode,
                            "score_kind": result.score_kind,
                            "latency_ms": result.timings.as_dict(), "search": result.searched, **_shards(result)},
                           result.generation)

    @routes.post("/search/batch", response_model=BatchSearchResponse,
                 responses=access.responses({400: "a mode the index lacks"}, search=True))
    async def search_batch(request: BatchSearchRequest, http: Request) -> Response:
        limits.check_batch(settings, request.queries)
        engine = runtime.ready_engine()
        tokens = [engine.tokenize(query, request.truncate, ("queries", position))
                  for position, query in enumerate(request.queries)]
        limits.check_batch_tokens(settings, sum(len(query.ids) for query in tokens))
        scope = key_of(http).scope
        planned = await runtime.plan(functools.partial(plan, settings, engine, request, scope),
                                     request.filter is not None or scope is not None)
        results = await runtime.search_batch(request.queries, planned, tokens)
        return json_answer({"results": [{"query": r.query, "results": r.hits} for r in results],
                            "mode": results[0].mode, "score_kind": results[0].score_kind, "latency_ms": results[0].timings.as_dict(),
                            "search": results[0].searched, **_shards(results[0])}, results[0].generation)

    return routes
