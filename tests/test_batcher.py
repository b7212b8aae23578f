"""The micro-batcher's schedule, on the real engine: requests that are already waiting never sit
out the window, they go at once, together; a lone request waits for company only while traffic
overlaps, so one client at a time never pays the window."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from service.batcher import MicroBatcher

FOREVER_S = 600.0  # a window no test could sit out: any wait on it ends in the timeout below


def test_waiting_requests_run_together_at_once_and_never_wait_for_the_window(engine, demo_queries):
    gate = threading.Event()
    sizes: list[int] = []
    names = ["q0001", "q0002", "q0003", "q0004", "q0005"]

    def run_batch(queries, k, **retrieval):
        gate.wait(timeout=60)  # the model stays busy until the test opens the gate
        return engine.search_batch(queries, k, **retrieval)

    async def scenario():
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher = MicroBatcher(run_batch, executor, FOREVER_S, max_batch=8, on_batch=sizes.append)
            # Two arrive together: neither is alone, so they go without waiting for company.
            first = [asyncio.create_task(batcher.search(demo_queries[q], 3)) for q in names[:2]]
            await asyncio.sleep(0.2)
            # Three queue while the model is busy with those two; they go as one batch when it frees.
            behind = [asyncio.create_task(batcher.search(demo_queries[q], 3)) for q in names[2:]]
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
            batcher = MicroBatcher(engine.search_batch, executor, FOREVER_S, max_batch=8, on_batch=sizes.append)
            results = [await asyncio.wait_for(batcher.search(demo_queries[q], 3), timeout=60)
                       for q in ("q0001", "q0002", "q0003")]
            await batcher.close()
        return results

    results = asyncio.run(scenario())
    assert sizes == [1, 1, 1]
    assert all(result.timings.queue < 1000 * FOREVER_S / 10 for result in results)


def test_a_lone_request_waits_for_company_while_traffic_overlaps(engine, demo_queries):
    sizes: list[int] = []

    async def scenario():
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher = MicroBatcher(engine.search_batch, executor, 2.0, max_batch=8, on_batch=sizes.append)
            together = [batcher.search(demo_queries[q], 3) for q in ("q0001", "q0002")]
            await asyncio.wait_for(asyncio.gather(*together), timeout=60)  # overlapping traffic
            alone = asyncio.create_task(batcher.search(demo_queries["q0003"], 3))
            await asyncio.sleep(0.3)  # well inside the 2 s window
            late = asyncio.create_task(batcher.search(demo_queries["q0004"], 3))
            await asyncio.wait_for(asyncio.gather(alone, late), timeout=60)
            await batcher.close()

    asyncio.run(scenario())
    assert sizes == [2, 2]
