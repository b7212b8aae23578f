"""`eval` on an index that carries candidate structures: every dense-reading mode gets its exact row (every
vector scanned, as the same index without structures answers) and a row per structure (MODE@KIND), with the
same measures and its recall@10 against the exact row on the very queries evaluated."""

from __future__ import annotations

import contextlib
import io

import pytest

from index_builder.cli import main as cli_main
from index_builder.evaluate import RECALL_AGAINST_EXACT, EvalRow, eval_rows, recall_against_exact
from retrieval.readers import read_run
from retrieval.searcher import Searcher
from tests.conftest import CPU
from tests.test_candidates import copy_of
from tests.test_cross_encoder import tiny_bert

QUERIES = [f"q{n:04d}" for n in range(1, 41)]  # their relevant passages are in the small index
ROWS = ("dense", "dense@hnsw", "dense@binary", "bm25", "hybrid-rrf", "hybrid-rrf@hnsw", "hybrid-rrf@binary")
K = 10


@pytest.fixture(scope="module")
def structured_index(tmp_path_factory, small_index):
    """The small index with a HNSW graph (default parameters) and a sign-bit scan rescoring only 12
    candidates a query, so that its recall may fall short of 1."""
    index = copy_of(small_index, tmp_path_factory.mktemp("eval-structures"))
    assert cli_main(["ann", "--index", str(index), "--kind", "hnsw"]) == 0
    assert cli_main(["ann", "--index", str(index), "--kind", "binary", "--candidates", "12"]) == 0
    return index


@pytest.fixture(scope="module")
def files(tmp_path_factory, demo_queries, demo_qrels):
    folder = tmp_path_factory.mktemp("eval-files")
    (folder / "q.tsv").write_text("".join(f"{q}\t{demo_queries[q]}\n" for q in QUERIES))
    (folder / "qrels").write_text("".join(f"{q} 0 {demo_qrels[q]} 1\n" for q in QUERIES))
    return folder


def evaluate(index, files, runs, *extra) -> str:
    """What `eval` prints (the modes dense, bm25 and hybrid-rrf at k=10, unless `extra` gives --modes too: the
    later wins), its runs written to `runs`."""
    args = ["eval", "--index", str(index), "--queries", str(files / "q.tsv"), "--qrels", str(files / "qrels"),
            "--modes", "dense", "bm25", "hybrid-rrf", "--k", str(K), "--runs-dir", str(runs), "--device", "cpu"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli_main(args + list(extra)) == 0
    return printed.getvalue()


def table(printed: str) -> dict[str, dict[str, str]]:
    """The printed table: each row's cells by column, by row name."""
    lines = printed.splitlines()
    header = [column.strip() for column in lines[0].split("  ") if column.strip()]
    rows = {}
    for line in lines[1:]:
        name, *cells = line.split()
        if len(cells) != len(header):
            break
        rows[name] = dict(zip(header, cells))
    return rows


@pytest.fixture(scope="module")
def structured(structured_index, files, tmp_path_factory):
    """`eval` of the index with structures: what it printed, and its runs' folder."""
    runs = tmp_path_factory.mktemp("runs-structured")
    return evaluate(structured_index, files, runs), runs


@pytest.fixture(scope="module")
def plain(small_index, files, tmp_path_factory):
    """`eval` of the same index without structures."""
    runs = tmp_path_factory.mktemp("runs-plain")
    return evaluate(small_index, files, runs), runs


def test_rows_are_each_mode_exact_then_one_per_structure_for_modes_that_read_the_dense_list():
    rows = eval_rows(["dense", "bm25", "hybrid-rrf"], ["hnsw", "binary"])
    assert [row.name for row in rows] == list(ROWS)
    assert EvalRow("dense").retrieval == {"mode": "dense", "exact": True}
    assert EvalRow("hybrid-rrf", "hnsw").retrieval == {"mode": "hybrid", "fusion": "rrf", "structure": "hnsw"}
    assert [row.name for row in eval_rows(["dense"], [])] == ["dense"]


def test_recall_against_exact_is_the_share_of_the_exact_top_10_held():
    exact = {"q1": [(f"d{i}", 1.0) for i in range(12)], "q2": [("a", 1.0)], "q3": []}
    run = {"q1": [(f"d{i}", 1.0) for i in range(2, 14)], "q2": [("b", 1.0)], "q3": [("c", 1.0)]}
    # q1 holds d2..d9 of d0..d9; q2 misses its one; q3 has no exact list and is left out.
    assert recall_against_exact(run, exact) == pytest.approx((8 / 10 + 0) / 2)
    assert recall_against_exact(exact, exact) == 1.0


def test_eval_prints_an_exact_row_and_a_row_per_structure_with_its_recall(structured):
    printed, runs = structured
    rows = table(printed)
    assert list(rows) == list(ROWS)
    for name in ROWS:
        assert set(rows[name]) == {"MRR@10", "nDCG@10", "Recall@100", "Recall@1000", "MAP", "ms/query",
                                   RECALL_AGAINST_EXACT}
        assert len(read_run(runs / f"{name}.run")) == len(QUERIES)
        if "@" in name:
            recall = float(rows[name][RECALL_AGAINST_EXACT])
            assert 0 <= recall <= 1
            by_hand = recall_against_exact(read_run(runs / f"{name}.run"), read_run(runs / f"{name.split('@')[0]}.run"))
            assert recall == pytest.approx(by_hand, abs=5e-5)
        else:
            assert rows[name][RECALL_AGAINST_EXACT] == "-"  # an exact row has no recall against itself
    assert "MODE@KIND: the dense list from KIND's candidates (hnsw 128, binary 12 per query" in printed
    assert f"evaluated {len(QUERIES)} queries x 3 modes at k={K}, exact and through hnsw, binary" in printed


def test_the_exact_rows_equal_the_eval_of_the_same_index_without_structures(structured, plain):
    (with_structures, runs), (without, plain_runs) = structured, plain
    assert list(table(without)) == ["dense", "bm25", "hybrid-rrf"]
    assert RECALL_AGAINST_EXACT not in without  # no structure, no column: the table is as before
    assert "\ndefault: hybrid-zscore, what a search naming no mode runs on this index\n" in without
    for name in ("dense", "bm25", "hybrid-rrf"):
        assert (runs / f"{name}.run").read_text() == (plain_runs / f"{name}.run").read_text()
        measures = {c: v for c, v in table(with_structures)[name].items() if c not in ("ms/query", RECALL_AGAINST_EXACT)}
        assert measures == {c: v for c, v in table(without)[name].items() if c != "ms/query"}


def test_a_structure_row_is_what_the_searcher_answers_through_that_structure(structured, structured_index, encoder,
                                                                              demo_queries):
    _, runs = structured
    searcher = Searcher(structured_index, encoder, load=CPU)
    texts = [demo_queries[q] for q in QUERIES]
    for kind in ("hnsw", "binary"):
        run = read_run(runs / f"dense@{kind}.run")
        answered = searcher.batch_search(texts, K, mode="dense", structure=kind)
        assert [[docid for docid, _ in run[q]] for q in QUERIES] == [[hit.id for hit in hits] for hits in answered]


def test_exact_flag_keeps_the_exact_rows_only(structured_index, files, tmp_path):
    printed = evaluate(structured_index, files, tmp_path, "--exact")
    assert list(table(printed)) == ["dense", "bm25", "hybrid-rrf"] and RECALL_AGAINST_EXACT not in printed
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bm25.run", "dense.run", "hybrid-rrf.run"]


def test_a_reranker_reranks_every_row_and_its_recall_is_against_the_reranked_exact_row(structured_index, files,
                                                                                        tmp_path):
    folder = tiny_bert(tmp_path / "one-logit", num_labels=1)
    printed = evaluate(structured_index, files, tmp_path / "runs", "--modes", "dense", "--rerank", str(folder),
                       "--depth", "5")
    rows = table(printed)
    assert list(rows) == ["dense", "dense+one-logit", "dense@hnsw", "dense@hnsw+one-logit", "dense@binary",
                          "dense@binary+one-logit"]
    assert rows["dense+one-logit"][RECALL_AGAINST_EXACT] == "-"
    for kind in ("hnsw", "binary"):
        by_hand = recall_against_exact(read_run(tmp_path / "runs" / f"dense@{kind}+one-logit.run"),
                                       read_run(tmp_path / "runs" / "dense+one-logit.run"))
        assert float(rows[f"dense@{kind}+one-logit"][RECALL_AGAINST_EXACT]) == pytest.approx(by_hand, abs=5e-5)
