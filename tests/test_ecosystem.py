"""Drop-in for the clients people already run: OpenAI's embeddings API (driven by the `openai` client
against the live app) and the rerank request text-embeddings-inference, Infinity and Cohere accept."""

from __future__ import annotations

import numpy as np
import pytest
from openai import OpenAI

from service.engine.search_engine import SearchEngine
from service.http.app import create_app
from tests.test_admission import serving
from tests.test_rerank_service import small_cross_encoder  # noqa: F401 - the session fixture
from tests.test_service import one, settings_for

TEXTS = ["what is a hash table", "how do I read a file line by line", "sorting a dictionary by value"]


@pytest.fixture(scope="module")
def openai_client(small_index, engine):
    with serving(small_index, engine) as (app, base, port):
        yield OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def test_the_openai_client_gets_the_encoders_own_query_embeddings(openai_client, encoder):
    # Told no format, the client asks for base64 and decodes it itself; both formats must agree.
    for options in ({}, {"encoding_format": "float"}):
        answer = openai_client.embeddings.create(input=TEXTS, model="any", **options)
        vectors = np.array([item.embedding for item in sorted(answer.data, key=lambda item: item.index)])
        np.testing.assert_allclose(vectors, encoder.encode_queries(TEXTS), atol=1e-6)
    assert answer.model == encoder.spec.name
    assert answer.usage.prompt_tokens == sum(encoder.query_tokens(text) for text in TEXTS)


def test_input_type_passage_gives_passage_embeddings(openai_client, encoder):
    answer = openai_client.embeddings.create(input=TEXTS[0], model="any", extra_body={"input_type": "passage"})
    np.testing.assert_allclose(answer.data[0].embedding, encoder.encode_passages(TEXTS[:1])[0], atol=1e-6)


def test_embeddings_keep_the_search_limits(small_index, engine):
    app = create_app(settings_for(small_index, max_batch_queries=2), engine)
    too_many = one(app, "POST", "/v1/embeddings", {"input": TEXTS})
    assert too_many.status_code == 422
    assert too_many.json()["detail"][0]["loc"] == ["body", "input"]
    assert "SEARCH_MAX_BATCH_QUERIES" in too_many.json()["detail"][0]["msg"]
    blank = one(app, "POST", "/v1/embeddings", {"input": ["fine", "  "]})
    assert blank.status_code == 422 and blank.json()["detail"][0]["loc"] == ["body", "input", 1]
    assert blank.json()["detail"][0]["msg"].startswith("text must not be empty")  # an input, not a query
    long = one(app, "POST", "/v1/embeddings", {"input": "word " * 300, "truncate": False})
    assert long.status_code == 422 and "over the query token limit of 256" in long.json()["detail"][0]["msg"]


@pytest.fixture(scope="module")
def rerank_app(small_index, searcher, small_cross_encoder):  # noqa: F811
    return create_app(settings_for(small_index, rerankers=[small_cross_encoder.path], max_rerank_depth=8),
                      SearchEngine(searcher, {"monobert": small_cross_encoder}))


@pytest.mark.parametrize("shape", ["tei", "cohere"])
def test_rerank_returns_top_n_in_the_rerankers_order(rerank_app, small_cross_encoder, demo_queries, searcher, shape):  # noqa: F811
    query = demo_queries["q0001"]
    passages = [hit.text for hit in searcher.search(query, 6)]
    scores = small_cross_encoder.score(query, passages)
    expected = sorted(range(len(passages)), key=lambda i: -scores[i])[:3]
    body = ({"query": query, "texts": passages, "return_text": True} if shape == "tei" else
            {"query": query, "documents": [{"text": p} for p in passages], "top_n": 3, "return_documents": True,
             "model": "monobert"})
    answer = one(rerank_app, "POST", "/rerank", body)
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    assert [r["index"] for r in results][:3] == expected
    assert len(results) == (len(passages) if shape == "tei" else 3)
    np.testing.assert_allclose([r["relevance_score"] for r in results[:3]], scores[expected], rtol=1e-5)
    assert [r["document"]["text"] for r in results[:3]] == [passages[i] for i in expected]
    assert answer.json()["score_kind"] == "probability"


def test_rerank_refusals_name_the_field(rerank_app, small_index, engine):
    neither = one(rerank_app, "POST", "/rerank", {"query": "q"})
    assert neither.status_code == 422 and neither.json()["detail"][0]["loc"] == ["body", "texts"]
    too_many = one(rerank_app, "POST", "/rerank", {"query": "q", "texts": ["p"] * 9})
    assert too_many.status_code == 422 and "SEARCH_MAX_RERANK_DEPTH" in too_many.json()["detail"][0]["msg"]
    other = one(rerank_app, "POST", "/rerank", {"query": "q", "texts": ["p"], "model": "generative"})
    assert other.status_code == 400 and "'generative' is not configured" in other.json()["detail"]
    none = one(create_app(settings_for(small_index), engine), "POST", "/rerank", {"query": "q", "texts": ["p"]})
    assert none.status_code == 400 and "SEARCH_RERANKERS" in none.json()["detail"]
