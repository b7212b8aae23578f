"""schemathesis generates requests from the app's own OpenAPI spec and runs every check it has
(`--checks all`), with and without a key: no input may cause a 5xx, every response must match the
spec, every request the spec allows must be accepted, and a wrong key must be refused. The suite replays a fixed
set of examples; `FUZZ_RANDOM=1 FUZZ_EXAMPLES=300 pytest tests/test_openapi_fuzz.py` explores anew."""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from service.engine.search_engine import SearchEngine
from service.http.app import create_app
from service.settings import ServiceSettings
from tests.test_rerank_service import small_cross_encoder  # noqa: F401 - the session fixture

EXAMPLES_PER_OPERATION = int(os.environ.get("FUZZ_EXAMPLES", "30"))
KEY = "fuzz-key"


@pytest.fixture(scope="module", params=[KEY, None], ids=["with-key", "without-key"])
def api_schema(request, small_index, searcher):
    settings = ServiceSettings(index_dir=small_index, device="cpu", api_key=request.param)
    headers = {"Authorization": f"Bearer {request.param}"} if request.param else {}
    app = create_app(settings, SearchEngine(searcher))
    return schemathesis.openapi.from_asgi("/openapi.json", app, headers=headers), headers


def check_operations(api_schema, headers, operations) -> None:
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck),
                  derandomize=os.environ.get("FUZZ_RANDOM") is None)  # CI: the same examples every run
        def check(case):
            case.call_and_validate(headers=headers)

        check()


def test_no_request_from_the_spec_gets_a_server_error_or_an_answer_the_spec_does_not_promise(api_schema):
    api_schema, headers = api_schema
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) == 8  # /rerank is in the spec only with a reranker configured
    check_operations(api_schema, headers, operations)


def test_the_rerank_route_keeps_the_specs_promises_with_a_reranker(small_index, searcher, small_cross_encoder):  # noqa: F811
    settings = ServiceSettings(index_dir=small_index, device="cpu", rerankers=[small_cross_encoder.path],
                               max_rerank_depth=16)
    app = create_app(settings, SearchEngine(searcher, {"monobert": small_cross_encoder}))
    api_schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in api_schema.get_all_operations()]
    check_operations(api_schema, {}, [op for op in operations if op.path == "/rerank"])
    assert any(op.path == "/rerank" for op in operations)
