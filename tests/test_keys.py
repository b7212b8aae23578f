"""Scoped API keys (service/http/keys.py): a key's filter bounds every passage it reads or writes, its routes
what it may call; a passage outside the scope is answered as one that does not exist."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from index_builder.ann import AnnOptions
from index_builder.build import BuildOptions, build_index
from retrieval.searcher import Searcher
from service.engine.search_engine import SearchEngine
from service.http.app import create_app
from service.http.keys import KeysFileError
from tests.conftest import CPU, DEMO, read_tsv
from tests.test_service import one, settings_for

TENANTS = ["t0", "t1", "t2", "t3"]
PASSAGES = 80
QUERIES = ["join two paths", "parse a url into its parts", "sort a list in place", "read a file line by line",
           "return the current time", "open a network connection"]
KEYS = {  # name -> (key, routes, filter)
    "acme": ("acme-secret", ["search", "write"], {"tenant": "t0"}),
    "beta": ("beta-secret", ["search"], {"tenant": {"$in": ["t1"]}}),
    "ops": ("ops-secret", ["search", "write", "rerank", "embeddings", "admin"], None),
    "embedder": ("embed-secret", ["embeddings"], None),
}


def keys_file(path: Path, keys: dict = KEYS) -> Path:
    path.write_text(json.dumps([{"name": name, "key_sha256": hashlib.sha256(key.encode()).hexdigest(),
                                 "routes": routes, **({"filter": scope} if scope else {})}
                                for name, (key, routes, scope) in keys.items()]))
    return path


def bearer(name: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[name][0]}"}


@pytest.fixture(scope="module")
def tenant_index(tmp_path_factory, encoder) -> Path:
    folder = tmp_path_factory.mktemp("tenants")
    corpus = folder / "corpus.jsonl"
    texts = list(read_tsv(DEMO / "corpus.tsv").items())[:PASSAGES]
    corpus.write_text("".join(json.dumps({"id": pid, "text": text, "tenant": TENANTS[i % 4], "year": 2000 + i % 9})
                              + "\n" for i, (pid, text) in enumerate(texts)))
    build_index(BuildOptions(corpus, folder / "index", bm25=True, ann=[AnnOptions("int8", sample=10)]), encoder)
    return folder / "index"


@pytest.fixture
def served(tmp_path, tenant_index, encoder):
    index = Path(shutil.copytree(tenant_index, tmp_path / "index"))
    settings = settings_for(index, writes=True, api_keys_file=keys_file(tmp_path / "keys.json"), api_key="service-key")
    app = create_app(settings, SearchEngine(Searcher(index, encoder, CPU)))
    yield app
    app.state.runtime.writes.close()


def random_filter(chooser: random.Random):
    """Filters a client might send, some trying to reach past its scope."""
    tenant = chooser.choice(TENANTS)
    return chooser.choice([
        None, {"tenant": tenant}, {"$or": [{"tenant": tenant}, {"year": {"$gte": 2004}}]},
        {"$not": {"tenant": "t0"}}, {"tenant": {"$ne": "t0"}}, {"$or": [{}, {"tenant": tenant}]},
        {"year": {"$lt": 2005}}, {"tenant": {"$exists": True}},
    ])


def test_a_scoped_key_sees_only_its_scope_and_exactly_the_scoped_ranking(served, tenant_index, encoder):
    reference, chooser = Searcher(tenant_index, encoder, CPU), random.Random(5)
    for _ in range(40):
        name = chooser.choice(["acme", "beta"])
        scope = KEYS[name][2]
        wanted = random_filter(chooser)
        options = {"mode": chooser.choice(["dense", "bm25", "hybrid"]), "fusion": chooser.choice(["rrf", "zscore"]),
                   "exact": chooser.random() < 0.5}
        query = chooser.choice(QUERIES)
        body = {"query": query, "k": 10, "fields": True, **options, **({"filter": wanted} if wanted else {})}
        answer = one(served, "POST", "/search", body, headers=bearer(name))
        assert answer.status_code == 200, answer.text
        hits = answer.json()["results"]
        tenant = "t0" if name == "acme" else "t1"
        assert all(hit["fields"]["tenant"] == tenant for hit in hits), (name, wanted)
        both = scope if wanted is None else {"$and": [scope, wanted]}
        expected = reference.search(query, 10, filter=both, **options)
        assert [hit["id"] for hit in hits] == [hit.id for hit in expected], (name, wanted, options)
        np.testing.assert_allclose([hit["score"] for hit in hits], [hit.score for hit in expected], rtol=1e-5)
    batch = one(served, "POST", "/search/batch", {"queries": QUERIES, "k": 20, "fields": True, "mode": "hybrid",
                                                  "filter": {"$not": {"tenant": "t1"}}}, headers=bearer("beta"))
    assert batch.status_code == 200 and all(item["results"] == [] for item in batch.json()["results"])


@pytest.mark.parametrize("method,path,body,group", [
    ("POST", "/search", {"query": "join two paths"}, "search"),
    ("POST", "/search/batch", {"queries": ["join two paths"]}, "search"),
    ("POST", "/v1/embeddings", {"input": "join two paths"}, "embeddings"),
    ("POST", "/passages", {"passages": [{"id": "new", "text": "a new passage"}]}, "write"),
    ("POST", "/passages/delete", {"ids": ["nothing"]}, "write"),
    ("GET", "/passages/nothing", None, "write"),
    ("GET", "/stats", None, "admin"),
    ("GET", "/metrics", None, "admin"),
])
def test_every_route_answers_each_kind_of_key_as_its_routes_allow(served, method, path, body, group):
    assert one(served, method, path, body).status_code == 401
    assert one(served, method, path, body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    for name, (_, routes, _) in KEYS.items():
        status = one(served, method, path, body, headers=bearer(name)).status_code
        if group in routes:
            assert status in (200, 404), (name, path, status)  # 404: the passage "nothing" is not there
        else:
            assert status == 403, (name, path, status)
    assert one(served, method, path, body, headers={"Authorization": "Bearer service-key"}).status_code in (200, 404)


def test_a_passage_outside_the_scope_is_answered_as_one_that_does_not_exist(served):
    others = one(served, "POST", "/search", {"query": "join two paths", "k": 5, "filter": {"tenant": "t1"}},
                 headers=bearer("ops")).json()["results"]
    outside = others[0]["id"]
    hidden, missing = (one(served, "GET", f"/passages/{pid}", headers=bearer("acme")) for pid in (outside, "no-such"))
    assert hidden.status_code == missing.status_code == 404
    assert hidden.json()["detail"].replace(outside, "ID") == missing.json()["detail"].replace("no-such", "ID")
    gone = one(served, "POST", "/passages/delete", {"ids": [outside]}, headers=bearer("acme")).json()
    assert gone["deleted"] == 0
    escaped = one(served, "POST", "/passages/delete", {"filter": {"$not": {"tenant": "t0"}}}, headers=bearer("acme"))
    assert escaped.json()["deleted"] == 0
    assert one(served, "GET", f"/passages/{outside}", headers=bearer("ops")).status_code == 200


def test_a_scoped_write_takes_its_scope_and_cannot_leave_it(served):
    written = one(served, "POST", "/passages", {"passages": [{"id": "acme-1", "text": "join two paths quickly"}]},
                  headers=bearer("acme"))
    assert written.status_code == 200
    assert one(served, "GET", "/passages/acme-1", headers=bearer("acme")).json()["fields"] == {"tenant": "t0"}
    other = one(served, "POST", "/passages", {"passages": [{"id": "acme-2", "text": "x", "tenant": "t1"}]},
                headers=bearer("acme"))
    assert other.status_code == 422 and other.json()["detail"][0]["loc"] == ["body", "passages", 0]
    assert "outside the key's scope" in other.json()["detail"][0]["msg"]
    taken = one(served, "POST", "/search", {"query": "sort a list", "k": 1, "filter": {"tenant": "t2"}},
                headers=bearer("ops")).json()["results"][0]["id"]
    replaced = one(served, "POST", "/passages", {"passages": [{"id": taken, "text": "mine now"}]}, headers=bearer("acme"))
    assert replaced.status_code == 422 and replaced.json()["detail"][0]["loc"] == ["body", "passages", 0, "id"]
    assert one(served, "GET", f"/passages/{taken}", headers=bearer("ops")).json()["text"] != "mine now"


def test_each_request_is_logged_with_the_name_of_its_key_never_the_key(served, caplog):
    caplog.set_level("INFO", logger="service.audit")
    one(served, "POST", "/search", {"query": "x"}, headers=bearer("acme"))
    one(served, "GET", "/stats", headers=bearer("acme"))
    one(served, "GET", "/stats", headers={"Authorization": "Bearer wrong"})
    lines = [record.getMessage() for record in caplog.records if record.name == "service.audit"]
    assert lines == ['"POST /search" 200 key=acme', '"GET /stats" 403 key=acme', '"GET /stats" 401 key=-']
    assert not any("secret" in line for line in lines)


def test_what_a_scoped_key_is_told_about_the_service_names_no_other_tenant(served):
    assert one(served, "GET", "/ready", headers=bearer("acme")).json()["index"] is None
    assert one(served, "GET", "/ready", headers=bearer("ops")).json()["index"]["count"] == PASSAGES
    assert one(served, "POST", "/search", {"query": "x"}, headers=bearer("acme")).status_code == 200
    assert one(served, "GET", "/stats", headers=bearer("acme")).status_code == 403
    assert one(served, "GET", "/metrics", headers=bearer("acme")).status_code == 403
    metrics = one(served, "GET", "/metrics", headers=bearer("ops")).text
    assert 'search_key_requests_total{key="acme",outcome="allowed"} 1.0' in metrics
    assert 'search_key_requests_total{key="acme",outcome="refused"} 2.0' in metrics


def test_the_keys_file_is_re_read_when_it_changes_and_a_bad_one_keeps_the_keys_before(served, tmp_path):
    path = served.state.keys.path
    added = {**KEYS, "gamma": ("gamma-secret", ["search"], {"tenant": "t2"})}
    keys_file(path, added)
    assert one(served, "POST", "/search", {"query": "x"}, headers={"Authorization": "Bearer gamma-secret"}).status_code == 200
    path.write_text('[{"name": "broken", "key_sha256": "00", "routes": ["search"]}]')
    assert one(served, "POST", "/search", {"query": "x"}, headers={"Authorization": "Bearer gamma-secret"}).status_code == 200
    detail = one(served, "GET", "/ready", headers=bearer("ops")).json()["detail"]
    assert "entry 0 (broken): key_sha256" in detail


@pytest.mark.parametrize("entries,message", [
    ("not json", "Expecting value"),
    ([{"name": "a", "key_sha256": "0" * 64, "routes": ["serch"]}], "entry 0 (a): routes.0"),
    ([{"name": "a", "key_sha256": "0" * 64, "routes": ["search"], "filter": {"tennant": "t0"}}],
     'entry 0 (a): filter: filter: unknown field "tennant"'),
    ([{"name": "a", "key_sha256": "0" * 64, "routes": ["search"]},
      {"name": "a", "key_sha256": "1" * 64, "routes": ["search"]}], "entry 1 (a): its name or key_sha256"),
])
def test_a_keys_file_the_service_cannot_use_is_refused_at_start_naming_the_entry(tmp_path, tenant_index, entries,
                                                                                 message):
    path = tmp_path / "keys.json"
    path.write_text(entries if isinstance(entries, str) else json.dumps(entries))
    with pytest.raises(KeysFileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        create_app(settings_for(tenant_index, api_keys_file=path))
