"""/v1/embeddings: OpenAI's embeddings API, by the served index's encoder."""

from __future__ import annotations

import base64

from fastapi import APIRouter, Request, Response

from service.engine.runtime import Runtime
from service.errors import OverLimit
from service.http import limits
from service.http.routes.access import Access
from service.http.routes.answers import GONE, json_answer, unless_gone
from service.http.routes.bodies import JsonOffLoopRoute
from service.http.schemas import EmbeddingsRequest, EmbeddingsResponse


def router(runtime: Runtime, access: Access) -> APIRouter:
    settings = access.settings
    routes = APIRouter(dependencies=access.guard("embeddings"), route_class=JsonOffLoopRoute)

    @routes.post("/v1/embeddings", response_model=EmbeddingsResponse, responses=access.responses(),
                 summary="OpenAI's embeddings API, by the served index's encoder")
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
            return Response(status_code=GONE)
        if request.encoding_format == "base64":
            data = [base64.b64encode(vector.astype("<f4").tobytes()).decode() for vector in vectors]
        else:
            data = vectors.tolist()
        return json_answer({"object": "list", "model": engine.searcher.manifest.encoder.name,
                            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
                            "usage": {"prompt_tokens": used, "total_tokens": used}})

    return routes
