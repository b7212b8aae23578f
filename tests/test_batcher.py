"""The micro-batcher's schedule, on the real engine: requests that are already waiting never sit
out the window; they go at once, together."""

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
