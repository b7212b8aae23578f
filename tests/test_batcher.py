"""The micro-batcher's schedule, on the real engine: requests that are already waiting never sit
out the window, they go at once, together; a lone request waits for company only while traffic
overlaps, so one client at a time pays the window at most once, right after overlapping traffic."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from service.engine.batcher import MicroBatcher
from service.engine.search_engine import SearchPlan
from service.errors import NotReady

FOREVER_S = 600.0  # a window no test could sit out: any wait on it ends in the timeout below
WINDOW_S = 1.0  # long enough that a request sent 0.2 s into it surely joins, on any machine


def held_until(gate: threading.Event, engine):
    """The engine's run, with the model kept busy until the test opens `gate`."""

    def run_batch(queries, plan, tokens):
        gate.wait(timeout=60)
        return engine.run(queries, plan, tokens)

    return run_batch


async def one_then_one_behind(batcher: MicroBatcher, gate: threading.Event, demo_queries) -> None:
    """A request the model takes alone, a second that queues while it runs, then the gate opens."""
    first = asyncio.create_task(batcher.search(demo_queries["q0001"], SearchPlan(3)))
    await asyncio.sleep(0.2)
    behind = asyncio.create_task(batcher.search(demo_queries["q0002"], SearchPlan(3)))
    await asyncio.sleep(0.2)
    gate.set()
    await asyncio.wait_for(asyncio.gather(first, behind), timeout=60)


async def lone_then_late(batcher: MicroBatcher, demo_queries) -> None:
    """A lone request, then another 0.2 s later: one batch if the first waited the window."""
    alone = asyncio.create_task(batcher.search(demo_queries["q0003"], SearchPlan(3)))
    await asyncio.sleep(0.2)
    late = asyncio.create_task(batcher.search(demo_queries["q0004"], SearchPlan(3)))
    await asyncio.wait_for(asyncio.gather(alone, late), timeout=60)


def test_waiting_requests_run_together_at_once_and_never_wait_for_the_window(engine, demo_queries):
    gate = threading.Event()
    sizes: list[int] = []
    names = ["q0001", "q0002", "q0003", "q0004", "q0005"]

    async def scenario():
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher = MicroBatcher(held_until(gate, engine), executor, FOREVER_S, max_batch=8, on_batch=sizes.append)
            # Two arrive together: neither is alone, so they go without waiting for company.
            first = [asyncio.create_task(batcher.search(demo_queries[q], engine.plan(3))) for q in names[:2]]
            await asyncio.sleep(0.2)
            # Three queue while the model is busy with those two; they go as one batch when it frees.
            behind = [asyncio.create_task(batcher.search(demo_queries[q], engine.plan(3))) for q in names[2:]]
            await asyncio.sleep(0.2)
            gate.set()
            results = await asyncio.wait_for(asyncio.gather(*first, *behind), timeout=60)
            await batcher.close()
        return results

    results = asyncio.run(scenario())
    assert sizes == [2, 3]
    for name, result in zip(names, results):
        assert [h.id for h in result.hits] == [h.id for h in engine.search(demo_queries[name], 3).hits]


def test_one_client_at_a_time_never_waits_for_the_window(engine, demo_queries):
    sizes: list[int] = []

    async def scenario():
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher = MicroBatcher(engine.run, executor, FOREVER_S, max_batch=8, on_batch=sizes.append)
            results = [await asyncio.wait_for(batcher.search(demo_queries[q], engine.plan(3)), timeout=60)
                       for q in ("q0001", "q0002", "q0003")]
            await batcher.close()
        return results

    results = asyncio.run(scenario())
    assert sizes == [1, 1, 1]
    assert all(result.timings.queue < 1000 for result in results)  # ms: nothing waited for company


def test_after_a_shared_batch_a_lone_request_waits_for_company(engine, demo_queries):
    sizes: list[int] = []

    async def scenario():
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher = MicroBatcher(engine.run, executor, WINDOW_S, max_batch=8, on_batch=sizes.append)
            together = [batcher.search(demo_queries[q], engine.plan(3)) for q in ("q0001", "q0002")]
            await asyncio.wait_for(asyncio.gather(*together), timeout=60)
            await lone_then_late(batcher, demo_queries)
            await batcher.close()

    asyncio.run(scenario())
    assert sizes == [2, 2]


def batch_sizes_after_one_queued_behind(engine, demo_queries, window_s: float, max_batch: int, then) -> list[int]:
    """The batch sizes when one request queues behind another (traffic overlaps), then `then(batcher)` runs."""
    gate = threading.Event()
    sizes: list[int] = []

    async def scenario():
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher = MicroBatcher(held_until(gate, engine), executor, window_s, max_batch, on_batch=sizes.append)
            await one_then_one_behind(batcher, gate, demo_queries)
            await then(batcher)
            await batcher.close()

    asyncio.run(scenario())
    return sizes


def test_after_a_request_queued_behind_a_batch_a_lone_request_waits_for_company(engine, demo_queries):
    sizes = batch_sizes_after_one_queued_behind(
        engine, demo_queries, WINDOW_S, 8, then=lambda batcher: lone_then_late(batcher, demo_queries)
    )
    assert sizes == [1, 1, 2]


def test_with_batches_of_one_nothing_ever_waits_for_company(engine, demo_queries):
    def alone(batcher):  # no one could join it
        return asyncio.wait_for(batcher.search(demo_queries["q0003"], engine.plan(3)), timeout=60)

    assert batch_sizes_after_one_queued_behind(engine, demo_queries, FOREVER_S, 1, then=alone) == [1, 1, 1]



def embeddings_queued_behind_one(engine, requests: list[list[str]], max_batch: int):
    """One embeddings request the model takes (held until a gate opens), then `requests` queued behind
    it: the texts of each forward pass, the batch sizes seen, and each queued request's answer."""
    gate = threading.Event()
    calls: list[list[str]] = []
    sizes: list[int] = []

    def embed_batch(texts, tokens):
        gate.wait(timeout=60)
        calls.append(list(texts))
        return engine.embed(texts, tokens)

    async def scenario():
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher = MicroBatcher(engine.run, executor, FOREVER_S, max_batch=max_batch, on_batch=sizes.append,
                                   embed_batch=embed_batch)

            def embed(texts):
                return batcher.embed(texts, [engine.tokenize(text, True, ("input",), "query") for text in texts])

            first = asyncio.create_task(embed(["warm"]))
            await asyncio.sleep(0.2)  # the model is busy with the first; the others queue behind it
            queued = [asyncio.create_task(embed(texts)) for texts in requests]
            await asyncio.sleep(0.2)
            gate.set()
            done = await asyncio.wait_for(asyncio.gather(first, *queued), timeout=60)
            await batcher.close()
        return done[1:]

    done = asyncio.run(scenario())
    return calls, sizes, done


def test_embeddings_requests_queued_together_share_one_forward_pass_and_keep_their_own_vectors(engine, encoder,
                                                                                               demo_queries):
    requests = [[demo_queries["q0001"]], [demo_queries["q0002"], demo_queries["q0003"]], [demo_queries["q0004"]]]
    calls, sizes, done = embeddings_queued_behind_one(engine, requests, max_batch=8)
    assert [len(call) for call in calls] == [1, 4] and sizes == [1, 4]  # three requests, four texts, one pass
    for texts, answer in zip(requests, done):
        assert answer.batch_size == 4 and answer.arrived <= answer.started <= answer.finished
        assert answer.vectors.shape == (len(texts), encoder.dimension)
        assert abs(answer.vectors - encoder.encode_queries(texts)).max() < 1e-5



def test_requests_fuse_only_with_requests_of_the_same_k(engine, demo_queries):
    # Fused at a neighbour's larger k, an answer could change with whoever it was fused with: FAISS and
    # BM25 choose among passages tied at the k-th place by k.
    gate = threading.Event()
    sizes: list[int] = []

    async def scenario():
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher = MicroBatcher(held_until(gate, engine), executor, FOREVER_S, max_batch=8, on_batch=sizes.append)
            first = asyncio.create_task(batcher.search(demo_queries["q0001"], engine.plan(3)))
            await asyncio.sleep(0.2)
            behind = [asyncio.create_task(batcher.search(demo_queries[q], engine.plan(k)))
                      for q, k in (("q0002", 3), ("q0003", 10), ("q0004", 3))]
            await asyncio.sleep(0.2)
            gate.set()
            results = await asyncio.wait_for(asyncio.gather(first, *behind), timeout=60)
            await batcher.close()
        return results

    results = asyncio.run(scenario())
    assert sorted(sizes) == [1, 1, 2]  # the first alone; then k=3's two together, k=10's apart
    assert [len(result.hits) for result in results] == [3, 3, 10, 3]


def test_closing_answers_the_running_and_the_queued_requests_with_503_rather_than_never(engine, demo_queries):
    gate = threading.Event()

    async def scenario():
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher = MicroBatcher(held_until(gate, engine), executor, FOREVER_S, max_batch=8)
            running = asyncio.create_task(batcher.search(demo_queries["q0001"], engine.plan(3)))
            await asyncio.sleep(0.2)
            queued = asyncio.create_task(batcher.search(demo_queries["q0002"], engine.plan(3)))
            await asyncio.sleep(0.2)
            await batcher.close()
            answers = await asyncio.wait_for(asyncio.gather(running, queued, return_exceptions=True), timeout=5)
            gate.set()  # lets the model thread's batch end, so the executor can shut down
        return answers

    answers = asyncio.run(scenario())
    assert all(isinstance(answer, NotReady) for answer in answers), answers
    assert [str(answer) for answer in answers] == ["the service is shutting down"] * 2
