"""Approximate search over shards: each shard answers through its own candidate structure, scoring its
candidates exactly from its stored vectors, so the merge of the shards' lists stays the exact merge
(retrieval.sharding.merge_top_k) and only recall is approximate. `ann --index` over a `build --shards N`
folder builds one in each shard."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path

import faiss
import numpy as np
import pytest

from index_builder.cli import main as cli_main
from retrieval import dense_index
from retrieval.candidates import structures
from retrieval.candidates.structures import MAX_CANDIDATES
from retrieval.index_format import INDEX_FILE, PASSAGES_FILE, IndexFormatError, read_manifest
from retrieval.load_options import LoadOptions
from retrieval.passage_store import PassageStore
from retrieval.searcher import Searcher
from retrieval.sharding import ShardIndex, shard_folder
from service.engine.search_engine import SearchEngine
from service.errors import NotServable
from service.http.app import create_app
from service.sharded.sharded_engine import LocalShard, ShardedEngine, ShardedSearcher
from tests.conftest import CPU, SMALL_CORPUS_LINES, SMALL_SHARDS
from tests.test_candidates import DAMAGES, HNSW_FILE, damage_file
from tests.test_service import one, settings_for

SHARD_ROWS = SMALL_CORPUS_LINES // SMALL_SHARDS  # 100: the demo head splits evenly
K = 50


def sharded_engine(folders, encoder) -> ShardedEngine:
    """A ShardedEngine over LocalShards of `folders`, with the session's encoder (none loaded again)."""
    clients = [LocalShard(ShardIndex(folder, load=CPU), f"shard-{i}") for i, folder in enumerate(folders)]
    return ShardedEngine(ShardedSearcher(clients, encoder, timeout_s=10.0))


@pytest.fixture(scope="module")
def hnsw_shards(tmp_path_factory, small_shards) -> list[Path]:
    """A copy of the `build --shards 3` folder, a HNSW structure (default parameters) added to each shard
    by one `ann --index FOLDER`."""
    folder = tmp_path_factory.mktemp("sharded-hnsw") / "shards"
    shutil.copytree(small_shards[0].parent, folder)
    assert cli_main(["ann", "--index", str(folder), "--kind", "hnsw"]) == 0
    return [shard_folder(folder, i) for i in range(SMALL_SHARDS)]


@pytest.fixture(scope="module")
def hnsw_whole(tmp_path_factory, merged_shards) -> Path:
    """The shards merged (the very vectors they hold, in corpus order), with a HNSW structure of its own."""
    index = tmp_path_factory.mktemp("whole-hnsw") / "index"
    shutil.copytree(merged_shards, index)
    assert cli_main(["ann", "--index", str(index), "--kind", "hnsw"]) == 0
    return index


@pytest.fixture(scope="module")
def sharded(hnsw_shards, encoder) -> ShardedEngine:
    return sharded_engine(hnsw_shards, encoder)


@pytest.fixture(scope="module")
def whole(hnsw_whole, encoder) -> SearchEngine:
    return SearchEngine(Searcher(hnsw_whole, encoder, load=CPU))


@pytest.fixture(scope="module")
def whole_exact(merged_shards, encoder) -> SearchEngine:
    """The merged shards without a structure: today's flat search."""
    return SearchEngine(Searcher(merged_shards, encoder, load=CPU))


@pytest.fixture(scope="module")
def queries(demo_queries) -> list[str]:
    return list(demo_queries.values())[:40]  # past faiss's BLAS threshold of 20 queries


@pytest.fixture(scope="module")
def stored(merged_shards) -> tuple[np.ndarray, dict[str, int]]:
    """The whole index's stored vectors, and each passage id's row in it."""
    index = faiss.read_index(str(merged_shards / INDEX_FILE))
    ids = [pid for pid, _ in PassageStore(merged_shards / PASSAGES_FILE).get(range(index.ntotal))]
    return index.reconstruct_n(0, index.ntotal), {pid: row for row, pid in enumerate(ids)}


def test_ann_over_a_shards_folder_builds_a_structure_in_each_shard(hnsw_shards):
    for i, shard in enumerate(hnsw_shards):
        manifest = read_manifest(shard, verify_checksums=True)
        (card,) = manifest.candidates
        assert manifest.shard == f"{i}/{SMALL_SHARDS}" and card.kind == "hnsw" and card.file == HNSW_FILE
        assert card.sample == SHARD_ROWS  # measured on the shard's own passages
        assert not (shard.parent / f".{shard.name}.ann").exists()
    assert sorted(path.name for path in hnsw_shards[0].parent.iterdir()) == [s.name for s in hnsw_shards]


def test_ann_prints_a_summary_line_per_shard(small_shards, tmp_path, capsys):
    folder = tmp_path / "shards"
    shutil.copytree(small_shards[0].parent, folder)
    capsys.readouterr()
    assert cli_main(["ann", "--index", str(folder), "--kind", "int8"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == [f"int8 over {shard_folder(folder, i)}" for i in range(SMALL_SHARDS)]


def test_ann_over_a_folder_missing_a_shard_exits_2_and_builds_nothing(small_shards, tmp_path, capsys):
    folder = tmp_path / "shards"
    shutil.copytree(small_shards[0].parent, folder)
    shutil.rmtree(shard_folder(folder, 2))
    capsys.readouterr()
    assert cli_main(["ann", "--index", str(folder), "--kind", "binary"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {folder} does not hold the shards of one build: shard 2/3 missing (given 2 of 3)")
    assert all(read_manifest(shard_folder(folder, i)).candidates == [] for i in range(2))


def test_sharded_approximate_search_equals_unsharded_approximate_search_where_the_candidates_are_the_same(
        sharded, whole, encoder, queries):
    """The candidates are the same where every shard's structure proposes all its rows and the whole
    index's all of its own: at `candidates` 300 (each shard holds 100 rows, the whole index 300; a
    structure is asked for at most the rows there are), where each HNSW graph, searched that wide, reaches
    every row (checked first). Both then score those rows exactly, from the same stored vectors with the
    same kernel, and the merge orders them as the whole index's list is ordered: ids, order and scores
    equal, bit for bit, one query at a time and in a batch, while each answer says it came through the
    structures."""
    depth = SMALL_CORPUS_LINES
    query_vectors = encoder.encode_texts(queries)
    for searcher in [client.index for client in sharded.searcher.clients] + [whole.searcher]:
        rows = structures.candidates(searcher.structures["hnsw"], query_vectors, searcher.index.ntotal)
        assert all(sorted(found) == list(range(searcher.index.ntotal)) for found in rows.tolist())
    for query in queries[:5]:
        mine, theirs = sharded.search(query, K, candidates=depth), whole.search(query, K, candidates=depth)
        assert mine.searched == theirs.searched == "approximate:hnsw"
        assert mine.hits == theirs.hits
    together = zip(sharded.search_batch(queries, K, candidates=depth), whole.search_batch(queries, K, candidates=depth))
    assert all(mine.hits == theirs.hits for mine, theirs in together)


def test_the_merged_answer_is_the_exact_scoring_of_the_shards_candidates_together(sharded, hnsw_shards, stored,
                                                                                   encoder, queries):
    """Below the shards' sizes (20 candidates a shard, k 10) the candidates differ from the whole index's, but
    the answer is still the whole index's exact scoring of the candidates the shards proposed, taken together."""
    vectors, row_of = stored
    k, depth = 10, 20
    query_vectors = encoder.encode_texts(queries)
    hits, shards = sharded.searcher.scatter(query_vectors, sharded.searcher.request(k, candidates=depth))(False)
    assert shards["missing"] == []
    proposed = []
    for folder in hnsw_shards:
        shard = ShardIndex(folder, load=CPU)
        rows = structures.candidates(shard.structures["hnsw"], query_vectors, depth)
        ids = [[pid for pid, _ in shard.passages.get([r for r in ranked if r >= 0])] for ranked in rows.tolist()]
        proposed.append([[row_of[pid] for pid in found] for found in ids])
    union = [sorted({row for shard in proposed for row in shard[q]}) for q in range(len(queries))]
    assert all(len(rows) < SMALL_CORPUS_LINES for rows in union)  # a real choice of candidates
    width = max(map(len, union))
    padded = np.array([rows + [-1] * (width - len(rows)) for rows in union])
    flat = faiss.IndexFlatIP(vectors.shape[1])
    flat.add(vectors)
    scores, rows = structures.rescore(flat, query_vectors, padded, k)
    for found, row_list, score_list in zip(hits, rows.tolist(), scores.tolist()):
        assert [row_of[h.id] for h in found] == row_list
        assert [h.score for h in found] == score_list  # bit for bit


def test_every_approximate_score_is_the_inner_product_of_the_stored_vectors(sharded, stored, encoder, queries):
    vectors, row_of = stored
    query_vectors = encoder.encode_texts(queries)
    for depth in (None, 10):
        hits, _ = sharded.searcher.scatter(query_vectors, sharded.searcher.request(K, candidates=depth))(False)
        for query_vector, found in zip(query_vectors, hits):
            rows = [row_of[h.id] for h in found]
            assert len(found) == K
            np.testing.assert_allclose([h.score for h in found], vectors[rows] @ query_vector, rtol=0, atol=1e-6)
            ranked = [(-h.score, row) for h, row in zip(found, rows)]
            assert ranked == sorted(ranked)  # as the flat search orders: score descending, then row


def test_exact_true_over_shards_equals_the_unsharded_exact_answer(sharded, whole_exact, queries):
    for query in queries[:5]:
        mine = sharded.search(query, K, exact=True)
        assert mine.searched == "exact" and mine.hits == whole_exact.search(query, K).hits
    together = zip(sharded.search_batch(queries, K, exact=True), whole_exact.search_batch(queries, K))
    assert all(mine.hits == theirs.hits for mine, theirs in together)


def test_answers_and_the_cards_in_ready_and_stats_say_each_shard_answers_through_its_own_structure(
        sharded, hnsw_shards, queries):
    assert sharded.answered_by(sharded.plan(10)) == "approximate:hnsw"
    assert sharded.answered_by(sharded.plan(10, exact=True)) == "exact"
    cards = sharded.candidate_cards()
    assert [(card["shard"], card["kind"]) for card in cards] == [(f"{i}/3", "hnsw") for i in range(SMALL_SHARDS)]
    for card, folder in zip(cards, hnsw_shards):
        assert {k: v for k, v in card.items() if k != "shard"} == read_manifest(folder).candidates[0].model_dump()
    app = create_app(settings_for(hnsw_shards[0].parent), sharded)
    for path in ("/ready", "/stats"):
        assert one(app, "GET", path).json()["index"]["candidates"] == cards
    assert one(app, "POST", "/search", {"query": queries[0]}).json()["search"] == "approximate:hnsw"
    assert one(app, "POST", "/search", {"query": queries[0], "exact": True}).json()["search"] == "exact"
    batch = one(app, "POST", "/search/batch", {"queries": queries[:3], "candidates": 30}).json()
    assert batch["search"] == "approximate:hnsw"
    exact_app = create_app(settings_for(hnsw_shards[0].parent, exact_search=True), sharded)  # SEARCH_EXACT_SEARCH
    assert one(exact_app, "POST", "/search", {"query": queries[0]}).json()["search"] == "exact"


def test_candidates_per_request_are_bounded_over_shards(sharded, hnsw_shards, encoder, queries):
    for wrong in (0, MAX_CANDIDATES + 1):
        with pytest.raises(NotServable, match=f"candidates must be between 1 and {MAX_CANDIDATES}, got {wrong}"):
            sharded.plan(10, candidates=wrong)
    shard = ShardIndex(hnsw_shards[0], load=CPU)
    vector = encoder.encode_texts(queries[:1])
    with pytest.raises(ValueError, match="candidates must be between"):
        shard.search(vector, 10, structure="hnsw", candidates=MAX_CANDIDATES + 1)
    with pytest.raises(ValueError, match=r"structure 'binary' is not loaded \(loaded: hnsw\)"):
        shard.search(vector, 10, structure="binary")
    # fewer than k is raised to k: the list is whole
    assert len(shard.search(vector, 20, structure="hnsw", candidates=5)[0]) == 20


def test_a_shard_uses_its_structure_with_its_vectors_memory_mapped_unless_told(hnsw_shards, small_shards):
    with_structure = ShardIndex(hnsw_shards[0], load=CPU)
    assert list(with_structure.structures) == ["hnsw"] and dense_index.is_mapped(with_structure.index)
    assert not dense_index.is_mapped(ShardIndex(hnsw_shards[0], load=LoadOptions(device="cpu", mmap=False)).index)
    plain = ShardIndex(small_shards[0], load=CPU)
    assert plain.structures == {} and not dense_index.is_mapped(plain.index)


@pytest.mark.parametrize("damage, reason", DAMAGES)
def test_a_shard_with_a_damaged_structure_is_refused_with_a_reason(hnsw_shards, tmp_path, damage, reason):
    shard = tmp_path / "shard-1"
    shutil.copytree(hnsw_shards[1], shard)
    damage_file(shard / HNSW_FILE, damage)
    with pytest.raises(IndexFormatError, match=reason):
        ShardIndex(shard, load=CPU)


def test_a_shard_holding_another_shards_structure_is_refused(hnsw_shards, tmp_path):
    """Shards hold as many rows as one another, so only the checksum tells another shard's graph apart."""
    shard = tmp_path / "shard-1"
    shutil.copytree(hnsw_shards[1], shard)
    shutil.copyfile(hnsw_shards[0] / HNSW_FILE, shard / HNSW_FILE)
    record = read_manifest(shard).files[HNSW_FILE]
    if (shard / HNSW_FILE).stat().st_size == record.bytes:
        match = "sha256 differs from the manifest's"
    else:
        match = "bytes, manifest says"
    with pytest.raises(IndexFormatError, match=match):
        ShardIndex(shard, load=CPU)


def test_shards_without_one_shared_structure_answer_exactly_and_warn_which_lacks_it(
        hnsw_shards, small_shards, encoder, whole_exact, queries, caplog):
    """An `ann` over the shards stopped midway: two shards carry the structure, one does not. Answering
    through two of three would make a passage's chance to be found depend on its shard: every search scans."""
    with caplog.at_level(logging.WARNING, logger="service"):
        mixed = sharded_engine([hnsw_shards[0], hnsw_shards[1], small_shards[2]], encoder)
    assert "0/3: hnsw; 1/3: hnsw; 2/3: none" in caplog.text and "ann --index" in caplog.text
    assert mixed.candidate_cards() == [] and mixed.answered_by(mixed.plan(10)) == "exact"
    result = mixed.search(queries[0], K)
    assert result.searched == "exact" and result.hits == whole_exact.search(queries[0], K).hits


def test_the_ray_path_passes_the_structure_and_candidates_to_the_shard_replica(hnsw_shards, encoder, queries):
    """RayShard and ShardDeployment, without a cluster: a handle that calls the deployment's own class."""
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'dense-search[ray]')")
    from service.sharded.deployments import RayShard, ShardDeployment

    replica = ShardDeployment.func_or_class(str(hnsw_shards[0]), CPU)
    sent = []

    class Method:
        def __init__(self, name: str) -> None:
            self.name = name

        def remote(self, *args, **kwargs):
            sent.append((self.name, kwargs))
            answer = getattr(replica, self.name)(*args, **kwargs)
            value = asyncio.run(answer) if asyncio.iscoroutine(answer) else answer
            return type("Response", (), {"result": lambda self, timeout_s=None: value})()

    handle = type("Handle", (), {"describe": Method("describe"), "search": Method("search")})()
    client = RayShard("shard-0", handle)
    assert client.describe()["structures"] == ["hnsw"]
    vector = encoder.encode_texts(queries[:1])
    through = client.search(vector, 10, None, structure="hnsw", candidates=12).result()
    assert sent[-1] == ("search", {"structure": "hnsw", "candidates": 12})
    assert through == ShardIndex(hnsw_shards[0], load=CPU).search(vector, 10, structure="hnsw", candidates=12)
    assert dense_index.is_mapped(replica.index.index)  # mmap left to the shard: mapped, as a structure is loaded
