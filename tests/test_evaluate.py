"""Evaluation: trec_eval measures through ir-measures, the consistency factor (paper 000 eq. 5),
run/qrels/query files, the SMART reader, and dense retrieval quality on Cranfield."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from index_builder.build import BuildOptions, build_index
from index_builder.cli import main as cli_main
from index_builder.convert_cranfield import convert_cisi, convert_cranfield, read_smart
from index_builder.eval_command import EvalOptions, evaluate_index
from index_builder.evaluate import consistency_factor, format_table
from retrieval.evaluation import metrics, run_queries
from models.cross_encoder import CrossEncoder
from models.encoder import BiEncoder
from retrieval.readers import InputFileError, read_qrels, read_queries, read_run, write_run
from retrieval.searcher import Searcher
from tests.conftest import CPU, CRANFIELD
from tests.test_cross_encoder import tiny_bert

needs_cranfield = pytest.mark.skipif(not CRANFIELD.is_dir(), reason="../shared/data/cranfield is absent")


def test_metrics_equal_hand_computed_values(tmp_path):
    (tmp_path / "qrels").write_text("q1 0 d1 1\nq1 0 d3 2\nq2 0 d9 1\n")
    qrels = read_qrels(tmp_path / "qrels")
    run = {"q1": [("d2", 3.0), ("d1", 2.0), ("d3", 1.0)], "q2": [("d9", 5.0)]}
    values = metrics(qrels, run)
    # q1: first relevant at rank 2; q2: at rank 1.
    assert values["MRR@10"] == pytest.approx((1 / 2 + 1) / 2)
    assert values["MAP"] == pytest.approx(((1 / 2 + 2 / 3) / 2 + 1) / 2)
    dcg = 1 / math.log2(3) + 2 / math.log2(4)  # trec_eval's gain is the grade itself
    ideal = 2 + 1 / math.log2(3)
    assert values["nDCG@10"] == pytest.approx((dcg / ideal + 1) / 2)
    assert values["Recall@100"] == values["Recall@1000"] == pytest.approx(1.0)


def test_metrics_average_over_the_evaluated_queries_not_every_judged_one(tmp_path):
    (tmp_path / "qrels").write_text("q1 0 d1 1\nq2 0 d9 1\nq3 0 d5 1\n")
    qrels = read_qrels(tmp_path / "qrels")
    # q3 is judged but not evaluated: left out. q2 is evaluated and found nothing: it counts 0.
    values = metrics(qrels, {"q1": [("d1", 1.0)], "q2": []})
    assert values["MRR@10"] == pytest.approx((1 + 0) / 2)
    assert metrics(qrels, {"q1": [("d1", 1.0)]})["nDCG@10"] == pytest.approx(1.0)


@pytest.mark.parametrize("order", [["d1", "d2"], ["d2", "d1"]])
def test_metrics_score_a_list_in_its_own_order_when_scores_tie(tmp_path, order):
    # RRF gives exact ties often; the answer's order, not the passage ids, decides the rank.
    (tmp_path / "qrels").write_text("q1 0 d2 1\n")
    values = metrics(read_qrels(tmp_path / "qrels"), {"q1": [(pid, 0.5) for pid in order]})
    assert values["MRR@10"] == pytest.approx(1 / (order.index("d2") + 1))


def test_consistency_factor_is_the_mean_share_found_in_the_reference_top_1000():
    run = {"q1": [("a", 3), ("b", 2), ("c", 1), ("d", 0)], "q2": [("x", 1), ("y", 0)]}
    reference = {"q1": [("a", 9), ("c", 8), ("z", 7)], "q2": [("q", 1)]}
    assert consistency_factor(run, reference, depth=2) == pytest.approx((1 / 2 + 0) / 2)
    assert consistency_factor(run, reference, depth=4) == pytest.approx((2 / 4 + 0) / 2)
    assert consistency_factor(run, reference, depth=4, reference_depth=1) == pytest.approx((1 / 4 + 0) / 2)


def test_run_file_round_trips(tmp_path):
    run = {"q1": [("d1", 2.5), ("d2", 1.25)], "q2": [("d7", 0.5)]}
    write_run(tmp_path / "run", run, tag="dense")
    assert (tmp_path / "run").read_text().splitlines()[0] == "q1 Q0 d1 1 2.500000 dense"
    assert read_run(tmp_path / "run") == run


def test_queries_and_qrels_read_tsv_beir_and_trec_forms(tmp_path):
    (tmp_path / "q.tsv").write_text("1\twhat is lift\n2\tdrag\n")
    (tmp_path / "q.jsonl").write_text('{"_id": "1", "text": "what is lift"}\n{"_id": "2", "text": "drag"}\n')
    assert read_queries(tmp_path / "q.tsv") == read_queries(tmp_path / "q.jsonl") == {"1": "what is lift", "2": "drag"}
    (tmp_path / "beir.tsv").write_text("query-id\tcorpus-id\tscore\n1\td1\t1\n")
    (tmp_path / "trec").write_text("1 0 d1 1\n")
    assert read_qrels(tmp_path / "beir.tsv") == read_qrels(tmp_path / "trec")
    (tmp_path / "broken").write_text("1 d1\n")
    with pytest.raises(InputFileError, match="line 1"):
        read_qrels(tmp_path / "broken")


def test_eval_cli_writes_a_run_and_prints_the_measures(small_index, tmp_path, capsys):
    (tmp_path / "q.tsv").write_text("q0001\tEvaluate an expression node or a string containing only a Python expression.\n")
    (tmp_path / "qrels").write_text("q0001 0 p00154 1\n")
    args = ["eval", "--index", str(small_index), "--queries", str(tmp_path / "q.tsv"), "--qrels", str(tmp_path / "qrels"),
            "--runs-dir", str(tmp_path / "runs"), "--k", "100", "--compare", str(tmp_path / "reference")]
    write_run(tmp_path / "reference", {"q0001": [("p00154", 1.0)]}, tag="external")
    assert cli_main(args + ["--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    for mode in ("dense", "bm25", "hybrid-interleave", "hybrid-interleave-bm25-first", "hybrid-rrf"):
        assert f"\n{mode} " in printed
        assert len(read_run(tmp_path / "runs" / f"{mode}.run")["q0001"]) <= 100
    assert len(read_run(tmp_path / "runs" / "dense.run")["q0001"]) == 100
    # At k = 100 the bm25 run is at most a top 100 (only passages sharing a term), so C(dense, 1000) is
    # not printed; the reference holds 1 hit.
    bm25_depth = max(len(hits) for hits in read_run(tmp_path / "runs" / "bm25.run").values())
    assert f"consistency of dense with bm25's top {bm25_depth}: C(dense, 10) = " in printed
    assert "C(dense, 1000)" not in printed
    assert "consistency of dense with reference's top 1: C(dense, 10) = " in printed


def test_eval_from_python_returns_each_rows_measures_and_runs_as_the_command_prints_them(small_index, tmp_path,
                                                                                      capsys):
    (tmp_path / "q.tsv").write_text("q0001\tEvaluate an expression node or a string containing only a Python expression.\n")
    (tmp_path / "qrels").write_text("q0001 0 p00154 1\n")
    report = evaluate_index(EvalOptions(small_index, tmp_path / "q.tsv", tmp_path / "qrels", modes=["dense", "bm25"],
                                        k=20, device="cpu"))
    assert list(report.table) == list(report.runs) == ["dense", "bm25"]
    assert report.table["dense"]["nDCG@10"] == metrics(read_qrels(tmp_path / "qrels"), report.runs["dense"])["nDCG@10"]
    assert len(report.runs["dense"]["q0001"]) == 20
    assert cli_main(["eval", "--index", str(small_index), "--queries", str(tmp_path / "q.tsv"), "--qrels",
                     str(tmp_path / "qrels"), "--modes", "dense", "bm25", "--k", "20", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    table = format_table(report.table).splitlines()
    assert [line.split()[:2] for line in printed.splitlines()[1:3]] == [line.split()[:2] for line in table[1:3]]


def test_eval_rerank_ranks_as_the_reranker_called_by_hand(small_index, searcher, demo_queries, tmp_path, capsys):
    # A plain Hugging Face sequence-classification folder with one logit, like the public ms-marco cross-encoders.
    folder = tiny_bert(tmp_path / "one-logit", num_labels=1)
    queries = {q: demo_queries[q] for q in ("q0001", "q0002", "q0003")}
    (tmp_path / "q.tsv").write_text("".join(f"{q}\t{text}\n" for q, text in queries.items()))
    (tmp_path / "qrels").write_text("q0001 0 p00154 1\n")
    args = ["eval", "--index", str(small_index), "--queries", str(tmp_path / "q.tsv"), "--qrels", str(tmp_path / "qrels"),
            "--modes", "dense", "bm25", "--rerank", str(folder), "--depth", "20", "--k", "30", "--runs-dir", str(tmp_path / "runs"),
            "--device", "cpu"]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    assert "\ndense+one-logit " in printed and "\nbm25+one-logit " in printed
    assert "1 rerankers at depth 20" in printed
    by_hand = CrossEncoder(folder, device="cpu")
    for mode in ("dense", "bm25"):
        run = read_run(tmp_path / "runs" / f"{mode}+one-logit.run")
        for qid, query in queries.items():
            hits = searcher.search(query, k=30, mode=mode)
            scores = by_hand.score(query, [hit.text for hit in hits[:20]])
            expected = [hits[i].id for i in sorted(range(20), key=lambda i: (-scores[i], i))]
            tail = [hit.id for hit in hits[20:]]  # below the reranked 20, in retrieval order
            ranked = sorted(run[qid], key=lambda pair: -pair[1])
            assert [docid for docid, _ in ranked] == expected + tail, (mode, qid)


def test_eval_adds_a_row_per_retrieval_weight_ordered_by_the_blend_a_request_gets(small_index, searcher, demo_queries,
                                                                                  tmp_path, capsys):
    folder = tiny_bert(tmp_path / "one-logit", num_labels=1)
    queries = {q: demo_queries[q] for q in ("q0001", "q0002")}
    (tmp_path / "q.tsv").write_text("".join(f"{q}\t{text}\n" for q, text in queries.items()))
    (tmp_path / "qrels").write_text("q0001 0 p00154 1\n")
    args = ["eval", "--index", str(small_index), "--queries", str(tmp_path / "q.tsv"), "--qrels", str(tmp_path / "qrels"),
            "--modes", "dense", "--rerank", str(folder), "--depth", "20", "--k", "20", "--retrieval-weight", "0", "2",
            "--runs-dir", str(tmp_path / "runs"), "--device", "cpu"]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    assert "\ndense+one-logit " in printed and "\ndense+one-logit~w2 " in printed
    by_hand = CrossEncoder(folder, device="cpu")
    blended = read_run(tmp_path / "runs" / "dense+one-logit~w2.run")
    for qid, query in queries.items():
        hits = searcher.search(query, k=20, mode="dense")
        scores = np.asarray(by_hand.score(query, [hit.text for hit in hits]), dtype=np.float64)
        first = np.array([hit.score for hit in hits], dtype=np.float64)
        blend = (scores - scores.mean()) / scores.std() + 2 * (first - first.mean()) / first.std()
        expected = [hits[i].id for i in sorted(range(20), key=lambda i: (-blend[i], i))]
        assert [docid for docid, _ in sorted(blended[qid], key=lambda pair: -pair[1])] == expected, qid


def test_eval_ensemble_row_orders_by_the_mean_of_the_rerankers_standardised_scores(small_index, demo_queries,
                                                                                   tmp_path, capsys):
    folders = [tiny_bert(tmp_path / "wide", num_labels=1), tiny_bert(tmp_path / "narrow", num_labels=1, hidden=32)]
    queries = {q: demo_queries[q] for q in ("q0001", "q0002", "q0003")}
    (tmp_path / "q.tsv").write_text("".join(f"{q}\t{text}\n" for q, text in queries.items()))
    (tmp_path / "qrels").write_text("q0001 0 p00154 1\n")
    args = ["eval", "--index", str(small_index), "--queries", str(tmp_path / "q.tsv"), "--qrels", str(tmp_path / "qrels"),
            "--modes", "dense", "--rerank", *map(str, folders), "--ensemble", "--depth", "20", "--k", "20",
            "--retrieval-weight", "0", "2", "--runs-dir", str(tmp_path / "runs"), "--device", "cpu"]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    assert "\ndense+ensemble " in printed and "\ndense+ensemble~w2 " in printed
    assert "2 rerankers at depth 20" in printed
    members = [CrossEncoder(folder, device="cpu") for folder in folders]
    searcher = Searcher(small_index, load=CPU)  # its queries encoded as eval's are: the default backend
    alone, blended = (read_run(tmp_path / "runs" / f"dense+ensemble{suffix}.run") for suffix in ("", "~w2"))

    def z(values):
        values = np.asarray(values, dtype=np.float64)
        return (values - values.mean()) / values.std()

    def order(run, qid):
        return [docid for docid, _ in sorted(run[qid], key=lambda pair: -pair[1])]

    differs_from_a_member = False
    for qid, query in queries.items():
        hits = searcher.search(query, k=20, mode="dense")
        scores = [member.score(query, [hit.text for hit in hits]) for member in members]
        mean = (z(scores[0]) + z(scores[1])) / 2
        by_mean = [hits[i].id for i in sorted(range(20), key=lambda i: (-mean[i], i))]
        blend = z(mean) + 2 * z([hit.score for hit in hits])
        assert order(alone, qid) == by_mean, qid
        assert order(blended, qid) == [hits[i].id for i in sorted(range(20), key=lambda i: (-blend[i], i))], qid
        differs_from_a_member |= any(by_mean != [hits[i].id for i in np.argsort(-member, kind="stable")]
                                     for member in scores)
    assert differs_from_a_member  # the two members disagree, so the row is neither of them


def test_eval_reranked_rows_hold_k_passages_when_depth_exceeds_k(small_index, demo_queries, tmp_path):
    folder = tiny_bert(tmp_path / "one-logit", num_labels=1)
    (tmp_path / "q.tsv").write_text(f"q0001\t{demo_queries['q0001']}\n")
    (tmp_path / "qrels").write_text("q0001 0 p00154 1\n")
    args = ["eval", "--index", str(small_index), "--queries", str(tmp_path / "q.tsv"), "--qrels", str(tmp_path / "qrels"),
            "--modes", "dense", "--rerank", str(folder), "--depth", "40", "--k", "10", "--runs-dir", str(tmp_path / "runs"),
            "--device", "cpu"]
    assert cli_main(args) == 0
    assert len(read_run(tmp_path / "runs" / "dense+one-logit.run")["q0001"]) == 10  # as the service answers


def test_eval_refuses_options_it_cannot_honour_before_loading_anything(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    common = ["eval", "--index", str(tmp_path / "none"), "--queries", "q", "--qrels", "r"]
    cases = [
        (["--modes", "bm25", "--compare", "x.run"], "--compare measures the dense run's consistency with a run: "
                                                   "add dense to --modes"),
        (["--rerank", str(tmp_path / "a" / "final"), str(tmp_path / "b" / "final")],
         "--rerank: two folders would both be the table row 'final'; rename one"),
        (["--retrieval-weight", "1"], "--retrieval-weight blends a reranker's score with the first stage's: add --rerank"),
        (["--rerank-backend", "onnx-int8"], "--rerank-backend is the backend a reranker runs on: add --rerank"),
        (["--rerank", str(tmp_path / "a"), "--ensemble"],
         "--ensemble averages two rerankers or more: give --rerank two folders or more"),
        (["--rerank", str(tmp_path / "a"), str(tmp_path / "ensemble"), "--ensemble"],
         "--ensemble: a reranker folder would be the ensemble's table row 'ensemble'; rename it"),
        (["--rerank", str(tmp_path / "a"), "--retrieval-weight", "-1"],
         "--retrieval-weight: each weight must be from 0 to 100, got [-1.0]"),
    ]
    for extra, reason in cases:
        assert cli_main(common + extra) == 2
        assert capsys.readouterr().err.strip() == f"error: {reason}"


def test_query_and_judgement_files_may_start_with_a_byte_order_mark(tmp_path):
    (tmp_path / "q.tsv").write_text("\ufeff1\twhat is lift\n", encoding="utf-8")
    (tmp_path / "q.jsonl").write_text('\ufeff{"_id": "1", "text": "what is lift"}\n', encoding="utf-8")
    (tmp_path / "beir.tsv").write_text("\ufeffquery-id\tcorpus-id\tscore\n1\td1\t1\n", encoding="utf-8")
    (tmp_path / "trec").write_text("\ufeff1 0 d1 1\n", encoding="utf-8")
    assert read_queries(tmp_path / "q.tsv") == read_queries(tmp_path / "q.jsonl") == {"1": "what is lift"}
    assert read_qrels(tmp_path / "beir.tsv") == read_qrels(tmp_path / "trec") == {"1": {"d1": 1}}


def test_a_query_id_given_twice_is_refused_naming_both_lines(tmp_path):
    (tmp_path / "q.tsv").write_text("1\twhat is lift\n2\tdrag\n1\tthrust\n")
    with pytest.raises(InputFileError, match=r"line 3: query id '1' again \(first on line 1\)"):
        read_queries(tmp_path / "q.tsv")


@needs_cranfield
def test_cranfield_query_ids_are_positions_not_dot_i_numbers(tmp_path):
    dot_i = [record_id for record_id, _ in read_smart(CRANFIELD / "cran.qry")]
    assert dot_i[:3] == ["001", "002", "004"]
    counts = convert_cranfield(CRANFIELD, tmp_path)
    assert counts == {"documents": 1398, "queries": 225, "judgements": 1612}
    queries = read_queries(tmp_path / "queries.tsv")
    assert list(queries)[:3] == ["1", "2", "3"]
    assert queries["3"].startswith("what problems of heat conduction in composite slabs")


def test_cisi_keeps_titles_apart_and_only_its_judged_questions(tmp_path):
    (tmp_path / "CISI.ALL").write_text(".I 1\n.T\nDewey Decimal\nClassification\n.A\nComaromi, J.P.\n.W\n   A history\n"
                                       "of the DDC.\n.X\n1\t5\t1\n.I 2\n.T\nIndexing\n.W\nTerms and their use.\n")
    (tmp_path / "CISI.QRY").write_text(".I 1\n.W\nWhat is the\nhistory of the DDC?\n.I 2\n.W\nNever judged.\n")
    (tmp_path / "CISI.REL").write_text("     1      1\t0\t0.000000\n     1      2\t0\t0.000000\n")
    assert convert_cisi(tmp_path, tmp_path / "out") == {"documents": 2, "queries": 1, "judgements": 2}
    first = json.loads((tmp_path / "out" / "corpus.jsonl").read_text().splitlines()[0])
    assert first == {"_id": "1", "title": "Dewey Decimal Classification", "text": "A history of the DDC."}
    assert read_queries(tmp_path / "out" / "queries.tsv") == {"1": "What is the history of the DDC?"}
    assert read_qrels(tmp_path / "out" / "qrels.txt") == {"1": {"1": 1, "2": 1}}


@needs_cranfield
@pytest.mark.slow
def test_dense_retrieval_quality_on_cranfield_matches_the_reference(tmp_path_factory, encoder):
    """Reference outside the project: MiniLM cosine nDCG@10 0.382, MRR@10 0.538 (raw inner product: 0.242/0.388)."""
    data = tmp_path_factory.mktemp("cranfield")
    convert_cranfield(CRANFIELD, data)
    build_index(BuildOptions(data / "corpus.tsv", data / "index", bm25=False), encoder)
    # Cranfield's queries run past RepBERT's 20 tokens; the reference used the model's own 256, now the default.
    searcher = Searcher(data / "index", BiEncoder(device="cpu"))
    values = metrics(read_qrels(data / "qrels.txt"), run_queries(searcher, read_queries(data / "queries.tsv"), 100))
    assert values["nDCG@10"] > 0.35 and values["MRR@10"] > 0.50  # measured 0.374 / 0.535
