"""What one tenant can learn from or take away from another (issue 75's fourth attack): field names and types
stay inside the scope that holds them, a scope's field quota is its own, a revoked key stops at the next request,
a keys file that is gone lets none of its keys in, and a request that carries two keys is refused."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from retrieval.fields import MAX_FIELDS
from retrieval.searcher import Searcher
from service.engine.search_engine import SearchEngine
from service.http.app import create_app
from tests.conftest import CPU
from tests.test_keys import KEYS, bearer, keys_file, tenant_index  # noqa: F401 - tenant_index is a fixture
from tests.test_service import one, settings_for, started

WRITERS = {**KEYS, "beta": ("beta-secret", ["search", "write"], {"tenant": "t1"})}
SCOPE_FIELDS = 6


@pytest.fixture
def served(tmp_path, tenant_index, encoder):  # noqa: F811 - the fixture imported above
    """acme writes tenant t0, beta tenant t1, ops every passage; a scope's passages hold at most 6 fields."""
    index = Path(shutil.copytree(tenant_index, tmp_path / "index"))
    settings = settings_for(index, writes=True, api_keys_file=keys_file(tmp_path / "keys.json", WRITERS),
                            api_key="service-key", max_scope_fields=SCOPE_FIELDS)
    app = create_app(settings, SearchEngine(Searcher(index, encoder, CPU)))
    secret = one(app, "POST", "/passages", {"passages": [{"id": "b-1", "text": "beta's own passage", "tenant": "t1",
                                                          "secret_b": "confidential"}]}, headers=bearer("ops"))
    assert secret.status_code == 200, secret.text
    yield app
    app.state.runtime.writes.close()


def refusal(response) -> str:
    assert response.status_code == 422, response.text
    return response.json()["detail"][0]["msg"]


@pytest.mark.parametrize("body", [
    {"query": "x", "filter": {"tenantt": "t0"}},
    {"query": "x", "filter": {"secret_b": "confidential"}},
    {"query": "x", "fields": ["nope"]},
    {"query": "x", "fields": ["secret_b"]},
])
def test_an_unknown_field_is_named_against_the_fields_of_the_keys_own_passages_only(served, body):
    # A field of another tenant's is as unknown as one nobody has: neither its existence nor its name is told.
    message = refusal(one(served, "POST", "/search", body, headers=bearer("acme")))
    assert "unknown field" in message
    assert message.endswith("(the fields of the passages this key may read: tenant, year)")


def test_the_fields_a_key_is_told_of_are_those_its_own_passages_hold(served):
    body = {"query": "x", "filter": {"tenantt": "t1"}}
    message = refusal(one(served, "POST", "/search", body, headers=bearer("beta")))
    assert message.endswith("(the fields of the passages this key may read: secret_b, tenant, year)")
    admin = refusal(one(served, "POST", "/search", body, headers=bearer("ops")))
    assert "(this index's fields: " in admin and all(name in admin for name in ("secret_b", "tenant", "year"))


def test_a_scoped_key_may_filter_on_and_return_its_own_fields(served):
    found = one(served, "POST", "/search", {"query": "beta's passage", "filter": {"secret_b": "confidential"},
                                            "fields": True}, headers=bearer("beta"))
    assert found.status_code == 200 and [hit["fields"] for hit in found.json()["results"]] == [
        {"tenant": "t1", "secret_b": "confidential"}]
    mine = one(served, "POST", "/search", {"query": "x", "k": 3, "fields": True}, headers=bearer("acme")).json()
    assert all(set(hit["fields"]) <= {"tenant", "year"} for hit in mine["results"])


def test_a_delete_by_filter_names_no_field_outside_the_scope(served):
    message = refusal(one(served, "POST", "/passages/delete", {"filter": {"secret_b": "x"}}, headers=bearer("acme")))
    assert message.endswith("(the fields of the passages this key may read: tenant, year)")


def test_a_type_conflict_with_another_scopes_field_is_refused_without_naming_its_type(served):
    written = one(served, "POST", "/passages", {"passages": [{"id": "a-1", "text": "acme's", "secret_b": 5}]},
                  headers=bearer("acme"))
    problem = written.json()["detail"][0]
    assert written.status_code == 422 and problem["loc"] == ["body", "passages", 0, "secret_b"]
    assert "another type" in problem["msg"] and "string" not in problem["msg"]
    # Within its own scope a key is told the type: the field is its own.
    own = one(served, "POST", "/passages", {"passages": [{"id": "a-2", "text": "acme's", "year": "old"}]},
              headers=bearer("acme"))
    assert "is a string here but a number" in refusal(own)


def test_the_spec_names_no_field_of_the_collection_where_keys_are_scoped(served):
    spec = one(served, "GET", "/openapi.json", headers=bearer("acme"))
    assert spec.status_code == 200 and "secret_b" not in spec.text
    request = spec.json()["components"]["schemas"]["SearchRequest"]["properties"]
    assert "properties" not in json.dumps(request["filter"]) and "enum" not in json.dumps(request["fields"])


def test_one_scope_cannot_use_up_the_field_quota_of_another_and_a_delete_frees_its_own(served):
    junk = {f"junk{i}": i for i in range(SCOPE_FIELDS - 2)}  # with tenant and year: the whole quota
    assert one(served, "POST", "/passages", {"passages": [{"id": "a-junk", "text": "junk", **junk}]},
               headers=bearer("acme")).status_code == 200
    over = one(served, "POST", "/passages", {"passages": [{"id": "a-more", "text": "more", "extra": 1}]},
               headers=bearer("acme"))
    assert f'would be field {SCOPE_FIELDS + 1} of the passages this key may write' in refusal(over)
    assert "SEARCH_MAX_SCOPE_FIELDS" in refusal(over)
    # beta's quota is its own: its new fields are allowed whatever acme holds.
    fresh = {"lang": "en", "source": "web", "rank": 1}
    assert one(served, "POST", "/passages", {"passages": [{"id": "b-2", "text": "beta's", **fresh}]},
               headers=bearer("beta")).status_code == 200
    assert one(served, "POST", "/passages/delete", {"ids": ["a-junk"]}, headers=bearer("acme")).json()["deleted"] == 1
    assert one(served, "POST", "/passages", {"passages": [{"id": "a-more", "text": "more", "extra": 1}]},
               headers=bearer("acme")).status_code == 200


def test_the_collections_field_cap_counts_the_fields_live_passages_hold(served):
    many = {f"f{i:03d}": i for i in range(MAX_FIELDS - 3)}  # with tenant, year and secret_b: the whole cap
    assert one(served, "POST", "/passages", {"passages": [{"id": "wide", "text": "wide", **many}]},
               headers=bearer("ops")).status_code == 200
    over = one(served, "POST", "/passages", {"passages": [{"id": "lang", "text": "x", "lang": "en"}]},
               headers=bearer("ops"))
    assert f'would be field {MAX_FIELDS + 1} of the collection' in refusal(over)
    assert one(served, "POST", "/passages/delete", {"ids": ["wide"]}, headers=bearer("ops")).json()["deleted"] == 1
    assert one(served, "POST", "/passages", {"passages": [{"id": "lang", "text": "x", "lang": "en"}]},
               headers=bearer("ops")).status_code == 200


def test_a_key_revoked_in_a_rewrite_that_keeps_size_inode_and_time_stops_at_the_next_request(served):
    path = served.state.keys.path
    before = os.stat(path)
    assert one(served, "POST", "/search", {"query": "x"}, headers=bearer("acme")).status_code == 200
    revoked = {**WRITERS, "acme": ("acme-revoked", *WRITERS["acme"][1:])}  # another key: a hash of the same size
    with open(path, "r+b") as handle:  # in place: the same inode
        handle.write(keys_file(Path(str(path) + ".new"), revoked).read_bytes())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert one(served, "POST", "/search", {"query": "x"}, headers=bearer("acme")).status_code == 401
    assert one(served, "POST", "/search", {"query": "x"},
               headers={"Authorization": "Bearer acme-revoked"}).status_code == 200


def test_a_keys_file_that_is_gone_lets_none_of_its_keys_in_until_it_is_back(served):
    path = served.state.keys.path
    kept = path.read_bytes()
    path.unlink()
    assert one(served, "POST", "/search", {"query": "x"}, headers=bearer("acme")).status_code == 401
    assert one(served, "GET", "/stats", headers=bearer("ops")).status_code == 401
    service_key = {"Authorization": "Bearer service-key"}  # SEARCH_API_KEY is no key of the file's
    assert one(served, "POST", "/search", {"query": "x"}, headers=service_key).status_code == 200
    assert "is gone" in one(served, "GET", "/ready", headers=service_key).json()["detail"]
    path.write_bytes(kept)
    assert one(served, "POST", "/search", {"query": "x"}, headers=bearer("acme")).status_code == 200
    assert one(served, "GET", "/ready", headers=service_key).json()["detail"] is None


def test_a_request_with_two_authorization_headers_is_refused(served):
    twice = [("Authorization", f"Bearer {KEYS['ops'][0]}"), ("Authorization", f"Bearer {KEYS['acme'][0]}")]
    for method, path, body in [("POST", "/search", {"query": "x"}), ("GET", "/stats", None)]:
        answer = one(served, method, path, body, headers=twice)
        assert answer.status_code == 400 and "two Authorization headers" in answer.json()["detail"]
    assert one(served, "GET", "/ready", headers=twice).json()["index"] is None  # no admin key known
    # The scheme's case is free (RFC 7235); the key after it is the key.
    assert one(served, "POST", "/search", {"query": "x"},
               headers={"Authorization": f"BEARER {KEYS['acme'][0]}"}).status_code == 200


def test_a_load_error_is_told_to_an_admin_key_only(tmp_path):
    path = keys_file(tmp_path / "keys.json", {"ops": KEYS["ops"]})
    broken = tmp_path / "not-an-index"
    broken.mkdir()
    with started(settings_for(broken, api_keys_file=path)) as client:
        anonymous = client.get("/ready")
        assert anonymous.status_code == 503 and anonymous.json() == {"status": "failed", "detail": None, "index": None}
        told = client.get("/ready", headers=bearer("ops")).json()
        assert told["status"] == "failed" and str(broken) in told["detail"]


def test_fields_and_types_of_ids_are_never_coerced(served):
    for pid, named in [(12345, "a number"), (1.5, "a number"), (True, "a boolean"), (None, "null"), (["a"], "a list")]:
        answer = one(served, "POST", "/passages", {"passages": [{"id": pid, "text": "t"}]}, headers=bearer("ops"))
        problem = answer.json()["detail"][0]
        assert answer.status_code == 422 and problem["loc"] == ["body", "passages", 0, "id"], pid
        assert f"id must be a string, not {named}" in problem["msg"], pid
    empty = one(served, "POST", "/passages", {"passages": [{"id": " ", "text": "t"}]}, headers=bearer("ops"))
    assert "id is empty" in refusal(empty)
    assert one(served, "GET", "/passages/12345", headers=bearer("ops")).status_code == 404
    for body, field in [({"query": "x", "k": 5.5}, "k"), ({"query": "x", "k": "5"}, "k"),
                        ({"query": "x", "feedback": {"passages": "2"}}, "feedback")]:
        answer = one(served, "POST", "/search", body, headers=bearer("ops"))
        assert answer.status_code == 422 and field in answer.json()["detail"][0]["loc"], body
