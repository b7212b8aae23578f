"""Approximate candidate structures (retrieval.candidates, `ann`, `build --ann`): candidates come from the
structure, every score is the exact one from the stored vectors, and the recall card is in the manifest."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import faiss
import numpy as np
import pytest

from index_builder.ann import AnnOptions, add_structure
from index_builder.cli import main as cli_main
from retrieval import dense_index
from retrieval.candidates import ivf, recall, structures
from retrieval.candidates.hnsw import Hnsw
from retrieval.candidates.registry import KINDS
from retrieval.candidates.structures import MAX_CANDIDATES
from retrieval.index_format import INDEX_FILE, MANIFEST_FILE, IndexFormatError, read_manifest
from retrieval.load_options import LoadOptions
from retrieval.searcher import Searcher
from retrieval.text_hashes import TEXT_HASHES_FILE
from tests.conftest import CPU, DEMO, ROOT, SMALL_CORPUS_LINES

HNSW_FILE = "candidates-hnsw.faiss"


def copy_of(index: Path, folder: Path) -> Path:
    shutil.copytree(index, folder / "index")
    return folder / "index"


@pytest.fixture(scope="module")
def hnsw_index(tmp_path_factory, small_index) -> Path:
    """The small index with a HNSW structure of default parameters, added by `ann`."""
    index = copy_of(small_index, tmp_path_factory.mktemp("hnsw"))
    assert cli_main(["ann", "--index", str(index), "--kind", "hnsw"]) == 0
    return index


@pytest.fixture(scope="module")
def approximate(hnsw_index, encoder) -> Searcher:
    return Searcher(hnsw_index, encoder, load=CPU)


@pytest.fixture(scope="module")
def queries(demo_queries) -> list[str]:
    return list(demo_queries.values())


@pytest.fixture(scope="module")
def stored_vectors(small_index) -> np.ndarray:
    index = faiss.read_index(str(small_index / INDEX_FILE))
    return index.reconstruct_n(0, index.ntotal)


def test_ann_prints_one_summary_line_with_kind_passages_seconds_recall_and_size(small_index, tmp_path, capsys):
    index = copy_of(small_index, tmp_path)
    assert cli_main(["ann", "--index", str(index), "--kind", "int8"]) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line
    assert line.startswith(f"int8 over {index}: {SMALL_CORPUS_LINES} passages in ")
    assert "recall@10 1.0000, recall@100 " in line and "candidates-int8.faiss" in line and "MiB" in line


def test_the_recall_card_is_written_into_the_manifest_and_the_structure_checksummed(hnsw_index):
    manifest = read_manifest(hnsw_index, verify_checksums=True)
    (card,) = manifest.candidates
    assert card.kind == "hnsw" and card.file == HNSW_FILE
    assert card.params == {"M": 32, "efConstruction": 200, "efSearch": 128}
    assert card.depth == 128  # efSearch: the candidates HNSW holds at the end of its search anyway
    assert card.recall_queries == "held-out passages" and card.sample == SMALL_CORPUS_LINES  # all 300, < 1000
    assert card.recall_at_10 == 1.0 and card.recall_at_100 >= 0.98
    assert card.seconds >= 0 and card.library == f"faiss {faiss.__version__}"
    assert manifest.files[HNSW_FILE].bytes == (hnsw_index / HNSW_FILE).stat().st_size
    raw = json.loads((hnsw_index / MANIFEST_FILE).read_text())
    assert raw["candidates"][0]["recall_at_10"] == 1.0


def test_the_hnsw_file_holds_the_graph_only_the_vectors_are_index_faiss(hnsw_index):
    assert (hnsw_index / HNSW_FILE).stat().st_size < (hnsw_index / INDEX_FILE).stat().st_size / 2


def test_exact_answers_equal_todays_flat_search_bit_for_bit(approximate, searcher, queries):
    assert approximate.answered_by(approximate.request(10, mode="dense", exact=True)) == "exact"
    for mode in ("dense", "hybrid"):
        found = approximate.batch_search(queries, k=50, mode=mode, exact=True)
        assert found == searcher.batch_search(queries, k=50, mode=mode)  # Hit equality: ids, texts, scores


def test_approximate_answers_carry_exact_scores_of_the_stored_vectors(approximate, queries, stored_vectors):
    assert approximate.answered_by(approximate.request(10, mode="dense")) == "approximate:hnsw"
    vectors = approximate.encode(queries)
    for vector, ranked in zip(vectors, approximate.rank(queries, vectors, approximate.request(100, mode="dense"))):
        rows = [row for row, _ in ranked]
        np.testing.assert_allclose([score for _, score in ranked], stored_vectors[rows] @ vector, rtol=0, atol=1e-6)
        # ordered as the flat search orders: score descending, then row ascending
        assert ranked == sorted(ranked, key=lambda pair: (-pair[1], pair[0]))


def test_hnsw_with_default_parameters_finds_the_exact_top_10_of_every_demo_query(approximate, queries):
    vectors = approximate.encode(queries)
    found = approximate.rank(queries, vectors, approximate.request(10, mode="dense"))
    exact = approximate.rank(queries, vectors, approximate.request(10, mode="dense", exact=True))
    assert [[row for row, _ in ranked] for ranked in found] == [[row for row, _ in ranked] for ranked in exact]
    # a batch's exact scan multiplies through BLAS, a few rows' rescoring does not: the last bit may differ
    np.testing.assert_allclose([[s for _, s in r] for r in found], [[s for _, s in r] for r in exact], atol=1e-6)


def test_a_single_query_gets_the_exact_scans_answer_bit_for_bit(approximate, queries):
    for query in queries[:50]:  # under faiss's BLAS threshold both use the same kernel
        assert approximate.search(query, k=10, mode="dense") == approximate.search(query, k=10, mode="dense", exact=True)


def test_hybrid_modes_take_their_dense_list_from_the_structure(approximate, queries):
    assert approximate.answered_by(approximate.request(10, mode="hybrid")) == "approximate:hnsw"
    assert approximate.answered_by(approximate.request(10, mode="bm25")) == "exact"
    for fusion in ("interleave", "rrf"):
        found = approximate.batch_search(queries[:20], k=10, mode="hybrid", fusion=fusion)
        assert found == approximate.batch_search(queries[:20], k=10, mode="hybrid", fusion=fusion, exact=True)


def test_the_vectors_are_memory_mapped_where_a_structure_is_used_unless_the_caller_says(hnsw_index, encoder,
                                                                                        approximate, searcher):
    assert dense_index.is_mapped(approximate.index)
    assert not dense_index.is_mapped(searcher.index)  # no structure: held, as before
    held = Searcher(hnsw_index, encoder, load=LoadOptions(device="cpu", mmap=False))
    assert not dense_index.is_mapped(held.index) and held.answered_by(held.request(10, mode="dense")) == "approximate:hnsw"


def test_candidates_rescored_per_request_are_bounded(approximate, queries):
    for wrong in (0, MAX_CANDIDATES + 1):
        with pytest.raises(ValueError, match=f"candidates must be between 1 and {MAX_CANDIDATES}, got {wrong}"):
            approximate.search(queries[0], k=10, mode="dense", candidates=wrong)
    # fewer than k is raised to k: the list is whole
    assert len(approximate.search(queries[0], k=20, mode="dense", candidates=5)) == 20
    assert approximate.search(queries[0], k=10, mode="dense", candidates=300) == approximate.search(queries[0], k=10, mode="dense", exact=True)


def test_an_index_without_structures_behaves_as_before(small_index, searcher, queries):
    assert json.loads((small_index / MANIFEST_FILE).read_text())["candidates"] == []
    assert searcher.structures == {} and searcher.answered_by(searcher.request(10, mode="dense")) == "exact"
    assert searcher.batch_search(queries[:10], k=10, mode="dense") == searcher.batch_search(queries[:10], k=10, mode="dense", exact=True)
    with pytest.raises(ValueError, match="structure 'hnsw' is not loaded"):
        searcher.search(queries[0], structure="hnsw")


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_structure_over_no_passages_answers_with_no_rows(kind):
    # An index whose every passage was deleted (update --delete) still carries its structures.
    flat = faiss.IndexFlatIP(8)
    structure = structures.build(flat, kind, progress=False)
    scores, rows = structures.search(structure, flat, np.ones((2, 8), dtype=np.float32), 5)
    assert rows.shape == (2, 5) and (rows == -1).all()


def test_rescore_orders_equal_scores_by_row_as_the_flat_search_does():
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((40, 16)).astype(np.float32)
    vectors[[3, 17, 29, 31]] = vectors[5]  # duplicates: equal scores for every query
    flat = faiss.IndexFlatIP(16)
    flat.add(vectors)
    query = vectors[5:6] + 0.01
    proposed = np.array([[31, 5, 29, 0, 17, 3, 8, -1]])
    scores, rows = structures.rescore(flat, query, proposed, 5)
    assert rows.tolist() == [[3, 5, 17, 29, 31]]
    exact_scores, exact_rows = dense_index.search(flat, query, 5)
    np.testing.assert_array_equal(rows, exact_rows)
    np.testing.assert_array_equal(scores, exact_scores)


DAMAGES = [  # (how a structure file is damaged, what the refusal says)
    ("flip", f"{HNSW_FILE}: sha256 differs from the manifest's"),
    ("truncate", "bytes, manifest says"),
    ("remove", f"{HNSW_FILE} missing"),
]


def damage_file(path: Path, how: str) -> None:
    """One byte flipped mid-file, the last 100 bytes cut, or the file removed."""
    if how == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[:-100])
    else:
        path.unlink()


@pytest.mark.parametrize("damage, reason", DAMAGES)
def test_a_damaged_or_missing_structure_file_is_refused_with_a_reason(hnsw_index, tmp_path, encoder, damage, reason):
    index = copy_of(hnsw_index, tmp_path)
    damage_file(index / HNSW_FILE, damage)
    with pytest.raises(IndexFormatError, match=reason):
        Searcher(index, encoder, load=CPU)


def test_a_structure_of_another_index_is_refused(hnsw_index, tmp_path, encoder):
    index = copy_of(hnsw_index, tmp_path)
    other = faiss.IndexBinaryFlat(384)
    other.add(np.zeros((10, 48), dtype=np.uint8))
    faiss.write_index_binary(other, str(index / "candidates-binary.faiss"))
    manifest = read_manifest(index)
    record = manifest.candidates[0].model_copy(update={"kind": "binary", "file": "candidates-binary.faiss"})
    with pytest.raises(IndexFormatError, match="not the binary structure of index.faiss's 300 384-d vectors"):
        structures.load(index / record.file, record, faiss.read_index(str(index / INDEX_FILE)))


HOLD_THE_LOCK = """
import sys, time
from pathlib import Path
from retrieval import out_lock

with out_lock.hold(Path(sys.argv[1]), "build"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_ann_on_an_index_being_built_exits_2_and_leaves_it_as_it_was(small_index, tmp_path, capsys):
    index = copy_of(small_index, tmp_path)
    before = (index / MANIFEST_FILE).read_bytes()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(index)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        assert cli_main(["ann", "--index", str(index), "--kind", "binary"]) == 2
        assert capsys.readouterr().err.strip() == (
            f"error: {index} is in use by pid {holder.pid} (another build); wait for it to end, or give another --out")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (index / MANIFEST_FILE).read_bytes() == before
    assert not (tmp_path / ".index.ann").exists()


def test_ann_flags_that_do_not_apply_exit_2(small_index, tmp_path, capsys):
    assert cli_main(["ann", "--index", str(small_index), "--kind", "binary", "--ef-search", "64"]) == 2
    assert capsys.readouterr().err.strip() == "error: --ef-search: for kind hnsw only, not binary"
    assert cli_main(["ann", "--index", str(tmp_path), "--kind", "hnsw"]) == 2
    assert "not an index directory" in capsys.readouterr().err


def test_a_low_recall_warns_naming_the_parameter_that_raises_it(small_index, tmp_path, capsys):
    index = copy_of(small_index, tmp_path)
    report = add_structure(index, AnnOptions("binary", candidates=10, recall_threshold=0.999), progress=False)
    assert report.record.recall_at_10 < 0.999
    assert "raise --candidates (now 10)" in capsys.readouterr().err
    # a threshold over any recall always warns
    add_structure(index, AnnOptions("hnsw", {"efSearch": 16}, recall_threshold=1.01, sample=50), progress=False)
    assert "raise --ef-search (now 16), or --candidates (now 16)" in capsys.readouterr().err
    assert [c.kind for c in read_manifest(index).candidates] == ["binary", "hnsw"]  # both kept


def test_recall_on_a_queries_file_records_its_name(small_index, tmp_path):
    index = copy_of(small_index, tmp_path)
    report = add_structure(index, AnnOptions("binary", queries=DEMO / "queries.tsv", device="cpu"), progress=False)
    assert report.record.recall_queries == "queries.tsv" and report.record.sample == 400
    assert read_manifest(index, verify_checksums=True).candidates == [report.record]


def test_build_with_ann_publishes_the_index_with_its_structure(small_corpus, tmp_path, capsys):
    out = tmp_path / "built"
    assert cli_main(["build", "--corpus", str(small_corpus), "--out", str(out), "--device", "cpu",
                     "--ann", "hnsw", "--ef-search", "64"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith(f"built {out}: {SMALL_CORPUS_LINES} passages")
    assert lines[1].startswith(f"hnsw over {out}: {SMALL_CORPUS_LINES} passages")
    (card,) = read_manifest(out, verify_checksums=True).candidates
    assert card.params["efSearch"] == 64 and card.depth == 64
    assert sorted(path.name for path in out.iterdir()) == sorted([MANIFEST_FILE, INDEX_FILE, "passages.sqlite",
                                                                  TEXT_HASHES_FILE, HNSW_FILE, "bm25"])  # by default


def test_an_interrupted_hnsw_build_resumes_from_its_checkpoint(small_index, tmp_path, monkeypatch):
    monkeypatch.setattr(structures, "BLOCK", 100)
    monkeypatch.setattr(Hnsw, "checkpoint_seconds", -1.0)  # a checkpoint after every block
    flat = faiss.read_index(str(small_index / INDEX_FILE))
    checkpoint = tmp_path / "candidates-hnsw.faiss.partial"

    class Interrupted(Exception):
        pass

    class FailsOnTheThirdBlock:
        d, ntotal, calls = flat.d, flat.ntotal, 0

        def reconstruct_n(self, start, count):
            self.calls += 1
            if self.calls == 3:
                raise Interrupted
            return flat.reconstruct_n(start, count)

    with pytest.raises(Interrupted):
        structures.build(FailsOnTheThirdBlock(), "hnsw", progress=False, checkpoint=checkpoint, identity="same")
    assert faiss.read_index(str(checkpoint), faiss.IO_FLAG_SKIP_STORAGE).ntotal == 200
    resumed = structures.build(flat, "hnsw", progress=False, checkpoint=checkpoint, identity="same")
    assert resumed.index.ntotal == SMALL_CORPUS_LINES
    card = recall.measure_recall(resumed, flat)
    assert card.recall_at_10 == 1.0
    other = structures.build(flat, "hnsw", progress=False, checkpoint=checkpoint, identity="other vectors")
    assert other.index.ntotal == SMALL_CORPUS_LINES  # a checkpoint of other vectors is not resumed


@pytest.fixture(scope="module")
def ivf_index(tmp_path_factory, small_index) -> Path:
    """The small index with an ivf structure of 8 lists, 2 scanned for 20 candidates, added by `ann`."""
    index = copy_of(small_index, tmp_path_factory.mktemp("ivf"))
    assert cli_main(["ann", "--index", str(index), "--kind", "ivf", "--nlist", "8", "--nprobe", "2",
                     "--candidates", "20"]) == 0
    return index


def test_ivf_records_its_lists_and_probes_in_the_card(ivf_index, small_index, tmp_path):
    (card,) = read_manifest(ivf_index, verify_checksums=True).candidates
    assert card.kind == "ivf" and card.file == "candidates-ivf.faiss"
    assert card.params == {"nlist": 8, "nprobe": 2} and card.depth == 20
    # by default nlist follows the passages (4 sqrt(300) is near 64) but leaves faiss 39 training points a list
    report = add_structure(copy_of(small_index, tmp_path), AnnOptions("ivf"), progress=False)
    assert report.record.params == {"nlist": SMALL_CORPUS_LINES // 39, "nprobe": ivf.LIST_PARAMS["nprobe"].default}
    assert report.record.depth == ivf.Ivf.depth
    assert ivf.lists(5_000_000) == 8192 and ivf.lists(1_000_000) == 4096


def test_ivf_answers_carry_exact_scores_and_more_probes_find_more(ivf_index, encoder, queries, stored_vectors):
    searcher = Searcher(ivf_index, encoder, load=CPU)
    assert searcher.answered_by(searcher.request(10, mode="dense")) == "approximate:ivf"
    vectors = searcher.encode(queries)
    narrow = searcher.rank(queries, vectors, searcher.request(10, mode="dense"))  # 20 candidates from 2 lists of 8
    for vector, ranked in zip(vectors, narrow):
        rows = [row for row, _ in ranked]
        np.testing.assert_allclose([score for _, score in ranked], stored_vectors[rows] @ vector, rtol=0, atol=1e-6)
    exact = [[row for row, _ in ranked] for ranked in searcher.rank(queries, vectors, searcher.request(10, mode="dense", exact=True))]

    def recall(found):
        return np.mean([len(set(e) & {row for row, _ in f}) / 10 for e, f in zip(exact, found)])

    # up to the default 20 candidates a query scans nprobe lists; 4x as many candidates, 4x the lists: all 8
    structure = searcher.structures["ivf"]
    assert ivf.probes(structure, 10) == 2 and ivf.probes(structure, 80) == 8
    assert recall(narrow) < 1.0
    assert recall(searcher.rank(queries, vectors, searcher.request(10, mode="dense", candidates=80))) == 1.0


def test_a_kinds_flags_are_for_its_kind_only(small_index, tmp_path, capsys):
    assert cli_main(["ann", "--index", str(small_index), "--kind", "hnsw", "--nprobe", "4"]) == 2
    assert capsys.readouterr().err.strip() == "error: --nprobe: for kinds ivf and pq only, not hnsw"
    assert cli_main(["ann", "--index", str(small_index), "--kind", "ivf", "--m", "16"]) == 2
    assert capsys.readouterr().err.strip() == "error: --m: for kind hnsw only, not ivf"
    assert cli_main(["build", "--corpus", str(DEMO / "corpus.tsv"), "--out", str(tmp_path / "out"), "--nprobe", "4",
                     "--candidates", "10"]) == 2
    assert capsys.readouterr().err.strip() == "error: --nprobe, --candidates need --ann KIND"
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def pq_index(tmp_path_factory, small_index) -> Path:
    """The small index with a pq structure of default parameters, added by `ann`."""
    index = copy_of(small_index, tmp_path_factory.mktemp("pq"))
    assert cli_main(["ann", "--index", str(index), "--kind", "pq"]) == 0
    return index


def test_pq_holds_a_48_byte_code_a_passage_at_384_dimensions_and_records_what_it_chose(pq_index):
    (card,) = read_manifest(pq_index, verify_checksums=True).candidates
    # 300 passages: 7 lists (39 training points each); 256 centroids a sub-quantizer, as the 300 can train
    assert card.params == {"nlist": SMALL_CORPUS_LINES // 39, "nprobe": 32, "bytes": 48, "nbits": 8}
    assert card.depth == 512 and card.recall_at_10 == 1.0  # 512 candidates of 300: every passage rescored
    structure = structures.load(pq_index / card.file, card, faiss.read_index(str(pq_index / INDEX_FILE)))
    assert structure.index.code_size == 48 and structure.index.pq.M == 48


def test_pq_answers_carry_exact_scores_and_narrow_ones_miss_what_wider_find(pq_index, encoder, queries,
                                                                             stored_vectors):
    searcher = Searcher(pq_index, encoder, load=CPU)
    vectors = searcher.encoder.encode_queries(queries)
    exact = searcher.rank(queries, vectors, searcher.request(10, mode="dense", exact=True))
    narrow = searcher.rank(queries, vectors, searcher.request(10, mode="dense", candidates=10))
    for vector, ranked in zip(vectors, narrow):
        rows = [row for row, _ in ranked]
        np.testing.assert_allclose([score for _, score in ranked], stored_vectors[rows] @ vector, rtol=0, atol=1e-6)
    assert recall.share_found([[row for row, _ in e] for e in exact], [[row for row, _ in n] for n in narrow], 10) < 1
    wide = searcher.rank(queries, vectors, searcher.request(10, mode="dense", candidates=100))
    assert [[row for row, _ in ranked] for ranked in wide] == [[row for row, _ in ranked] for ranked in exact]


def test_pq_bytes_must_divide_the_dimensions(small_index, capsys):
    assert cli_main(["ann", "--index", str(small_index), "--kind", "pq", "--pq-bytes", "5"]) == 2
    assert capsys.readouterr().err.strip() == "error: pq: --pq-bytes 5 must divide the vectors' 384 dimensions"
    assert [record.kind for record in read_manifest(small_index).candidates] == []
