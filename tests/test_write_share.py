"""Writes take a bounded share of the model thread while searches wait for it (service/engine/write_share.py):
after a write's turn, searches that are waiting go first until the share allows the next turn; with no search
waiting, a write's turns follow each other at once; a write is paced, never starved."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from service.engine.write_share import WriteShare

HELD_S = 0.02  # each write turn holds the thread this long


def on_thread(executor: ThreadPoolExecutor):
    async def submit(function):
        return await asyncio.get_running_loop().run_in_executor(executor, function)
    return submit


def held(ran: list[str], name: str):
    def turn():
        ran.append(name)
        time.sleep(HELD_S)
        return name
    return turn


def test_a_search_waiting_after_a_write_turn_goes_before_the_next_turn():
    async def scenario():
        executor, ran, searches = ThreadPoolExecutor(1), [], []
        share = WriteShare(0.01, lambda: True)  # searches always waiting: the next turn after 99 times the last's
        submit = on_thread(executor)
        first_done = asyncio.Event()

        async def write():
            await share.run(submit, held(ran, "w1"))
            first_done.set()
            return await share.run(submit, held(ran, "w2"))

        writing = asyncio.create_task(write())
        await first_done.wait()
        searches.append(await submit(lambda: ran.append("s")))
        assert await asyncio.wait_for(writing, 60) == "w2"  # paced, then run: never starved
        executor.shutdown()
        return ran

    assert asyncio.run(scenario()) == ["w1", "s", "w2"]


def test_turns_follow_at_once_when_no_search_waits():
    async def scenario():
        executor, ran = ThreadPoolExecutor(1), []
        waiting = threading.Event()
        waiting.set()
        # A share that would hold the next turn back 20 s (999 times the last turn's 20 ms) while searches wait.
        share = WriteShare(0.001, waiting.is_set)
        submit = on_thread(executor)
        await share.run(submit, held(ran, "w1"))
        await submit(lambda: (ran.append("s"), waiting.clear()))  # the waiting search runs: none waits now
        await asyncio.wait_for(share.run(submit, held(ran, "w2")), 10)
        executor.shutdown()
        return ran

    assert asyncio.run(scenario()) == ["w1", "s", "w2"]


def test_writes_hold_at_most_their_share_of_the_thread_while_searches_wait():
    async def scenario():
        executor, ran = ThreadPoolExecutor(1), []
        share = WriteShare(0.25, lambda: True)
        submit = on_thread(executor)
        started = time.monotonic()
        for number in range(5):
            await share.run(submit, held(ran, f"w{number}"))
        executor.shutdown()
        return time.monotonic() - started

    # Five turns of 20 ms at a quarter of the thread: four pauses of at least 3 x 20 ms between them.
    assert asyncio.run(scenario()) >= 5 * HELD_S + 4 * 3 * HELD_S


@pytest.mark.parametrize("share", [0, -0.5, 1.5])
def test_a_share_outside_zero_to_one_is_refused(share):
    with pytest.raises(ValueError, match="write share"):
        WriteShare(share, lambda: False)
