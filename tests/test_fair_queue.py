"""The model thread's queue is fair between keys (service/engine/fair_queue.py): work waiting for the thread is
taken round-robin over the keys that sent it, so a key with many batches queued delays another's search by one
batch, not by all of them."""

from __future__ import annotations

import contextvars
import threading
from concurrent.futures import CancelledError, ThreadPoolExecutor

import httpx
import pytest

from service.engine.fair_queue import FairExecutor, current_key
from tests.test_admission import FAIR_KEYS, serving, wait_until
from tests.test_keys import keys_file


def submitted_as(executor: FairExecutor, key: str, function, *args):
    return contextvars.Context().run(lambda: (current_key.set(key), executor.submit(function, *args))[1])


def test_waiting_work_is_taken_round_robin_over_keys_and_in_order_within_one():
    executor, ran, gate = FairExecutor(ThreadPoolExecutor(1)), [], threading.Event()
    try:
        executor.submit(gate.wait)
        done = [submitted_as(executor, key, ran.append, f"{key}{n}")
                for key, n in [("A", 1), ("A", 2), ("A", 3), ("B", 1), ("A", 4), ("C", 1), ("B", 2)]]
        assert executor.waiting == 7 and ran == []
        gate.set()
        for future in done:
            future.result(10)
        assert ran == ["A1", "B1", "C1", "A2", "B2", "A3", "A4"]
    finally:
        executor.shutdown()


def test_work_cancelled_while_waiting_never_runs_and_errors_reach_their_caller():
    executor, ran, gate = FairExecutor(ThreadPoolExecutor(1)), [], threading.Event()
    try:
        executor.submit(gate.wait)
        cancelled = submitted_as(executor, "A", ran.append, "cancelled")
        failing = submitted_as(executor, "B", lambda: 1 / 0)
        kept = submitted_as(executor, "A", ran.append, "kept")
        assert cancelled.cancel()
        gate.set()
        with pytest.raises(ZeroDivisionError):
            failing.result(10)
        kept.result(10)
        assert ran == ["kept"] and executor.waiting == 0
        with pytest.raises(CancelledError):
            cancelled.result()
    finally:
        executor.shutdown()


def test_a_key_with_batches_queued_delays_another_keys_search_by_one_batch(small_index, engine, demo_queries,
                                                                           tmp_path):
    keys = keys_file(tmp_path / "keys.json", FAIR_KEYS)
    queries = list(demo_queries.values())[:16]
    with serving(small_index, engine, api_keys_file=keys) as (app, base, port):
        runtime, finished, gate = app.state.runtime, [], threading.Event()

        def send(name: str, key: str, batch: list[str]) -> int:
            answer = httpx.post(f"{base}/search/batch", json={"queries": batch, "k": 10},
                                headers={"Authorization": f"Bearer {key}"}, timeout=60, trust_env=False)
            finished.append(name)
            return answer.status_code

        with ThreadPoolExecutor(4) as pool:
            runtime.executor.submit(gate.wait)  # the model thread busy while A queues three batches
            a = [pool.submit(send, f"A{n}", "a-secret", queries) for n in (1, 2, 3)]
            wait_until(lambda: runtime.executor.waiting == 3)
            b = pool.submit(send, "B", "b-secret", queries[:1])
            wait_until(lambda: runtime.executor.waiting == 4)
            gate.set()
            assert [future.result(60) for future in [*a, b]] == [200] * 4
        assert finished.index("B") < 3, finished  # first come first served would have answered it last
