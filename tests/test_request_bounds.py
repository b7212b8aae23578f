"""A request past its bounds is a 422 naming the fault, and costs the service little: values of the wrong
JSON type are refused rather than coerced, JSON nested past the parser's limit is a 422, and a filter is
bounded in size (objects and conditions, $in values) before any of it is evaluated."""

from __future__ import annotations

import pytest

from retrieval.filters import MAX_CLAUSES, MAX_LIST_VALUES, FilterError, parse_filter
from service.http.app import create_app
from tests.test_service import call, settings_for

TYPES = {"source": "string", "year": "number", "tags": "string[]"}


@pytest.fixture(scope="module")
def app(small_index, engine):
    return create_app(settings_for(small_index), engine)


@pytest.mark.parametrize("path, body, field", [
    ("/search", {"query": "x", "candidates": "5"}, "candidates"),
    ("/search", {"query": "x", "candidates": True}, "candidates"),
    ("/search", {"query": "x", "exact": "yes"}, "exact"),
    ("/search", {"query": "x", "fields": 1}, "fields"),
    ("/search", {"query": "x", "k": "3"}, "k"),
    ("/search", {"query": "x", "rerank": 1}, "rerank"),
    ("/search/batch", {"queries": ["x"], "truncate": "false"}, "truncate"),
    ("/rerank", {"query": "x", "texts": ["a"], "top_n": "1"}, "top_n"),
    ("/admin/reload", {"index": 5}, "index"),
])
def test_a_value_of_the_wrong_json_type_is_a_422_naming_the_field_not_a_coercion(app, path, body, field):
    (answer,) = call(app, ("POST", path, body))
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"][0]["loc"][:2] == ["body", field]


@pytest.mark.parametrize("body", [
    b'{"query": "x", "filter": ' + b'{"$not": ' * 5000 + b"{}" + b"}" * 5000 + b"}",
    b"[" * 100_000 + b"]" * 100_000,
])
def test_json_nested_past_the_parsers_limit_is_a_422_not_a_400(app, body):
    (answer,) = call(app, ("POST", "/search", body))
    assert answer.status_code == 422 and answer.json()["detail"][0]["loc"] == ["body"]
    assert "nested too deeply" in answer.json()["detail"][0]["msg"]


def test_a_filter_within_its_bounds_parses_and_one_past_them_is_refused_naming_the_limit():
    widest = {"$or": [{"year": number} for number in range(MAX_CLAUSES - 1)]}  # the $or counts too
    assert parse_filter(widest, TYPES).spec
    with pytest.raises(FilterError, match=f"more than {MAX_CLAUSES} clauses") as too_many:
        parse_filter({"$or": [{"year": number} for number in range(MAX_CLAUSES)]}, TYPES)
    assert too_many.value.path[0] == "$or"
    assert parse_filter({"source": {"$in": [str(n) for n in range(MAX_LIST_VALUES)]}}, TYPES).spec
    with pytest.raises(FilterError, match=f"more than {MAX_LIST_VALUES} values in its \\$in and \\$nin"):
        parse_filter({"source": {"$in": [str(n) for n in range(MAX_LIST_VALUES // 2 + 1)]},
                      "tags": {"$nin": [str(n) for n in range(MAX_LIST_VALUES // 2)]}}, TYPES)
    with pytest.raises(FilterError, match="more than"):  # empty objects count as much as conditions
        parse_filter({"$and": [{} for _ in range(300_000)]}, TYPES)


def test_a_filter_past_its_size_is_a_422_over_http_naming_the_filter(app):
    body = {"query": "x", "filter": {"$or": [{} for _ in range(20_000)]}}
    (answer,) = call(app, ("POST", "/search", body))
    assert answer.status_code == 422 and answer.json()["detail"][0]["loc"][:3] == ["body", "filter", "$or"]
    assert f"more than {MAX_CLAUSES} clauses" in answer.json()["detail"][0]["msg"]


@pytest.mark.parametrize("path, body", [
    ("/search", {"query": "x", "fliter": {"source": "a"}}),
    ("/search/batch", {"queries": ["x"], "fliter": {}}),
    ("/rerank", {"query": "x", "texts": ["a"], "fliter": 1}),
    ("/admin/reload", {"index": "x", "fliter": 1}),
    ("/v1/embeddings", {"input": "x", "fliter": 1}),
])
def test_an_unknown_key_is_a_422_naming_it_never_ignored(app, path, body):
    (answer,) = call(app, ("POST", path, body))
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"][0]["loc"] == ["body", "fliter"]


def test_a_misspelt_option_is_a_type_error_in_the_python_api_before_anything_runs(searcher, engine):
    for search in (lambda: searcher.search("x", 3, fliter={}), lambda: searcher.batch_search(["x"], 3, fliter={}),
                   lambda: engine.search("x", 3, fliter={}), lambda: engine.search_batch(["x"], 3, fliter={})):
        with pytest.raises(TypeError, match="fliter"):
            search()
