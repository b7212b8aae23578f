"""Exact search over shards without Ray: the merge of the shards' own top-k lists equals one flat index,
and a ShardedEngine over `build --shard i/3` shards answers as the engine over the whole index."""

from __future__ import annotations

import asyncio
import time

import faiss
import httpx
import numpy as np
import pytest

from retrieval import dense_index
from retrieval.index_format import Manifest, sealed
from retrieval.searcher import Searcher
from retrieval.sharding import ShardHit, ShardIndex, merge_top_k
from service.engine.search_engine import SearchEngine
from service.errors import NotServable, ShardsUnavailable
from service.http.app import create_app
from service.sharded.sharded_engine import LocalShard, ShardedEngine
from tests.conftest import CPU
from tests.test_cross_encoder import tiny_bert
from tests.test_service import call, one, settings_for

N = 3


def flat(vectors: np.ndarray) -> faiss.Index:
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    return index


def shard_lists(vectors: np.ndarray, queries: np.ndarray, k: int) -> list[list[list[ShardHit]]]:
    """Per query, each round-robin shard's own top k, its rows carrying their whole-index row as line."""
    per_shard = []
    for i in range(N):
        rows = np.arange(i, len(vectors), N)
        scores, found = dense_index.search(flat(vectors[rows]), queries, min(k, len(rows)))
        per_shard.append([[ShardHit(float(s), int(rows[r]), f"p{rows[r]}", "") for s, r in zip(ss, rr)]
                          for ss, rr in zip(scores, found)])
    return [[shard[q] for shard in per_shard] for q in range(len(queries))]


def tied_vectors() -> tuple[np.ndarray, np.ndarray]:
    """600 vectors, rows 1, 100, 200 and 500 one passage four times (in all three shards), and queries:
    that passage (the four tie at the top), and one for which they tie at the 2nd to 5th place."""
    rng = np.random.default_rng(7)
    vectors = rng.standard_normal((600, 16)).astype(np.float32)
    vectors[[100, 200, 500]] = vectors[1]
    leader = vectors[1] * 1.01
    vectors[599] = leader  # scores above the four, met after them (FAISS then keeps the later ones)
    queries = np.concatenate([vectors[[1]], rng.standard_normal((24, 16)).astype(np.float32), leader[None]])
    return vectors, queries


@pytest.mark.parametrize("k", [1, 2, 3, 4, 10, 99, 100, 150, 600])
def test_the_flat_search_keeps_the_earliest_rows_of_those_tied_at_the_kth_place(k):
    vectors, queries = tied_vectors()
    everything = dense_index.search(flat(vectors), queries, len(vectors))
    scores, rows = dense_index.search(flat(vectors), queries, k)
    assert np.array_equal(rows, everything[1][:, :k]) and np.array_equal(scores, everything[0][:, :k])
    assert rows[-1, :5].tolist() == [599, 1, 100, 200, 500][:k]  # FAISS alone: [599, 100] at k = 2


@pytest.mark.parametrize("k", [1, 2, 3, 4, 10, 99, 100, 150, 600])
def test_merging_the_shards_top_k_gives_the_flat_index_top_k_rows_and_scores(k):
    vectors, queries = tied_vectors()
    scores, rows = dense_index.search(flat(vectors), queries, k)
    for query, lists in enumerate(shard_lists(vectors, queries, k)):
        merged = merge_top_k(lists, k)
        assert [hit.line for hit in merged] == rows[query].tolist()  # ties too, at the k-th place as well
        assert [hit.score for hit in merged] == scores[query].tolist()  # the same floats, bit for bit


def test_merging_short_and_empty_lists_keeps_what_there_is():
    lists = [[ShardHit(0.9, 3, "a", ""), ShardHit(0.1, 0, "b", "")], [], [ShardHit(0.5, 1, "c", "")]]
    assert [hit.id for hit in merge_top_k(lists, 10)] == ["a", "c", "b"]
    assert merge_top_k([[], []], 5) == []


@pytest.fixture(scope="module")
def sharded(small_shards) -> ShardedEngine:
    # Given out of order: the engine reads which shard each is from its manifest.
    clients = [LocalShard(ShardIndex(folder, load=CPU), f"shard-{i}") for i, folder in enumerate(small_shards)]
    return ShardedEngine.over(clients[::-1], device="cpu")


@pytest.fixture(scope="module")
def whole(merged_shards) -> SearchEngine:
    return SearchEngine.open(merged_shards, load=CPU)  # its queries encoded as the sharded engine's: the default


@pytest.mark.parametrize("k", [10, 1000])
def test_a_sharded_engine_answers_as_one_flat_index_over_the_same_passages(sharded, whole, demo_queries, k):
    queries = list(demo_queries.values())[:50]
    for query in queries[:5]:  # one at a time, as /search runs a lone request
        assert sharded.search(query, k).hits == whole.search(query, k).hits
    # one batch (FAISS's BLAS path), as /search/batch and micro-batches run
    together = zip(sharded.search_batch(queries, k), whole.search_batch(queries, k))
    assert all(mine.hits == theirs.hits for mine, theirs in together)
    assert len(whole.search(queries[0], k).hits) == min(k, 300)
    assert sharded.search(queries[0], k).shards == {"answered": ["0/3", "1/3", "2/3"], "missing": []}


def test_a_sharded_engine_refuses_bm25_and_hybrid_saying_why(sharded):
    for mode in ("bm25", "hybrid"):
        with pytest.raises(NotServable, match="corpus-wide"):
            sharded.plan(10, mode=mode)


class Down:
    def __init__(self, shard: LocalShard) -> None:
        self.shard, self.name = shard, shard.name

    def describe(self) -> dict:
        return self.shard.describe()

    def search(self, vectors, k, build=None):
        raise ConnectionError("replica gone")


def test_a_shard_that_does_not_answer_fails_the_search_naming_it_unless_partial_is_allowed(small_shards, whole):
    clients = [LocalShard(ShardIndex(folder, load=CPU), f"shard-{i}") for i, folder in enumerate(small_shards)]
    clients[1] = Down(clients[1])
    sharded = ShardedEngine.over(clients, device="cpu")
    query = "join two paths"
    with pytest.raises(ShardsUnavailable,
                       match=r"shard 1/3 \(shard-1\) failed \(ConnectionError: replica gone\).*allow_partial"):
        sharded.search(query, 10)
    partial = sharded.search(query, 10, allow_partial=True)
    assert partial.shards == {"answered": ["0/3", "2/3"], "missing": ["1/3"]}
    shard_one = {pid for pid, _ in ShardIndex(small_shards[1]).passages.get(range(100))}
    expected = [hit for hit in whole.search(query, 300).hits if hit.id not in shard_one][:10]
    assert [(h.id, h.score) for h in partial.hits] == [(h.id, h.score) for h in expected]


def test_a_replica_that_holds_another_build_than_the_one_checked_at_start_fails_the_search(small_shards):
    clients = [LocalShard(ShardIndex(folder, load=CPU), f"shard-{i}") for i, folder in enumerate(small_shards)]
    sharded = ShardedEngine.over(clients, device="cpu")
    assert sharded.search("join two paths", 10).shards["missing"] == []
    replaced = ShardIndex(small_shards[1], load=CPU)  # as a replica restarted after the folder was rebuilt
    replaced.manifest = Manifest.model_validate(sealed(replaced.manifest.model_copy(
        update={"built_at": "2030-01-01T00:00:00+00:00"})))
    clients[1].index = replaced
    with pytest.raises(ShardsUnavailable, match=r"shard 1/3 \(shard-1\) failed \(OtherBuild: .* another build"):
        sharded.search("join two paths", 10)
    assert sharded.search("join two paths", 10, allow_partial=True).shards["missing"] == ["1/3"]


class Silent(Down):
    """Takes the search and never answers: its result waits out whatever time it is given."""

    def search(self, vectors, k, build=None):
        return self

    def result(self, timeout_s=None):
        time.sleep(timeout_s)
        raise TimeoutError("no answer")


class FetchedLater(Down):
    """Answers at once, but, like a Serve response over gRPC, its answer is fetched only within a timeout
    above zero."""

    def search(self, vectors, k, build=None):
        return self.Answer(self.shard.search(vectors, k, build).result())

    class Answer:
        def __init__(self, value) -> None:
            self.value = value

        def result(self, timeout_s=None):
            if timeout_s is not None and timeout_s <= 0:
                raise TimeoutError("not fetched yet")
            return self.value


def test_a_silent_shard_fails_the_search_after_the_timeout_saying_so(small_shards):
    clients = [LocalShard(ShardIndex(folder, load=CPU), f"shard-{i}") for i, folder in enumerate(small_shards)]
    clients[1] = Silent(clients[1])
    with pytest.raises(ShardsUnavailable, match=r"shard 1/3 \(shard-1\) did not answer within 0.2 s \(TimeoutError"):
        ShardedEngine.over(clients, device="cpu", timeout_s=0.2).search("join two paths", 10)


def test_a_silent_shard_does_not_make_a_later_shard_that_answered_count_as_missing(small_shards):
    clients = [LocalShard(ShardIndex(folder, load=CPU), f"shard-{i}") for i, folder in enumerate(small_shards)]
    clients[1], clients[2] = Silent(clients[1]), FetchedLater(clients[2])
    sharded = ShardedEngine.over(clients, device="cpu", timeout_s=0.2)
    partial = sharded.search("join two paths", 10, allow_partial=True)
    assert partial.shards == {"answered": ["0/3", "2/3"], "missing": ["1/3"]}


class Slow(Down):
    """Answers right, but only `delay_s` after it is asked (a shard replica busy elsewhere)."""

    delay_s = 1.5

    def search(self, vectors, k, build=None):
        asked, answer = time.monotonic(), self.shard.search(vectors, k, build).result()
        return self.Late(answer, asked + self.delay_s)

    class Late:
        def __init__(self, value, ready_at: float) -> None:
            self.value, self.ready_at = value, ready_at

        def result(self, timeout_s=None):
            time.sleep(max(0.0, self.ready_at - time.monotonic()))
            return self.value


@pytest.mark.parametrize("microbatch", [True, False])
def test_a_slow_shard_delays_only_the_requests_that_wait_for_it_not_the_queue_behind_them(
        small_shards, small_index, whole, microbatch):
    """The served engine waits for the shards off the model thread: a request that comes while an
    earlier one waits for a slow shard is encoded and sent at once, and both wait out the one delay
    together (before, the model thread waited, and the second queued behind the first's wait)."""
    clients = [LocalShard(ShardIndex(folder, load=CPU), f"shard-{i}") for i, folder in enumerate(small_shards)]
    clients[1] = Slow(clients[1])
    app = create_app(settings_for(small_index, microbatch=microbatch), ShardedEngine.over(clients, device="cpu"))
    queries = ["join two paths", "read a file line by line"]

    async def staggered():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            async def search(query, after_s):
                await asyncio.sleep(after_s)
                return await client.post("/search", json={"query": query, "k": 10})
            return await asyncio.gather(search(queries[0], 0.0), search(queries[1], Slow.delay_s / 3))

    first, second = asyncio.run(staggered())
    assert first.status_code == second.status_code == 200
    for response, query in zip((first, second), queries):
        expected = whole.search(query, 10).hits
        assert [(h["id"], h["score"]) for h in response.json()["results"]] == [(h.id, h.score) for h in expected]
    # Its wait for the model thread: at once, not the rest of the first request's wait for the shard.
    assert second.json()["latency_ms"]["queue"] < 1000 * Slow.delay_s / 3  # ms


def test_a_served_sharded_search_reranks_on_the_model_thread_after_the_shards_answer(
        small_shards, small_index, merged_shards, tmp_path):
    """Reranking comes back to the model thread once the (slow) shards answered: the same ranking and
    scores as the merged index reranked by the same model, and its time reported as rerank."""
    monobert = tiny_bert(tmp_path / "monobert")
    clients = [LocalShard(ShardIndex(folder, load=CPU), f"shard-{i}") for i, folder in enumerate(small_shards)]
    clients[1] = Slow(clients[1])
    sharded = ShardedEngine.over(clients, device="cpu", rerankers=[monobert])
    whole = SearchEngine(Searcher(merged_shards, load=CPU), sharded.rerankers)  # queries encoded as the sharded
    app = create_app(settings_for(small_index, rerankers=[monobert]), sharded)
    response = one(app, "POST", "/search", {"query": "join two paths", "k": 5, "rerank": True, "depth": 10})
    assert response.status_code == 200, response.text
    expected = whole.search("join two paths", 5, rerank_depth=10, reranker="monobert")
    assert [(h["id"], h["score"]) for h in response.json()["results"]] == [(h.id, h.score) for h in expected.hits]
    assert response.json()["latency_ms"]["retrieve"] >= 1000 * Slow.delay_s * 0.9  # the shard's delay, not rerank's
    assert response.json()["latency_ms"]["rerank"] < 1000 * Slow.delay_s / 2


class Dying(Down):
    """Answers until `dead` is set (its replica killed), then fails as Down does, until it is unset
    (Serve started another)."""

    dead = False

    def search(self, vectors, k, build=None):
        return super().search(vectors, k, build) if self.dead else self.shard.search(vectors, k, build)


def test_a_served_batch_whose_shard_is_down_fails_with_503_naming_it_and_the_next_batch_is_served(
        small_shards, small_index):
    clients = [LocalShard(ShardIndex(folder, load=CPU), f"shard-{i}") for i, folder in enumerate(small_shards)]
    clients[1] = Dying(clients[1])
    app = create_app(settings_for(small_index), ShardedEngine.over(clients, device="cpu"))
    clients[1].dead = True
    down = call(app, *[("POST", "/search", {"query": q, "k": 3}) for q in ("join two paths", "open a socket")])
    assert [r.status_code for r in down] == [503, 503]
    assert all("shard 1/3 (shard-1) failed (ConnectionError: replica gone)" in r.json()["detail"] for r in down)
    clients[1].dead = False
    assert one(app, "POST", "/search", {"query": "join two paths", "k": 3}).status_code == 200
