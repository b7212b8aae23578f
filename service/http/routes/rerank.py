"""/rerank: passages rescored against a query (text-embeddings-inference's and Cohere's shape)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response

from service.engine.runtime import Runtime
from service.errors import OverLimit
from service.http import limits
from service.http.routes.access import Access
from service.http.routes.answers import GONE, json_answer, unless_gone
from service.http.routes.bodies import JsonOffLoopRoute
from service.http.schemas import RerankRequest, RerankResponse


def router(runtime: Runtime, access: Access) -> APIRouter:
    settings = access.settings
    routes = APIRouter(dependencies=access.guard("rerank"), route_class=JsonOffLoopRoute)

    @routes.post("/rerank", response_model=RerankResponse, include_in_schema=bool(settings.rerankers),
                 responses=access.responses({400: "no reranker is configured, or not the one asked for"}),
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
            return Response(status_code=GONE)
        order = sorted(range(len(texts)), key=lambda i: -float(scores[i]))[: request.top_n]
        show = request.return_documents or request.return_text
        return json_answer({"object": "rerank", "model": reranker.name, "score_kind": reranker.score_kind,
                            "results": [{"index": i, "relevance_score": float(scores[i]),
                                         **({"document": {"text": texts[i]}} if show else {})} for i in order]})

    return routes
