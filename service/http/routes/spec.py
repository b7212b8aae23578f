"""The OpenAPI spec as this service accepts requests: FastAPI's, with the limits that are settings."""

from __future__ import annotations

from fastapi import FastAPI

from models.reranker import reranker_kind
from service.engine.runtime import Runtime
from service.settings import ServiceSettings


def spec_with_limits(app: FastAPI, spec, settings: ServiceSettings, runtime: Runtime) -> dict:
    """FastAPI's spec (`spec()`), with the limits that are settings written into the request schemas,
    and the served encoder's dimension and (without scoped keys) its fields once an index is in, so that every
    request the spec allows is one this service accepts."""
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
        # With scoped keys the spec names no field (any key may read it; tenants' fields are theirs): the filter
        # and fields keep their generic schemas.
        types = runtime.engine.searcher.field_types if settings.api_keys_file is None else None
        for name in ("SearchRequest", "BatchSearchRequest") if types is not None else ():
            fields = app.openapi_schema["components"]["schemas"][name]["properties"]
            fields["filter"] = {"anyOf": [filter_schema(types), {"type": "null"}], "default": None,
                                "description": fields["filter"]["description"]}
            fields["fields"] = {"anyOf": [{"type": "boolean"}, {"type": "array", "items": {"enum": list(types)}}
                                          if types else {"type": "array", "maxItems": 0}],
                                "default": False, "description": fields["fields"]["description"]}
    return app.openapi_schema


LARGEST = 1.7976931348623157e308  # float64's: a JSON number past it is no finite number
SPEC_DEPTH = 2  # $and, $or and $not nest this deep in the spec (the service takes up to MAX_DEPTH)


def filter_schema(types: dict[str, str], depth: int = 0) -> dict:
    """The filters on the index's fields (`types`) as a JSON schema (retrieval.filters' grammar, the logical
    operators nested at most SPEC_DEPTH deep): every filter it allows is one the index accepts."""
    properties = {name: _condition(kind) for name, kind in types.items()}
    if depth < SPEC_DEPTH:
        inner = filter_schema(types, depth + 1)
        properties |= {"$and": {"type": "array", "minItems": 1, "items": inner},
                       "$or": {"type": "array", "minItems": 1, "items": inner}, "$not": inner}
    return {"type": "object", "properties": properties, "additionalProperties": False}


def _condition(kind: str) -> dict:
    value = {"string": {"type": "string"}, "string[]": {"type": "string"}, "boolean": {"type": "boolean"},
             "number": {"type": "number", "minimum": -LARGEST, "maximum": LARGEST}}[kind]
    operators = {"$eq": value, "$ne": value, "$in": {"type": "array", "items": value},
                 "$nin": {"type": "array", "items": value}, "$exists": {"type": "boolean"},
                 **({op: value for op in ("$gt", "$gte", "$lt", "$lte")} if kind == "number" else {})}
    plain = {"type": "object", "properties": operators, "additionalProperties": False, "minProperties": 1}
    negated = {**plain, "properties": {**operators, "$not": plain}}
    return {"anyOf": [value, negated]}


