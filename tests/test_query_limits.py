"""Limits that follow the model: an index records its encoder's own token limits, long queries are cut
as text-embeddings-inference cuts them (or refused when a request says `truncate: false`), and the
character limit is only a guard against abuse."""

from __future__ import annotations

import json
import shutil

import pytest

from retrieval.index_format import read_manifest
from retrieval.searcher import Searcher, encoder_for
from service.http.app import create_app
from service.settings import ServiceSettings
from tests.conftest import CPU
from tests.test_layout import BEFORE_LAYOUT
from tests.test_service import one, settings_for

LONG_QUERY = "aerodynamic heating of a wing " * 60  # 302 tokens


@pytest.fixture(scope="module")
def app(small_index, engine):
    return create_app(settings_for(small_index), engine)


def test_a_new_index_of_the_packaged_model_records_its_own_256_token_limits(small_index):
    encoder = read_manifest(small_index).encoder
    assert (encoder.query_max_tokens, encoder.passage_max_tokens) == (256, 256)


def test_an_index_built_with_repberts_20_token_queries_keeps_that_limit(tmp_path):
    shutil.copytree(BEFORE_LAYOUT, tmp_path / "old")
    manifest = read_manifest(tmp_path / "old")
    assert manifest.encoder.query_max_tokens == 20
    assert Searcher(tmp_path / "old", load=CPU).encoder.spec.query_max_tokens == 20
    assert encoder_for(manifest, "cpu", query_max_tokens=64).spec.query_max_tokens == 64  # the override


def test_a_query_over_the_token_limit_is_cut_by_default(app, engine):
    assert engine.searcher.encoder.query_tokens(LONG_QUERY) > 256
    cut = one(app, "POST", "/search", {"query": LONG_QUERY, "k": 5, "mode": "dense"})
    # Everything past token 256 is dropped from what the encoder reads (BM25 reads the whole text), so a
    # different tail changes nothing in the dense list.
    other_tail = one(app, "POST", "/search", {"query": LONG_QUERY + " join two paths in python", "k": 5,
                                              "mode": "dense"})
    assert cut.status_code == other_tail.status_code == 200
    assert cut.json()["results"] == other_tail.json()["results"]


def test_truncate_false_refuses_a_query_over_the_token_limit_naming_the_limit_and_its_count(app, engine):
    tokens = engine.searcher.encoder.query_tokens(LONG_QUERY)
    response = one(app, "POST", "/search", {"query": LONG_QUERY, "truncate": False})
    assert response.status_code == 422
    detail = response.json()["detail"][0]
    assert detail["loc"] == ["body", "query"]
    assert f"query is {tokens} tokens, over the query token limit of 256" in detail["msg"]
    batch = one(app, "POST", "/search/batch", {"queries": ["join paths", LONG_QUERY], "truncate": False})
    assert batch.status_code == 422 and batch.json()["detail"][0]["loc"] == ["body", "queries", 1]
    assert one(app, "POST", "/search", {"query": "join two paths", "truncate": False}).status_code == 200


def test_a_query_of_a_few_thousand_characters_is_served(app):
    query = "Return the absolute version of a path, normalised. " * 60
    assert len(query) > 3000
    response = one(app, "POST", "/search", {"query": query, "k": 3})
    assert response.status_code == 200 and len(response.json()["results"]) == 3


def test_the_default_body_limit_fits_a_full_batch_of_maximal_queries(tmp_path):
    settings = ServiceSettings(index_dir=tmp_path)
    assert settings.max_query_chars >= 10_000
    # The worst case for JSON: every character escaped as \\uXXXX.
    body = json.dumps({"queries": ["\u00e9" * settings.max_query_chars] * settings.max_batch_queries, "k": 1000})
    assert len(body.encode()) <= settings.body_limit
    assert ServiceSettings(index_dir=tmp_path, max_body_bytes=300).body_limit == 300
