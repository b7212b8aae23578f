"""Metadata fields at their edges: string values filter by their exact code points (NUL included), field
names with control characters are bad lines, an index declares at most --max-fields fields and an error
about an unknown one stays small, and an update's added passages are checked against the index's types
before anything is encoded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from index_builder.build import BuildOptions, build_index
from index_builder.errors import BuildError
from index_builder.update import ChangeOptions, apply_changes
from retrieval.fields import MAX_FIELDS
from retrieval.filters import FilterError
from retrieval.index_format import read_manifest
from retrieval.searcher import Searcher
from service.engine.search_engine import SearchEngine
from service.http.app import create_app
from tests.conftest import CPU
from tests.test_service import call, settings_for

SOURCES = ["a\u0000nul", "a", "a\u0000", "b\u0007bell"]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def short(number: int) -> str:
    return f"entry {number} about {['tea', 'rain', 'maps', 'owls'][number % 4]}"


@pytest.fixture(scope="module")
def odd_values_index(tmp_path_factory, encoder) -> Path:
    folder = tmp_path_factory.mktemp("odd-values")
    corpus = write_jsonl(folder / "corpus.jsonl", [
        {"id": f"p{n}", "text": short(n), "source": SOURCES[n % 4], "tags": [SOURCES[(n + 1) % 4]]} for n in range(24)])
    build_index(BuildOptions(corpus, folder / "index", chunk_size=32, bm25=True), encoder)
    return folder / "index"


@pytest.mark.parametrize("value", SOURCES)
def test_a_string_value_filters_by_its_exact_code_points_nul_and_control_characters_included(
        odd_values_index, encoder, value):
    searcher = Searcher(odd_values_index, encoder, load=CPU)
    expected = {f"p{n}" for n in range(24) if SOURCES[n % 4] == value}
    for mode in ("dense", "bm25", "hybrid"):
        hits = searcher.search("entry about tea rain maps owls", 24, mode=mode, filter={"source": value}, fields=True)
        assert {hit.id for hit in hits} <= expected and all(hit.fields["source"] == value for hit in hits), mode
    dense = searcher.search("entry", 24, filter={"source": value})
    assert {hit.id for hit in dense} == expected
    listed = searcher.search("entry", 24, filter={"tags": {"$in": [value]}})
    assert {hit.id for hit in listed} == {f"p{n}" for n in range(24) if SOURCES[(n + 1) % 4] == value}


@pytest.mark.parametrize("name", ["a\u0000b", "a\u0007b", "tab\there", "del\u007f", "c1\u0085"])
def test_a_field_name_with_a_control_character_is_a_bad_line_naming_it(tmp_path, encoder, name):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"id": "p1", "text": short(1), "year": 2001},
                                                    {"id": "p2", "text": short(2), name: "x"}])
    with pytest.raises(BuildError, match=r"line 2: field .*control characters \(U\+00"):
        build_index(BuildOptions(corpus, tmp_path / "stopped", bm25=False), encoder)
    report = build_index(BuildOptions(corpus, tmp_path / "skipped", skip_bad=True, bm25=False), encoder)
    assert (report.passages, report.skipped) == (1, 1)
    assert read_manifest(tmp_path / "skipped").fields == {"year": "number"}


def many_fields_corpus(path: Path, passages: int, fields_each: int) -> Path:
    return write_jsonl(path, [{"id": f"p{n}", "text": short(n),
                               **{f"f{n * fields_each + i:05d}": i for i in range(fields_each)}} for n in range(passages)])


def test_an_index_declares_at_most_max_fields_and_the_line_past_it_is_a_bad_line(tmp_path, encoder):
    corpus = many_fields_corpus(tmp_path / "corpus.jsonl", 10, 30)  # 300 fields, 30 a line
    with pytest.raises(BuildError, match=rf"line 9: field \"f00269\" would be field {MAX_FIELDS + 14} .* over the "
                                         rf"{MAX_FIELDS} an index may declare \(raise it with --max-fields\)"):
        build_index(BuildOptions(corpus, tmp_path / "stopped", bm25=False), encoder)
    report = build_index(BuildOptions(corpus, tmp_path / "capped", skip_bad=True, bm25=False), encoder)
    assert (report.passages, report.skipped) == (8, 2) and len(read_manifest(tmp_path / "capped").fields) == 240
    build_index(BuildOptions(corpus, tmp_path / "raised", max_fields=300, bm25=False), encoder)
    assert len(read_manifest(tmp_path / "raised").fields) == 300


def test_an_index_of_thousands_of_fields_loads_each_column_whole_and_answers_an_unknown_field_in_a_few_names(
        tmp_path, encoder):
    corpus = many_fields_corpus(tmp_path / "corpus.jsonl", 10, 400)  # 4,000 fields
    build_index(BuildOptions(corpus, tmp_path / "index", max_fields=5000, bm25=False), encoder)
    searcher = Searcher(tmp_path / "index", encoder, load=CPU)
    assert [hit.id for hit in searcher.search("entry", 10, filter={"f03999": 399})] == ["p9"]
    with pytest.raises(FilterError) as unknown:
        searcher.parse_filter({"f0399": 1})
    assert "closest: f03999" in str(unknown.value) and len(str(unknown.value)) < 300
    app = create_app(settings_for(tmp_path / "index"), SearchEngine(searcher))
    for body in ({"query": "x", "filter": {"nope": 1}}, {"query": "x", "fields": ["nope"]}):
        (answer,) = call(app, ("POST", "/search", body))
        assert answer.status_code == 422 and len(answer.content) < 1000, len(answer.content)
        assert "4000 fields, listed in /ready" in answer.text


def test_an_update_whose_added_fields_conflict_with_the_index_fails_before_encoding_naming_both(tmp_path, encoder):
    index = tmp_path / "index"
    build_index(BuildOptions(write_jsonl(tmp_path / "corpus.jsonl", [
        {"id": f"p{n}", "text": short(n), "year": 2000 + n} for n in range(4)]), index, bm25=False), encoder)
    add = write_jsonl(tmp_path / "add.jsonl", [{"id": "p9", "text": short(9), "year": 2009},
                                               {"id": "p10", "text": short(10), "year": "2010"}])
    asked: list = []
    with pytest.raises(BuildError) as refused:
        apply_changes(ChangeOptions(index, add=add), lambda manifest: asked.append(manifest) or encoder)
    assert asked == [] and not (tmp_path / ".index.adding").exists()
    assert str(refused.value).startswith(f"{add}: line 2: field \"year\" is a string here but a number in the index "
                                         f"{index}")
    report = apply_changes(ChangeOptions(index, add=add, skip_bad=True), lambda manifest: encoder)
    assert (report.passages, report.skipped) == (5, 1)
