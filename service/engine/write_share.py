"""The model thread's time that writes take while searches wait for it: a bounded share, so a stream of upserts
slows searches by a known factor instead of by whatever the writes send (issue 77). Idle, writes take the thread
whenever they want it; a write is slowed by searches, never starved by them."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

POLL_S = 0.002  # how often a paced write looks again whether searches are still waiting


class WriteShare:
    """Paces the writes' turns on the model thread: after a turn that held the thread t seconds, the next write's
    turn waits, while `busy()` (searches queued or running), until t (1 - share) / share seconds have passed: so
    writes hold at most `share` of the thread's time while searches want it. One write's turn at a time."""

    def __init__(self, share: float, busy: Callable[[], bool]) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"a write share is in (0, 1], not {share}")
        self.share = share
        self._busy = busy
        self._lock = asyncio.Lock()
        self._not_before = 0.0  # monotonic: when the next write's turn may go ahead of waiting searches

    async def run(self, submit: Callable, function: Callable, *args):
        """`function(*args)` submitted with `submit` (to the model thread, as Runtime._on_model_thread) once it is
        the writes' turn; its time there, measured there, sets when the next turn may take the thread."""
        async with self._lock:
            while self._busy() and time.monotonic() < self._not_before:
                await asyncio.sleep(POLL_S)
            held: list[float] = []

            def timed():
                started = time.monotonic()
                try:
                    return function(*args)
                finally:
                    held.append(time.monotonic() - started)

            try:
                return await submit(timed)
            finally:
                if held:
                    self._not_before = time.monotonic() + held[0] * (1 - self.share) / self.share
