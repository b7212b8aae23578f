"""Instruction prefixes (e5's "query: " / "passage: ", bge's query instruction): taken from a
sentence-transformers folder's prompts, put before every query and passage, recorded in the
manifest, applied again wherever the index is searched, and checked like the rest of the encoder."""

from __future__ import annotations

import json
from pathlib import Path

import faiss
import numpy as np
import pytest

from index_builder.build import BuildError, BuildOptions, build_index
from index_builder.cli import main as cli_main
from index_builder.merge import merge_shards
from models.encoder import BiEncoder, default_model_path
from retrieval.index_format import INDEX_FILE, MANIFEST_FILE, read_manifest
from retrieval.searcher import EncoderMismatch, Searcher
from retrieval.sharding import Shard
from service.engine.search_engine import SearchEngine
from service.errors import OverLimit
from service.http.schemas import IndexInfo
from tests.conftest import CPU, ROOT

E5_PROMPTS = {"query": "query: ", "passage": "passage: "}
PASSAGES = [
    "Lift on a wing comes from the pressure difference between its upper and lower surfaces.",
    "A boundary layer separates from the surface when the pressure gradient is adverse.",
    "Supersonic flow over a wedge produces an oblique shock wave.",
    "Heat transfer at the stagnation point grows with the square root of the pressure gradient.",
    "Slender bodies of revolution have small wave drag at transonic speeds.",
    "Buckling of thin cylindrical shells under axial compression depends on imperfections.",
]
QUERY = "what makes a wing lift"


def prompted_model(folder: Path, prompts: dict) -> Path:
    """The packaged MiniLM (its files linked, not copied) with `prompts` in config_sentence_transformers.json."""
    folder.mkdir()
    for item in default_model_path().iterdir():
        if item.name != "config_sentence_transformers.json":
            (folder / item.name).symlink_to(item)
    config = {"prompts": prompts, "default_prompt_name": None}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def e5_model(tmp_path_factory) -> Path:
    return prompted_model(tmp_path_factory.mktemp("models") / "minilm-e5", E5_PROMPTS)


@pytest.fixture(scope="module")
def prompted(e5_model) -> BiEncoder:
    return BiEncoder(e5_model, device="cpu")


@pytest.fixture(scope="module")
def overridden(e5_model) -> BiEncoder:
    """The same model with its query prompt turned off and another passage prefix."""
    return BiEncoder(e5_model, device="cpu", query_prefix="", passage_prefix="doc: ")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.tsv"
    path.write_text("".join(f"p{n}\t{text}\n" for n, text in enumerate(PASSAGES)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def prompted_index(tmp_path_factory, corpus, prompted) -> Path:
    out = tmp_path_factory.mktemp("indexes") / "e5"
    build_index(BuildOptions(corpus, out, bm25=False), prompted)
    return out


def test_a_sentence_transformers_folders_prompts_are_its_default_prefixes(prompted):
    assert (prompted.spec.query_prefix, prompted.spec.passage_prefix) == ("query: ", "passage: ")


@pytest.mark.parametrize("prompts, expected", [
    ({"query": "search_query: ", "document": "search_document: "}, ("search_query: ", "search_document: ")),
    ({"query": "Represent this sentence for searching relevant passages: "},
     ("Represent this sentence for searching relevant passages: ", "")),
], ids=["document-key", "bge-query-only"])
def test_a_document_prompt_is_the_passage_prefix_and_a_missing_one_is_none(tmp_path, prompts, expected):
    spec = BiEncoder(prompted_model(tmp_path / "model", prompts), device="cpu").spec
    assert (spec.query_prefix, spec.passage_prefix) == expected


def test_the_packaged_model_has_no_prompts_so_its_indexes_are_unchanged(tmp_path, corpus, encoder):
    assert (encoder.spec.query_prefix, encoder.spec.passage_prefix) == ("", "")
    build_index(BuildOptions(corpus, tmp_path / "index", bm25=False), encoder)
    record = read_manifest(tmp_path / "index").encoder
    assert (record.query_prefix, record.passage_prefix) == ("", "")
    index = faiss.read_index(str(tmp_path / "index" / INDEX_FILE))
    np.testing.assert_array_equal(index.reconstruct_n(0, index.ntotal), encoder.encode_passages(PASSAGES))


def test_an_explicit_prefix_overrides_the_prompt_and_empty_turns_it_off(overridden, encoder):
    assert (overridden.spec.query_prefix, overridden.spec.passage_prefix) == ("", "doc: ")
    np.testing.assert_allclose(overridden.encode_queries([QUERY]), encoder.encode_queries([QUERY]), atol=1e-5)


def test_embeddings_equal_the_plain_models_embeddings_of_prefix_plus_text(prompted, encoder):
    np.testing.assert_allclose(prompted.encode_queries([QUERY]), encoder.encode_queries(["query: " + QUERY]), atol=1e-5)
    np.testing.assert_allclose(prompted.encode_passages(PASSAGES[:2]),
                               encoder.encode_passages(["passage: " + text for text in PASSAGES[:2]]), atol=1e-5)
    # tokenize (what /search and /v1/embeddings use) applies the prefix of its input type too
    passage = prompted.tokenize(PASSAGES[0], "passage")
    assert passage.ids == encoder.tokenize("passage: " + PASSAGES[0], "passage").ids
    np.testing.assert_allclose(prompted.encode_tokens([passage]), encoder.encode_passages(["passage: " + PASSAGES[0]]),
                               atol=1e-5)


def test_the_prefix_counts_toward_the_token_limit(prompted, encoder):
    assert prompted.tokenize(QUERY).count == encoder.tokenize("query: " + QUERY).count > encoder.tokenize(QUERY).count
    long_query = "wing " * 400
    cut = prompted.tokenize(long_query)
    assert len(cut.ids) == prompted.spec.query_max_tokens == 256
    assert cut.ids == encoder.tokenize("query: " + long_query).ids  # the prefix kept, the text cut


def test_an_over_limit_query_is_refused_with_its_count_and_prefix(prompted_index, prompted):
    engine = SearchEngine(Searcher(prompted_index, prompted, load=CPU))
    with pytest.raises(OverLimit) as error:
        engine.tokenize("wing " * 300, truncate=False)
    count = prompted.tokenize("wing " * 300).count
    assert f"query is {count} tokens with its prefix 'query: ', over the query token limit of 256" in str(error.value)


def test_an_index_records_the_prefixes_and_holds_prefixed_passage_vectors(prompted_index, prompted, encoder):
    record = read_manifest(prompted_index, verify_checksums=True).encoder
    assert (record.query_prefix, record.passage_prefix) == ("query: ", "passage: ")
    index = faiss.read_index(str(prompted_index / INDEX_FILE))
    np.testing.assert_allclose(index.reconstruct_n(0, index.ntotal),
                               encoder.encode_passages(["passage: " + text for text in PASSAGES]), atol=1e-5)


def test_a_searcher_loads_the_encoder_with_the_indexs_prefixes(prompted_index, encoder):
    searcher = Searcher(prompted_index, load=CPU)
    assert (searcher.encoder.spec.query_prefix, searcher.encoder.spec.passage_prefix) == ("query: ", "passage: ")
    assert searcher.search(QUERY, k=1)[0].id == "p0"
    np.testing.assert_allclose(searcher.encoder.encode_queries([QUERY]), encoder.encode_queries(["query: " + QUERY]),
                               atol=1e-5)


def test_describe_shows_the_indexs_prefixes(prompted_index, prompted):
    info = IndexInfo(**SearchEngine(Searcher(prompted_index, prompted, load=CPU)).describe())
    assert (info.query_prefix, info.passage_prefix) == ("query: ", "passage: ")


def test_build_flags_override_the_prompts_and_are_recorded(tmp_path, corpus, e5_model):
    out = tmp_path / "index"
    assert cli_main(["build", "--corpus", str(corpus), "--out", str(out), "--model", str(e5_model), "--device", "cpu",
                     "--query-prefix", "", "--passage-prefix", "doc: "]) == 0
    record = read_manifest(out).encoder
    assert (record.query_prefix, record.passage_prefix) == ("", "doc: ")


def test_a_searcher_refuses_an_encoder_with_other_prefixes_naming_both(prompted_index, encoder):
    # the same weights: only the prefixes differ
    with pytest.raises(EncoderMismatch) as error:
        Searcher(prompted_index, encoder, load=CPU)
    message = str(error.value)
    assert "query_prefix: index 'query: ', encoder ''" in message
    assert "passage_prefix: index 'passage: ', encoder ''" in message
    assert "weights_sha256" not in message


def test_a_manifest_written_before_prefixes_loads_with_none(encoder):
    before = ROOT / "tests" / "data" / "index-before-layout"
    assert "query_prefix" not in json.loads((before / MANIFEST_FILE).read_text())["encoder"]
    record = read_manifest(before).encoder
    assert (record.query_prefix, record.passage_prefix) == ("", "")
    assert Searcher(before, encoder, load=CPU).count == read_manifest(before).count


def test_merge_refuses_shards_whose_prefixes_differ(tmp_path, corpus, prompted, overridden):
    first, second = tmp_path / "s0", tmp_path / "s1"
    build_index(BuildOptions(corpus, first, shard=Shard.parse("0/2"), bm25=False), prompted)
    build_index(BuildOptions(corpus, second, shard=Shard.parse("1/2"), bm25=False), overridden)
    with pytest.raises(BuildError) as error:
        merge_shards([first, second], tmp_path / "merged")
    assert str(error.value) == f"{second}: encoder query_prefix '' differs from {first}'s 'query: '"
