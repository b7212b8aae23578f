"""Metadata fields and exact filters (issue 37): a JSONL corpus's extra keys are stored with each passage,
typed in the manifest, returned when asked, and filtered on with the MongoDB-style grammar of Pinecone and
Chroma. A filtered search is the brute-force ranking of the matching passages (the top k among them, not the
top k of everything then filtered) in every mode, over shards, and with a HNSW structure; a bad filter is a
422 naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import faiss
import jsonschema
import numpy as np
import pytest

from index_builder.build import BuildOptions, build_index
from index_builder.cli import main as cli_main
from index_builder.errors import BuildError
from retrieval import filtered_search, index_writer
from retrieval.corpus import BadLine, read_corpus
from retrieval.fields import encode_fields
from retrieval.filters import FilterError, evaluate, parse_filter
from retrieval.fusion import interleave, reciprocal_rank_fusion
from retrieval.index_format import INDEX_FILE, MANIFEST_FILE, PASSAGES_FILE, read_manifest
from retrieval.passage_store import PassageStore
from retrieval.searcher import MAX_K, HitWithFields, Searcher
from retrieval.sharding import ShardIndex
from service.engine.search_engine import SearchEngine
from service.http.app import create_app
from service.sharded.sharded_engine import LocalShard, ShardedEngine, ShardedSearcher
from tests.conftest import CPU, DEMO
from tests.test_service import one, settings_for

PASSAGES = 240
SOURCES = ("pubmed", "arxiv", "wiki")
K = 10
QUERIES = ["join two paths", "parse a url into its parts", "sort a list in place", "read a file line by line",
           "current time zone", "random number between two values"]
TYPES = {"editor": "string", "lang": "string", "open": "boolean", "score": "number", "source": "string",
         "tags": "string[]", "uid": "string", "url": "string", "year": "number"}
# From every passage to one, and none: with the matching count each keeps of the 240.
FILTERS = [
    ({}, 240),
    ({"year": {"$gte": 1990}}, 240),
    ({"year": {"$lt": 2002}}, 84),  # year = 1990 + row % 35
    ({"source": "pubmed"}, 80),
    ({"source": {"$in": ["arxiv", "wiki"]}, "open": True}, 40),
    ({"lang": {"$ne": "en"}}, 144),  # "de", and the rows without a lang
    ({"$or": [{"tags": "rare"}, {"year": {"$gt": 2020, "$lte": 2022.5}}]}, 16),
    ({"$not": {"tags": {"$exists": True}}}, 35),
    ({"tags": {"$nin": ["t0", "t1", "t2"]}, "score": {"$gte": 0.5}}, 58),
    ({"uid": {"$in": [str(i) for i in range(0, 240, 20)]}}, 12),  # past 4 values: a table of codes
    ({"year": {"$in": [1990, 1991, 1992, 1993, 1994, 2050]}}, 35),
    ({"tags": {"$in": ["t0", "t1", "t2", "t3", "rare"]}, "lang": {"$exists": False}}, 21),
    ({"uid": "17"}, 1),
    ({"source": "nowhere"}, 0),
    ({"$and": [{"year": {"$gt": 2000}}, {"year": {"$lt": 2000}}]}, 0),
]


def record(position: int, pid: str, text: str) -> dict:
    """The test corpus's passage `position` with its fields (some absent, one BEIR metadata object)."""
    fields = {"id": pid, "text": text, "source": SOURCES[position % 3], "year": 1990 + position % 35,
              "open": position % 4 == 0, "uid": str(position), "score": (position % 10) / 10}
    if position % 7:
        fields["tags"] = [f"t{position % 5}"] + (["rare"] if position % 50 == 0 else [])
    if position % 10 != 3:
        fields["lang"] = "en" if position % 2 else "de"
    else:
        fields["lang"] = None  # null: absent
    if position % 6 == 0:
        fields["editor"] = f"e{position % 4}"  # shard 0 of 3 only
    if position % 11 == 0:
        fields["metadata"] = {"url": f"https://example.org/{position}", "nested": {"a": 1}, "numbers": [1, 2]}
    return fields


@pytest.fixture(scope="session")
def fields_corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fields-corpus") / "corpus.jsonl"
    lines = (DEMO / "corpus.tsv").read_text(encoding="utf-8").splitlines()[:PASSAGES]
    with path.open("w", encoding="utf-8") as handle:
        for position, line in enumerate(lines):
            pid, text = line.split("\t", 1)
            handle.write(json.dumps(record(position, pid, text)) + "\n")
    return path


@pytest.fixture(scope="session")
def fields_index(tmp_path_factory, fields_corpus, encoder) -> Path:
    """The one index with metadata fields (and BM25) the session builds."""
    out = tmp_path_factory.mktemp("fields-index") / "index"
    build_index(BuildOptions(fields_corpus, out, chunk_size=100, bm25=True), encoder)
    return out


@pytest.fixture(scope="module")
def fields_searcher(fields_index, encoder) -> Searcher:
    return Searcher(fields_index, encoder, load=CPU)


@pytest.fixture(scope="module")
def fields_engine(fields_searcher) -> SearchEngine:
    return SearchEngine(fields_searcher)


@pytest.fixture(scope="module")
def fields_app(fields_index, fields_engine):
    return create_app(settings_for(fields_index), fields_engine)


@pytest.fixture(scope="module")
def stored(fields_searcher) -> tuple[np.ndarray, list[dict], list[str]]:
    """Every row's stored vector, fields and id."""
    count = fields_searcher.count
    vectors = fields_searcher.index.reconstruct_n(0, count)
    rows = list(range(count))
    return vectors, fields_searcher.passages.fields(rows), [pid for pid, _ in fields_searcher.passages.get(rows)]


def matches(spec: dict, fields: dict) -> bool:
    """The grammar, read as plainly as possible, over one passage's stored fields: the reference a filter's
    mask is checked against."""
    for key, value in spec.items():
        if key == "$and":
            held = all(matches(part, fields) for part in value)
        elif key == "$or":
            held = any(matches(part, fields) for part in value)
        elif key == "$not":
            held = not matches(value, fields)
        else:
            held = field_matches(fields.get(key), value if isinstance(value, dict) else {"$eq": value})
        if not held:
            return False
    return True


def field_matches(have, condition: dict) -> bool:
    def equal(wanted) -> bool:
        return have is not None and (wanted in have if isinstance(have, list) else have == wanted)

    for op, operand in condition.items():
        held = {
            "$eq": lambda: equal(operand), "$ne": lambda: not equal(operand),
            "$in": lambda: any(equal(v) for v in operand), "$nin": lambda: not any(equal(v) for v in operand),
            "$gt": lambda: have is not None and have > operand, "$gte": lambda: have is not None and have >= operand,
            "$lt": lambda: have is not None and have < operand, "$lte": lambda: have is not None and have <= operand,
            "$exists": lambda: (have is not None) == operand, "$not": lambda: not field_matches(have, operand),
        }[op]()
        if not held:
            return False
    return True


def matching_rows(spec: dict, fields: list[dict]) -> list[int]:
    return [row for row, values in enumerate(fields) if matches(spec, values)]


def brute_dense(vectors: np.ndarray, query: np.ndarray, rows: list[int], k: int) -> list[tuple[int, float]]:
    """The matching rows' inner products with the query, best first, ties by row: the top k of them."""
    scores = vectors[rows] @ query if rows else np.zeros(0, dtype=np.float32)
    order = sorted(range(len(rows)), key=lambda i: (-scores[i], rows[i]))[:k]
    return [(rows[i], float(scores[i])) for i in order]


def brute_bm25(searcher: Searcher, query: str, rows: list[int], k: int) -> list[tuple[int, float]]:
    """BM25 scores of every passage (bm25s's own), the matching rows with a term in common, best first."""
    bm25 = searcher.bm25
    ids = [t for t in bm25.tokenizer.tokenize([query], update_vocab=False, return_as="ids", show_progress=False)[0]
           if t in bm25.retriever.unique_token_ids_set]
    scores = np.asarray(bm25.retriever.get_scores(ids)) if ids else np.zeros(searcher.count)
    kept = sorted((-float(scores[row]), row) for row in rows if scores[row] > 0)[:k]
    return [(row, -negative) for negative, row in kept]


def assert_same(hits, expected: list[tuple[int, float]], ids: list[str]) -> None:
    assert [hit.id for hit in hits] == [ids[row] for row, _ in expected]
    np.testing.assert_allclose([hit.score for hit in hits], [score for _, score in expected], rtol=0, atol=1e-5)


def test_the_manifest_lists_each_field_with_its_type(fields_index):
    manifest = read_manifest(fields_index, verify_checksums=True)
    assert manifest.fields == TYPES  # BEIR metadata's url flattened; its nested object and numbers ignored
    assert json.loads((fields_index / MANIFEST_FILE).read_text())["fields"] == TYPES


def test_a_tsv_index_has_no_fields_and_its_manifest_says_so(small_index):
    assert read_manifest(small_index).fields == {}
    assert json.loads((small_index / MANIFEST_FILE).read_text())["fields"] == {}


def test_fields_are_returned_only_when_asked(fields_searcher, fields_app, stored):
    _, fields, ids = stored
    plain = fields_searcher.search(QUERIES[0], 5)
    assert all(type(hit).__name__ == "Hit" for hit in plain)
    every = fields_searcher.search(QUERIES[0], 5, fields=True)
    assert [hit.id for hit in every] == [hit.id for hit in plain]
    for hit in every:
        assert isinstance(hit, HitWithFields) and hit.fields == fields[ids.index(hit.id)]
    some = fields_searcher.search(QUERIES[0], 5, fields=["year", "tags"])
    assert all(hit.fields == {k: v for k, v in fields[ids.index(hit.id)].items() if k in ("year", "tags")}
               for hit in some)
    answer = one(fields_app, "POST", "/search", {"query": QUERIES[0], "k": 5}).json()
    assert all("fields" not in hit for hit in answer["results"])  # answers keep their shape
    answer = one(fields_app, "POST", "/search", {"query": QUERIES[0], "k": 5, "fields": ["source", "open"]}).json()
    assert [hit["fields"] for hit in answer["results"]] == [
        {k: v for k, v in fields[ids.index(hit["id"])].items() if k in ("source", "open")} for hit in answer["results"]]
    batch = one(fields_app, "POST", "/search/batch", {"queries": QUERIES[:2], "k": 3, "fields": True}).json()
    assert all(hit["fields"] == fields[ids.index(hit["id"])] for item in batch["results"] for hit in item["results"])
    assert one(fields_app, "GET", "/ready").json()["index"]["fields"] == TYPES


def test_each_filter_matches_what_the_grammar_says(fields_searcher, stored):
    _, fields, _ = stored
    for spec, count in FILTERS:
        mask = evaluate(parse_filter(spec, fields_searcher.field_types), fields_searcher.restrictions.columns)
        assert np.flatnonzero(mask).tolist() == matching_rows(spec, fields), spec
        assert int(mask.sum()) == count, spec


@pytest.mark.parametrize("spec,count", FILTERS)
def test_filtered_dense_search_is_the_brute_force_ranking_of_the_matching_passages(fields_searcher, encoder, stored,
                                                                                   spec, count):
    vectors, fields, ids = stored
    rows = matching_rows(spec, fields)
    query_vectors = encoder.encode_texts(QUERIES)
    for k in (K, MAX_K):
        found = fields_searcher.batch_search(QUERIES, k, mode="dense", filter=spec)
        for hits, query_vector in zip(found, query_vectors):
            assert_same(hits, brute_dense(vectors, query_vector, rows, k), ids)


@pytest.mark.parametrize("spec,count", FILTERS)
def test_filtered_bm25_and_hybrid_search_fuse_the_brute_force_lists_of_the_matching_passages(
        fields_searcher, encoder, stored, spec, count):
    vectors, fields, ids = stored
    rows = matching_rows(spec, fields)
    lexical = [brute_bm25(fields_searcher, query, rows, MAX_K) for query in QUERIES]
    dense = [brute_dense(vectors, v, rows, MAX_K) for v in encoder.encode_texts(QUERIES)]
    for hits, expected in zip(fields_searcher.batch_search(QUERIES, K, mode="bm25", filter=spec), lexical):
        assert_same(hits, expected[:K], ids)
    rrf = fields_searcher.batch_search(QUERIES, K, mode="hybrid", fusion="rrf", filter=spec)
    for hits, d, b in zip(rrf, dense, lexical):
        fused = reciprocal_rank_fusion([[r for r, _ in d], [r for r, _ in b]], K)
        assert [hit.id for hit in hits] == [ids[row] for row, _ in fused]
    for lead in ("dense", "bm25"):
        mixed = fields_searcher.batch_search(QUERIES, K, mode="hybrid", fusion="interleave", lead=lead, filter=spec)
        for hits, d, b in zip(mixed, dense, lexical):
            lists = [[r for r, _ in d[:K]], [r for r, _ in b[:K]]]
            fused = interleave(*(lists if lead == "dense" else lists[::-1]), K)
            assert [hit.id for hit in hits] == [ids[row] for row, _ in fused]


def test_no_match_is_an_empty_result_not_an_error(fields_app):
    for body in ({"query": QUERIES[0], "filter": {"source": "nowhere"}},
                 {"query": QUERIES[0], "mode": "hybrid", "fusion": "rrf", "filter": {"uid": "999"}}):
        response = one(fields_app, "POST", "/search", body)
        assert response.status_code == 200 and response.json()["results"] == []
    response = one(fields_app, "POST", "/search/batch", {"queries": QUERIES[:2], "filter": {"year": {"$gt": 3000}}})
    assert response.status_code == 200 and [item["results"] for item in response.json()["results"]] == [[], []]


def test_the_http_answer_equals_the_library_answer(fields_app, fields_searcher):
    spec = {"source": {"$in": ["arxiv", "wiki"]}, "year": {"$gte": 2000}}
    answer = one(fields_app, "POST", "/search", {"query": QUERIES[1], "k": 7, "filter": spec}).json()
    expected = fields_searcher.search(QUERIES[1], 7, filter=spec)
    assert [hit["id"] for hit in answer["results"]] == [hit.id for hit in expected]
    assert answer["search"] == "exact"


BAD_FILTERS = [
    ({"sourc": "pubmed"}, ["sourc"], ['unknown field "sourc"', "source"]),
    ({"year": "2020"}, ["year"], ['field "year" is a number', "2020"]),
    ({"year": {"$gte": "2020"}}, ["year", "$gte"], ['field "year" is a number', '"$gte"']),
    ({"source": {"$gt": 3}}, ["source", "$gt"], ['"$gt" needs a number field', '"source" is a string']),
    ({"open": 1}, ["open"], ['field "open" is a boolean']),
    ({"year": {"$between": [1, 2]}}, ["year", "$between"], ['unknown operator "$between" on field "year"']),
    ({"$xor": []}, ["$xor"], ['unknown operator "$xor"']),
    ({"lang": {"$in": "en"}}, ["lang", "$in"], ['"$in" on field "lang" needs a list of strings', '"en"']),
    ({"lang": {"$in": ["en", 3]}}, ["lang", "$in", 1], ['field "lang" is a string']),
    ({"lang": {"$nin": {"en": 1}}}, ["lang", "$nin"], ['"$nin" on field "lang" needs a list']),
    ({"lang": ["en", "de"]}, ["lang"], ['"$eq" on field "lang" needs a single string', '"$in"']),
    ({"$or": {"lang": "en"}}, ["$or"], ['"$or" needs a non-empty list of filters']),
    ({"$and": [{"lang": "en"}, {"uid": 3}]}, ["$and", 1, "uid"], ['field "uid" is a string']),
    ({"tags": {"$exists": "yes"}}, ["tags", "$exists"], ['"$exists" on field "tags" needs true or false']),
    ({"year": {}}, ["year"], ['field "year" has an empty operator object']),
]


@pytest.mark.parametrize("spec,loc,words", BAD_FILTERS)
def test_a_bad_filter_is_a_422_naming_the_field_or_operator(fields_app, spec, loc, words):
    for path, body in (("/search", {"query": QUERIES[0], "filter": spec}),
                       ("/search/batch", {"queries": QUERIES[:2], "filter": spec})):
        response = one(fields_app, "POST", path, body)
        assert response.status_code == 422, response.text
        (problem,) = response.json()["detail"]
        assert problem["loc"] == ["body", "filter", *loc]
        assert all(word in problem["msg"] for word in words), problem["msg"]


def test_the_spec_describes_the_filters_and_fields_of_the_served_index(fields_app):
    """/openapi.json writes the index's fields into `filter` and `fields`, so a filter the spec allows is one the
    index accepts (tests/test_openapi_fuzz.py holds the service to it), and the bad filters above it refuses."""
    spec = one(fields_app, "GET", "/openapi.json").json()
    for name in ("SearchRequest", "BatchSearchRequest"):
        properties = spec["components"]["schemas"][name]["properties"]
        allowed = jsonschema.Draft202012Validator(properties["filter"])
        assert all(allowed.is_valid(given) for given, _ in FILTERS) and allowed.is_valid(None)
        assert not any(allowed.is_valid(given) for given, *_ in BAD_FILTERS)
        fields = jsonschema.Draft202012Validator(properties["fields"])
        assert fields.is_valid(True) and fields.is_valid(["year", "tags"]) and not fields.is_valid(["colour"])


def test_an_unknown_field_to_return_is_a_422_naming_it(fields_app):
    response = one(fields_app, "POST", "/search", {"query": QUERIES[0], "fields": ["year", "colour"]})
    assert response.status_code == 422
    (problem,) = response.json()["detail"]
    assert problem["loc"] == ["body", "fields", 1] and 'unknown field "colour"' in problem["msg"]


def test_a_filter_parsed_once_is_a_plan_and_equal_filters_fuse(fields_engine):
    first = fields_engine.plan(5, filter={"year": {"$gte": 2000}, "source": "wiki"})
    second = fields_engine.plan(5, filter={"source": "wiki", "year": {"$gte": 2000}})
    assert first == second and hash(first) == hash(second)  # one key order or another: one micro-batch
    assert first != fields_engine.plan(5, filter={"source": "wiki"})
    with pytest.raises(FilterError):
        parse_filter({"$not": {"$not": {"x": 1}}}, {})


def test_bad_lines_name_the_field_and_are_skipped_with_skip_bad(tmp_path, encoder):
    corpus = tmp_path / "bad.jsonl"
    records = [
        {"id": "a", "text": "first passage", "year": 2001, "tags": ["x"]},
        {"id": "b", "text": "second passage", "year": {"from": 1999}},
        {"id": "c", "text": "third passage", "tags": [1, 2]},
        {"id": "d", "text": "fourth passage", "year": "2003"},
        {"id": "e", "text": "fifth passage", "$weird": 1},
        {"id": "f", "text": "sixth passage", "year": 2005, "metadata": {"year": 7}},
        {"id": "g", "text": "seventh passage", "year": 2007, "metadata": {"source": "beir", "deep": {"x": 1}}},
    ]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"id": "h", "text": "x", "n": NaN}\n')
    found = [item for item, _ in read_corpus(corpus.open("rb"), "jsonl")]
    reasons = {item.line: item.reason for item in found if isinstance(item, BadLine)}
    assert 'field "year": nested objects are not supported' in reasons[2]
    assert 'field "tags": a list may hold strings only' in reasons[3]
    assert 'field "$weird"' in reasons[5]
    assert 'field "year" is both a top-level field and a member of "metadata"' in reasons[6]
    assert 'field "n": nan is not a finite number' in reasons[8]
    assert found[6].fields == {"year": 2007, "source": "beir"}
    with pytest.raises(BuildError, match=r'line 2: field "year": nested objects'):
        build_index(BuildOptions(corpus, tmp_path / "stopped", bm25=False), encoder)
    report = build_index(BuildOptions(corpus, tmp_path / "skipped", skip_bad=True, bm25=False), encoder)
    assert (report.passages, report.skipped) == (2, 6)  # line 4: "year" a string after a number on line 1
    assert read_manifest(tmp_path / "skipped").fields == {"source": "string", "tags": "string[]", "year": "number"}


def write_shards(index: Path, folder: Path, count: int) -> list[Path]:
    """`index` split as `build --shards` splits it (row i to shard i % count), written through the index
    writer from its stored vectors and passages (nothing encoded again): shards of the very same vectors."""
    manifest = read_manifest(index)
    vectors = faiss.read_index(str(index / INDEX_FILE)).reconstruct_n(0, manifest.count)
    store = PassageStore(index / PASSAGES_FILE)
    rows = list(range(manifest.count))
    records, fields = store.records(rows), store.fields(rows)
    folders = []
    for i in range(count):
        mine = rows[i::count]
        work = folder / f"shard-{i}"
        work.mkdir(parents=True)
        connection = index_writer.open_store(work)
        index_writer.insert_passages(connection, [(n, *records[row][:2], records[row][2], encode_fields(fields[row]))
                                                  for n, row in enumerate(mine)])
        connection.close()
        index_writer.write_vectors(work, [vectors[mine]], manifest.dimension)
        index_writer.write_manifest(work, encoder=manifest.encoder, count=len(mine), bm25=False, shard=f"{i}/{count}",
                                    corpus=manifest.corpus.model_copy(update={"passages": len(mine), "skipped": 0}))
        folders.append(work)
    return folders


@pytest.fixture(scope="module")
def fields_shards(tmp_path_factory, fields_index) -> list[Path]:
    return write_shards(fields_index, tmp_path_factory.mktemp("fields-shards"), 3)


def test_sharded_filtered_search_equals_the_unsharded_filtered_search(fields_shards, fields_engine, encoder):
    assert read_manifest(fields_shards[0]).fields["editor"] == "string"
    assert "editor" not in read_manifest(fields_shards[1]).fields  # only shard 0's passages have one
    clients = [LocalShard(ShardIndex(folder, load=CPU), f"shard-{i}") for i, folder in enumerate(fields_shards)]
    sharded = ShardedEngine(ShardedSearcher(clients, encoder, timeout_s=10.0))
    assert sharded.describe()["fields"] == TYPES
    for spec, _ in FILTERS + [({"editor": {"$in": ["e0", "e2"]}}, 0), ({"editor": {"$ne": "e0"}}, 0)]:
        for query in QUERIES[:3]:
            mine = sharded.search(query, K, filter=spec, fields=["editor", "year"])  # shards: dense by default
            theirs = fields_engine.search(query, K, mode="dense", filter=spec, fields=["editor", "year"])
            assert mine.hits == theirs.hits, spec
            assert mine.searched == "exact"
        mine = sharded.search_batch(QUERIES, K, filter=spec)
        theirs = fields_engine.search_batch(QUERIES, K, mode="dense", filter=spec)
        assert [result.hits for result in mine] == [result.hits for result in theirs]
    app = create_app(settings_for(fields_shards[0].parent), sharded)
    response = one(app, "POST", "/search", {"query": QUERIES[0], "filter": {"editr": "e0"}})
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "filter", "editr"]


@pytest.fixture(scope="module")
def fields_hnsw(tmp_path_factory, fields_index, encoder) -> Searcher:
    copy = tmp_path_factory.mktemp("fields-hnsw") / "index"
    shutil.copytree(fields_index, copy)
    assert cli_main(["ann", "--index", str(copy), "--kind", "hnsw"]) == 0
    return Searcher(copy, encoder, load=CPU)


def test_a_selective_filter_over_a_hnsw_index_is_answered_by_the_exact_scan(fields_hnsw, fields_searcher):
    for spec, count in FILTERS:
        assert fields_hnsw.answered_by(fields_hnsw.request(K, filter=spec)) == "exact", spec  # 240 rows: under STRUCTURE_MIN_ROWS
        for mode in ("dense", "hybrid"):
            assert (fields_hnsw.batch_search(QUERIES, K, mode=mode, filter=spec)
                    == fields_searcher.batch_search(QUERIES, K, mode=mode, filter=spec))
    assert fields_hnsw.answered_by(fields_hnsw.request(K)) == "approximate:hnsw"


def test_a_broad_filter_over_a_hnsw_index_searches_the_graph_with_the_filter_as_its_selector(
        fields_hnsw, fields_searcher, monkeypatch):
    monkeypatch.setattr(filtered_search, "STRUCTURE_MIN_ROWS", 10)
    spec = {"source": {"$in": ["pubmed", "wiki"]}}  # a third of the rows drop
    assert fields_hnsw.answered_by(fields_hnsw.request(K, filter=spec)) == "approximate:hnsw"
    assert fields_hnsw.answered_by(fields_hnsw.request(K, filter={"uid": "3"})) == "exact"
    for query in QUERIES:
        hits = fields_hnsw.search(query, K, mode="dense", filter=spec, fields=["source"])
        assert len(hits) == K and all(hit.fields["source"] in ("pubmed", "wiki") for hit in hits)
        exact = fields_searcher.search(query, K, mode="dense", filter=spec)
        every = {h.id: h.score for h in fields_searcher.search(query, PASSAGES, mode="dense", filter=spec)}
        assert all(every[hit.id] == hit.score for hit in hits)  # every score the exact one
        # Asked to rescore every matching row, the graph's candidates are all of them: the exact answer.
        assert fields_hnsw.search(query, K, mode="dense", filter=spec, candidates=PASSAGES) == exact


def test_eval_filter_scores_the_filtered_runs_and_refuses_a_bad_filter(fields_index, tmp_path, capsys):
    queries, qrels = tmp_path / "queries.tsv", tmp_path / "qrels.txt"
    queries.write_text("".join(line + "\n" for line in (DEMO / "queries.tsv").read_text().splitlines()[:8]))
    qrels.write_text((DEMO / "qrels.txt").read_text())
    spec = {"source": "pubmed"}
    runs = tmp_path / "runs"
    code = cli_main(["eval", "--index", str(fields_index), "--queries", str(queries), "--qrels", str(qrels),
                     "--modes", "dense", "bm25", "--k", "20", "--runs-dir", str(runs), "--device", "cpu",
                     "--filter", json.dumps(spec)])
    assert code == 0
    assert "filter" in capsys.readouterr().out
    store = PassageStore(fields_index / PASSAGES_FILE)
    ids = [pid for pid, _ in store.get(range(PASSAGES))]
    sources = {pid: values.get("source") for pid, values in zip(ids, store.fields(range(PASSAGES)))}
    for run in runs.iterdir():
        found = [line.split()[2] for line in run.read_text().splitlines()]
        assert found and all(sources[pid] == "pubmed" for pid in found)
    code = cli_main(["eval", "--index", str(fields_index), "--queries", str(queries), "--qrels", str(qrels),
                     "--device", "cpu", "--filter", '{"sourc": 1}'])
    assert code == 2 and 'unknown field "sourc"' in capsys.readouterr().err
    code = cli_main(["eval", "--index", str(fields_index), "--queries", str(queries), "--qrels", str(qrels),
                     "--device", "cpu", "--filter", "{not json"])
    assert code == 2 and "--filter" in capsys.readouterr().err


def test_over_an_index_that_takes_no_id_selector_the_matching_rows_are_scanned_in_the_mapped_file(
        fields_searcher, fields_index, encoder):
    """A GPU's flat index takes no ID selector; here the layout `SEARCH_DEVICE=cuda` gives one (IndexShards over
    consecutive rows), on the CPU: the deep read is its own, the scan of the matching rows index.faiss mapped."""
    flat = fields_searcher.index
    vectors = flat.reconstruct_n(0, flat.ntotal)
    sharded = faiss.IndexShards(flat.d, False, True)
    parts = [faiss.IndexFlatIP(flat.d) for _ in range(2)]
    for part, block in zip(parts, np.array_split(vectors, 2)):
        part.add(block)
        sharded.add_shard(part)
    scan = filtered_search.scan_index(sharded, fields_index / INDEX_FILE)
    assert isinstance(scan, faiss.IndexFlat) and scan.ntotal == flat.ntotal
    query_vectors = encoder.encode_texts(QUERIES)
    for spec, _ in FILTERS:
        restriction = fields_searcher.restrictions.of(fields_searcher.parse_filter(spec))
        for k in (K, MAX_K):
            theirs = filtered_search.search(flat, query_vectors, k, restriction)
            mine = filtered_search.search(sharded, query_vectors, k, restriction, scan=scan)
            np.testing.assert_array_equal(mine[1], theirs[1])
            np.testing.assert_allclose(mine[0], theirs[0], rtol=0, atol=1e-6)


def test_an_or_of_equalities_on_one_field_matches_what_its_in_matches(fields_searcher, stored):
    columns = fields_searcher.restrictions.columns
    for field, values in (("source", ["pubmed", "wiki", "nowhere"]), ("year", [1990, 2001, 2024]),
                          ("tags", ["t1", "rare"]), ("open", [True])):
        as_or = parse_filter({"$or": [{field: value} for value in values]}, fields_searcher.field_types)
        as_in = parse_filter({field: {"$in": values}}, fields_searcher.field_types)
        assert as_or.root == as_in.root
        expected = [row for row, fields in enumerate(stored[1]) if matches({field: {"$in": values}}, fields)]
        assert np.flatnonzero(evaluate(as_or, columns)).tolist() == expected
