"""One request never harms another, and the builder reads what it is given: each case here was seen
failing (a 500, a poisoned batch, a traceback, a misread file) before it was mended."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import faiss
import httpx
import numpy as np
import pytest
from pydantic import ValidationError

from index_builder.build import BuildError, BuildOptions, build_index
from index_builder.cli import main as cli_main
from models.encoder import BiEncoder
from retrieval.index_format import IndexFormatError, Manifest, file_record, read_manifest, sealed
from retrieval.index_writer import move_into_place
from retrieval.passage_store import PassageStore
from retrieval.searcher import Searcher
from service.engine.batcher import MicroBatcher
from service.engine.search_engine import SearchEngine
from service.errors import NotServable
from service.http.app import create_app
from service.settings import ServiceSettings
from tests.conftest import CPU
from tests.test_cross_encoder import tiny_bert
from tests.test_service import call, one, settings_for, started

LONE_SURROGATE = "join two paths \ud800"  # valid JSON ("\\ud800"), but no text a tokenizer can read


@pytest.fixture(scope="module")
def app(small_index, engine):
    return create_app(settings_for(small_index, microbatch_window_ms=50), engine)


@pytest.mark.parametrize("k", ["NaN", "Infinity", "-Infinity", "1e309"])
def test_a_non_finite_number_is_a_422_naming_the_field(app, k):
    response, = call(app, ("POST", "/search", f'{{"query": "join paths", "k": {k}}}'.encode()))
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "k"]


def test_unencodable_text_is_a_422_naming_the_field_and_its_neighbours_are_answered(app, demo_queries):
    good = [("POST", "/search", {"query": demo_queries[f"q{n:04d}"], "k": 3}) for n in range(1, 17)]
    poison = json.dumps({"query": LONE_SURROGATE}).encode()  # ASCII JSON: the surrogate as a "\\ud800" escape
    responses = call(app, *good[:8], ("POST", "/search", poison), *good[8:])
    bad = responses.pop(8)
    assert bad.status_code == 422
    assert bad.json()["detail"][0]["loc"] == ["body", "query"] and "lone surrogate" in bad.json()["detail"][0]["msg"]
    assert [response.status_code for response in responses] == [200] * 16
    batch, = call(app, ("POST", "/search/batch", json.dumps({"queries": ["join paths", LONE_SURROGATE]}).encode()))
    assert batch.status_code == 422 and batch.json()["detail"][0]["loc"] == ["body", "queries", 1]


def test_a_fused_batch_that_fails_is_retried_one_by_one_so_only_the_guilty_request_fails(engine, demo_queries):
    # Past the HTTP edge nothing refuses the text: the real tokenizer raises on it inside the batch.
    executor = ThreadPoolExecutor(max_workers=1)
    sizes: list[int] = []
    batcher = MicroBatcher(engine.run, executor, window_s=1.0, max_batch=64, on_batch=sizes.append)

    async def scenario():
        # Four requests queued in one go: the batcher takes them as one batch.
        queries = [demo_queries["q0002"], LONE_SURROGATE, demo_queries["q0003"], demo_queries["q0004"]]
        results = await asyncio.gather(*(batcher.search(q, engine.plan(3)) for q in queries), return_exceptions=True)
        await batcher.close()
        return results

    try:
        results = asyncio.run(scenario())
    finally:
        executor.shutdown()
    assert isinstance(results[1], Exception)
    for query, result in zip([demo_queries[q] for q in ("q0002", "q0003", "q0004")], results[:1] + results[2:]):
        assert [hit.id for hit in result.hits] == [hit.id for hit in engine.search(query, 3).hits]
    assert sizes == [1, 1, 1]  # the fused batch of 4 failed and counts no batch; the three good retries do


def test_a_byte_order_mark_is_not_part_of_the_first_id_nor_hides_the_header(tmp_path, encoder):
    tsv = tmp_path / "bom.tsv"
    tsv.write_bytes("\ufeffid\ttext\np1\tjoin two paths\np2\tsplit a path\n".encode())
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes('\ufeff{"_id": "p1", "text": "join two paths"}\n'.encode())
    for corpus, ids in ((tsv, ["p1", "p2"]), (jsonl, ["p1"])):
        out = tmp_path / f"index-{corpus.suffix[1:]}"
        build_index(BuildOptions(corpus, out, bm25=False), encoder)
        assert [pid for pid, _ in PassageStore(out / "passages.sqlite").get(range(len(ids)))] == ids


@pytest.mark.parametrize("name, content, reason", [
    ("cr.tsv", b"p1\tjoin two paths\rp2\tsplit a path\r", "line 1: carriage return inside a line"),
    ("surrogate.jsonl", b'{"_id": "p1", "text": "join \\ud800 paths"}\n', "line 1: text is not valid Unicode"),
    ("deep.jsonl", b"[" * 100_000 + b"\n", "line 1: JSON nested too deeply"),
])
def test_the_builder_refuses_what_it_cannot_read_with_the_line_and_a_reason(tmp_path, encoder, capsys, name,
                                                                            content, reason):
    corpus = tmp_path / name
    corpus.write_bytes(content)
    with pytest.raises(BuildError, match=reason):
        build_index(BuildOptions(corpus, tmp_path / "index", bm25=False), encoder)
    code = cli_main(["build", "--corpus", str(corpus), "--out", str(tmp_path / "cli"), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and reason in err[-1] and err[-1].startswith("error: ")


def test_an_empty_api_key_refuses_to_start_instead_of_turning_authentication_off(tmp_path):
    with pytest.raises(ValidationError, match="set but empty"):
        ServiceSettings(index_dir=tmp_path, api_key="")
    env = {**os.environ, "SEARCH_API_KEY": "", "SEARCH_INDEX_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "service"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "error: SEARCH_API_KEY: is set but empty: set a key, or unset SEARCH_API_KEY to serve without one")


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_with_a_key_the_docs_need_it_unless_a_setting_opens_them(small_index, engine, path):
    closed = create_app(settings_for(small_index, api_key="secret"), engine)
    assert one(closed, "GET", path).status_code == 401
    assert one(closed, "GET", path, headers={"Authorization": "Bearer secret"}).status_code == 200
    opened = create_app(settings_for(small_index, api_key="secret", open_docs=True), engine)
    assert one(opened, "GET", path).status_code == 200


def tampered_copy(small_index: Path, folder: Path) -> Path:
    copy = folder / "index"
    shutil.copytree(small_index, copy)
    return copy


def reseal(index: Path) -> None:
    """Rewrite the manifest's file records and digest as a careful tamperer would: only the cross-checks
    between manifest, FAISS and SQLite are left to catch what changed."""
    manifest = Manifest.model_validate_json((index / "manifest.json").read_text())
    files = {name: file_record(index / name) for name in manifest.files}
    (index / "manifest.json").write_text(json.dumps(sealed(manifest.model_copy(update={"files": files}))))


def test_an_edited_manifest_is_refused(small_index, tmp_path):
    index = tampered_copy(small_index, tmp_path)
    raw = json.loads((index / "manifest.json").read_text())
    (index / "manifest.json").write_text(json.dumps({**raw, "count": 10}))
    with pytest.raises(IndexFormatError, match="changed after it was written"):
        read_manifest(index)


def test_a_manifest_count_that_disagrees_with_the_rows_is_refused_naming_all_three(small_index, tmp_path, encoder):
    index = tampered_copy(small_index, tmp_path)
    manifest = read_manifest(index)
    (index / "manifest.json").write_text(json.dumps(sealed(manifest.model_copy(update={"count": 10}))))
    with pytest.raises(IndexFormatError, match="manifest counts 10 passages, index.faiss holds 300 vectors and "
                                               "passages.sqlite 300 rows"):
        Searcher(index, encoder, load=CPU)


def test_missing_passage_rows_are_refused_at_load_and_reported_by_ready(small_index, tmp_path, encoder):
    index = tampered_copy(small_index, tmp_path)
    with sqlite3.connect(index / "passages.sqlite") as connection:
        connection.execute("DELETE FROM passages WHERE row >= 290")
    reseal(index)
    with pytest.raises(IndexFormatError, match="passages.sqlite 290 rows"):
        Searcher(index, encoder, load=CPU)
    with started(settings_for(index)) as client:
        ready = client.get("/ready")
    assert ready.status_code == 503 and ready.json()["status"] == "failed"
    assert "manifest counts 300 passages, index.faiss holds 300 vectors and passages.sqlite 290 rows" in (
        ready.json()["detail"])


def test_an_index_file_of_another_dimension_is_refused_naming_both(small_index, tmp_path, encoder):
    index = tampered_copy(small_index, tmp_path)
    other = faiss.IndexFlatIP(768)
    other.add(np.zeros((300, 768), dtype=np.float32))
    faiss.write_index(other, str(index / "index.faiss"))
    reseal(index)
    with pytest.raises(IndexFormatError, match="index.faiss holds 768-d vectors, the manifest says 384-d"):
        Searcher(index, encoder, load=CPU)


def test_replacing_an_index_never_leaves_a_moment_with_nothing_at_its_path(tmp_path):
    # What `build --overwrite` and `merge --overwrite` do at the end, 200 times, watched by another process.
    out = tmp_path / "index"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    watcher = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "path, stop = sys.argv[1], sys.argv[2]\n"
        "missing = 0\n"
        "while not os.path.exists(stop):\n"
        "    missing += not os.path.exists(path)\n"
        "print(missing)\n"), str(out / "manifest.json"), str(tmp_path / "stop")], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    for number in range(200):
        work = tmp_path / ".index.partial"
        work.mkdir()
        (work / "manifest.json").write_text(json.dumps({"build": number}))
        (work / "state.json").write_text("{}")
        move_into_place(work, out, scratch=("state.json",))
    (tmp_path / "stop").touch()
    assert watcher.communicate(timeout=60)[0].strip() == "0"
    assert json.loads((out / "manifest.json").read_text()) == {"build": 199}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["index", "stop"]  # no old or scratch left
    assert not (out / "state.json").exists()


def test_reloading_an_index_of_another_model_keeps_the_query_token_override(small_index, tmp_path):
    model = tiny_bert(tmp_path / "tiny-encoder", num_labels=None)
    (tmp_path / "corpus.tsv").write_text("t1\twing stall at high angle\nt2\tjoin two paths\n")
    build_index(BuildOptions(tmp_path / "corpus.tsv", tmp_path / "other", bm25=False), BiEncoder(model, device="cpu"))
    engine = SearchEngine.open(small_index, load=CPU, query_max_tokens=7)
    assert engine.searcher.encoder.spec.query_max_tokens == 7
    engine.install(engine.prepare(tmp_path / "other"))
    assert engine.searcher.encoder.path == model and str(engine.searcher.encoder.device) == "cpu"
    assert engine.searcher.encoder.spec.query_max_tokens == 7  # SEARCH_QUERY_MAX_TOKENS survives the reload


@pytest.fixture(scope="module")
def short_query_index(tmp_path_factory, encoder) -> Path:
    """An index of the packaged model built with RepBERT's 20-token query limit, and no BM25."""
    folder = tmp_path_factory.mktemp("short-queries")
    (folder / "corpus.tsv").write_text("t1\twing stall at high angle\nt2\tjoin two paths\n")
    limited = BiEncoder(encoder.path, device="cpu", query_max_tokens=20)
    build_index(BuildOptions(folder / "corpus.tsv", folder / "index", bm25=False), limited)
    assert read_manifest(folder / "index").encoder.query_max_tokens == 20
    return folder / "index"


def test_reloading_an_index_of_the_same_model_takes_its_token_limits(small_index, short_query_index):
    engine = SearchEngine.open(small_index, load=CPU)
    assert engine.searcher.encoder.spec.query_max_tokens == 256
    engine.install(engine.prepare(short_query_index))
    assert engine.searcher.encoder.spec.query_max_tokens == 20


def test_a_search_planned_before_a_reload_that_dropped_bm25_is_not_servable(small_index, short_query_index):
    engine = SearchEngine.open(small_index, load=CPU)
    plan = engine.plan(5, mode="bm25")  # a request queued while the reload below goes on
    engine.install(engine.prepare(short_query_index))
    with pytest.raises(NotServable, match="^mode: .*BM25"):
        engine.run(["wing stall"], plan)


def test_a_chunked_body_over_the_limit_is_the_documented_422(small_index, engine):
    app = create_app(settings_for(small_index, max_body_bytes=300), engine)

    async def chunks():  # no content-length: the limit is only met while reading
        for _ in range(10):
            yield b'{"query": "' + b"x" * 50
        yield b'"}'

    async def send():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post("/search", content=chunks(), headers={"content-type": "application/json"})

    response = asyncio.run(send())
    assert response.status_code == 422
    assert "max_body_bytes limit of 300 bytes (SEARCH_MAX_BODY_BYTES)" in response.json()["detail"][0]["msg"]
