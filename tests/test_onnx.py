"""The ONNX Runtime backend: the same embeddings and scores as torch (fp32), the same top-10, an int8
index that says it is int8 and is served as such, refusals where it cannot run, and ONNX fp32 as the
default query backend of a torch-built index where its vectors are torch's, torch where they are not."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from index_builder.build import BuildOptions, build_index
from models.cross_encoder import CrossEncoder
from models.encoder import PROBE_QUERIES, BiEncoder
from models.onnx_backend import default_cache, exported
from models.reranker import load_reranker
from retrieval.index_format import read_manifest
from retrieval.searcher import Searcher, encoder_for
from service.engine.search_engine import SearchEngine
from tests.conftest import CPU, demo_corpus_head
from tests.test_cross_encoder import PASSAGES, QUERY, tiny_bert


@pytest.fixture(scope="module")
def onnx_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("onnx-cache")


@pytest.fixture(scope="module")
def onnx_encoder(onnx_cache) -> BiEncoder:
    return BiEncoder(device="cpu", backend="onnx", onnx_cache=onnx_cache)


def test_onnx_embeddings_equal_torchs_on_the_demo_passages_and_queries(encoder, onnx_encoder, small_corpus,
                                                                        demo_queries):
    passages = [line.split("\t", 1)[1] for line in small_corpus.read_text(encoding="utf-8").splitlines()[:96]]
    np.testing.assert_allclose(onnx_encoder.encode_passages(passages), encoder.encode_passages(passages), atol=1e-4)
    queries = list(demo_queries.values())[:64]
    np.testing.assert_allclose(onnx_encoder.encode_queries(queries), encoder.encode_queries(queries), atol=1e-4)


def test_onnx_queries_find_torchs_top_10_on_a_torch_built_index(searcher, small_index, onnx_encoder, demo_queries):
    onnx_searcher = Searcher(small_index, onnx_encoder)
    queries = list(demo_queries.values())[:100]
    for expected, found in zip(searcher.batch_search(queries, 10), onnx_searcher.batch_search(queries, 10)):
        assert [hit.id for hit in found] == [hit.id for hit in expected]
        np.testing.assert_allclose([hit.score for hit in found], [hit.score for hit in expected], atol=1e-4)


def test_the_export_is_made_once_and_reused(onnx_encoder, onnx_cache):
    files = sorted(path.relative_to(onnx_cache) for path in onnx_cache.rglob("*.onnx"))
    assert len(files) == 1
    again = BiEncoder(device="cpu", backend="onnx", onnx_cache=onnx_cache)
    assert again._transformer.file == onnx_encoder._transformer.file
    assert sorted(path.relative_to(onnx_cache) for path in onnx_cache.rglob("*.onnx")) == files


def test_an_int8_index_records_it_and_is_served_with_int8_queries(tmp_path, onnx_cache, demo_queries, demo_qrels):
    corpus = demo_corpus_head(tmp_path, 120)
    int8 = BiEncoder(device="cpu", backend="onnx-int8", onnx_cache=onnx_cache)
    build_index(BuildOptions(corpus, tmp_path / "int8", chunk_size=64, bm25=False), int8)
    record = read_manifest(tmp_path / "int8").encoder
    assert (record.backend, record.export_sha256) == ("onnx-int8", int8.export_sha256)
    engine = SearchEngine.open(tmp_path / "int8", load=CPU)
    assert engine.searcher.encoder.backend == "onnx-int8"
    # Close to fp32, not equal: int8 weights move every vector a little.
    fp32 = BiEncoder(device="cpu", backend="onnx", onnx_cache=onnx_cache)
    queries = list(demo_queries.values())[:32]
    cosines = (int8.encode_queries(queries) * fp32.encode_queries(queries)).sum(axis=1)
    assert cosines.min() > 0.95 and not np.allclose(cosines, 1.0, atol=1e-4)
    # The int8 index still finds what it should: the judged passage of the queries it holds, near the top.
    held = {row[0] for row in (line.split("\t") for line in corpus.read_text(encoding="utf-8").splitlines())}
    judged = [(demo_queries[q], passage) for q, passage in demo_qrels.items() if passage in held]
    ranks = [next((h.rank for h in engine.search(query, 10).hits if h.id == passage), None) for query, passage in judged]
    assert judged and sum(rank is not None for rank in ranks) >= 0.8 * len(judged)
    # Asked for, torch still serves the same index.
    assert SearchEngine.open(tmp_path / "int8", load=CPU, backend="torch").searcher.encoder.backend == "torch"


def test_onnx_cross_encoder_scores_equal_torchs(tmp_path, onnx_cache):
    folder = tiny_bert(tmp_path / "tiny-monobert")
    torch_scores = CrossEncoder(folder, device="cpu").score(QUERY, PASSAGES)
    onnx_scores = load_reranker(folder, device="cpu", backend="onnx").score(QUERY, PASSAGES)
    np.testing.assert_allclose(onnx_scores, torch_scores, atol=1e-5)


def test_a_monobert_may_run_int8_beside_full_precision_queries(tmp_path, monkeypatch, small_index, onnx_cache):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tiny_bert(tmp_path / "tiny-monobert")
    engine = SearchEngine.open(small_index, load=CPU, rerankers=[folder], rerank_backend="onnx-int8",
                               backend="torch")
    assert engine.searcher.encoder.backend == "torch"
    assert engine.rerankers["monobert"].backend == "onnx-int8"
    int8 = engine.rerankers["monobert"].score(QUERY, PASSAGES)
    fp32 = CrossEncoder(folder, device="cpu", backend="onnx", onnx_cache=onnx_cache).score(QUERY, PASSAGES)
    # int8 weights: near the fp32 scores, not equal to them.
    np.testing.assert_allclose(int8, fp32, atol=1e-3)
    assert not np.allclose(int8, fp32, atol=1e-6)
    # Unset, the reranker runs on the backend asked of the queries, else on the index's own (the default
    # query backend's probe vouches for the query encoder only).
    assert SearchEngine.open(small_index, load=CPU, rerankers=[folder],
                             backend="onnx").rerankers["monobert"].backend == "onnx"
    unset = SearchEngine.open(small_index, load=CPU, rerankers=[folder])
    assert (unset.searcher.encoder.backend, unset.rerankers["monobert"].backend) == ("onnx", "torch")


def test_an_int8_score_does_not_depend_on_the_passages_scored_beside_it(tmp_path, onnx_cache):
    # Dynamic quantisation scales a product's input by the whole batch: a passage batched with others (and their
    # padding) would score otherwise than alone, and a rerank of depth 10 otherwise than the head of depth 20's.
    reranker = load_reranker(tiny_bert(tmp_path / "tiny-monobert"), device="cpu", backend="onnx-int8")
    together = reranker.score(QUERY, PASSAGES)
    for i, passage in enumerate(PASSAGES):
        assert reranker.score(QUERY, [passage])[0] == together[i]
    assert list(reranker.score(QUERY, PASSAGES[:2])) == list(together[:2])


def test_an_int8_query_vector_does_not_depend_on_the_queries_encoded_beside_it(onnx_cache, demo_queries):
    encoder = BiEncoder(device="cpu", backend="onnx-int8", onnx_cache=onnx_cache)
    queries = list(demo_queries.values())[:8]
    together = encoder.encode_queries(queries)
    for i, query in enumerate(queries):
        np.testing.assert_array_equal(encoder.encode_queries([query])[0], together[i])


def test_a_backend_that_cannot_run_is_refused_naming_it():
    with pytest.raises(ValueError, match="backend must be one of torch, onnx, onnx-int8"):
        BiEncoder(device="cpu", backend="tensorrt")


def test_exporting_leaves_the_torch_weights_answering_as_before(encoder, tmp_path):
    torch_encoder = BiEncoder(device="cpu")
    before = torch_encoder.encode_queries(PROBE_QUERIES)
    torch_encoder.use_backend("onnx", tmp_path)  # exported now, into an empty cache
    torch_encoder.use_backend("torch")
    np.testing.assert_array_equal(torch_encoder.encode_queries(PROBE_QUERIES), before)


def test_a_torch_built_index_encodes_queries_on_onnx_by_default_and_finds_what_torch_finds(
        small_index, searcher, demo_queries):
    engine = SearchEngine.open(small_index, load=CPU)
    encoder = engine.searcher.encoder
    assert (read_manifest(small_index).encoder.backend, encoder.backend) == ("torch", "onnx")
    assert 0.0 < encoder.drift() < 1e-4
    queries = list(demo_queries.values())[:20]
    for query in queries:
        expected, found = searcher.search(query, 10, mode="dense"), engine.search(query, 10, mode="dense")
        assert [hit.id for hit in found.hits] == [hit.id for hit in expected]
    # Asked for, or where the instance encodes written passages, the index's own backend.
    assert SearchEngine.open(small_index, load=CPU, backend="torch").searcher.encoder.backend == "torch"
    assert SearchEngine.open(small_index, load=CPU, encodes_passages=True).searcher.encoder.backend == "torch"


def test_an_export_that_drifts_from_torch_leaves_queries_on_torch_saying_so(small_index, tmp_path, monkeypatch,
                                                                            caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    manifest = read_manifest(small_index)
    # A faulty export in the cache: the real one with one weight matrix scaled by 5%.
    file = exported(BiEncoder(device="cpu").model, manifest.encoder.weights_sha256, "onnx", "last_hidden_state")
    assert file.is_relative_to(default_cache())
    model = onnx.load(file)
    weight = max(model.graph.initializer, key=lambda tensor: np.prod(tensor.dims))
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * 1.05, weight.name))
    onnx.save(model, file)
    with caplog.at_level(logging.WARNING, logger="retrieval"):
        encoder = encoder_for(manifest, "cpu")
    assert encoder.backend == "torch"
    assert any("queries encoded with torch" in record.getMessage() and "from torch's" in record.getMessage()
               for record in caplog.records)
    # An export that does not load at all: the same.
    file.write_bytes(b"not an onnx file")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="retrieval"):
        assert encoder_for(manifest, "cpu").backend == "torch"
    assert any("the ONNX export failed" in record.getMessage() for record in caplog.records)
