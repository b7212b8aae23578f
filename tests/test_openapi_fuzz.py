"""schemathesis generates requests from the app's own OpenAPI spec: no input may cause a 5xx,
every response must match the spec, and a wrong key must be refused. The suite replays a fixed
set of examples; `FUZZ_RANDOM=1 FUZZ_EXAMPLES=300 pytest tests/test_openapi_fuzz.py` explores anew."""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from service.app import create_app
from service.engine import SearchEngine
from service.settings import ServiceSettings

EXAMPLES_PER_OPERATION = int(os.environ.get("FUZZ_EXAMPLES", "30"))
KEY = "fuzz-key"


@pytest.fixture(scope="module")
def api_schema(small_index, searcher):
    app = create_app(ServiceSettings(index_dir=small_index, device="cpu", api_key=KEY), SearchEngine(searcher))
    return schemathesis.openapi.from_asgi("/openapi.json", app, headers={"Authorization": f"Bearer {KEY}"})


def test_no_request_from_the_spec_gets_a_server_error(api_schema):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) == 7
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck),
                  derandomize=os.environ.get("FUZZ_RANDOM") is None)  # CI: the same examples every run
        def check(case):
            # Schema-valid data may still meet a limit that is a setting (query length, whitespace-only
            # queries) or ask to rerank on a service without a reranker: those 422/400 are by design.
            case.call_and_validate(
                headers={"Authorization": f"Bearer {KEY}"}, excluded_checks=[positive_data_acceptance]
            )

        check()
