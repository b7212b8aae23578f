"""The model thread's queue, fair between API keys: the work waiting for the one thread that runs the model is
taken round-robin over the keys that sent it, not first come first served, so a key that queued hundreds of
batches delays another key's search by one of its batches, not by all of them (issue 75).

A piece of work belongs to the key in `current_key` where it was submitted (the admission sets it for each
request: service/http/admission.py); work submitted outside any request (the micro-batcher's batches, which mix
every key's searches; a shard's wait finished) shares the lane of key "". With one key, or none configured,
the order is first come first served, as a plain executor's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from concurrent.futures import CancelledError, Executor, Future, ThreadPoolExecutor
from contextvars import ContextVar

# The name of the key whose request the running code serves; "" outside any.
current_key: ContextVar[str] = ContextVar("search_key", default="")


class FairExecutor(Executor):
    """`executor` (one worker thread) fed one piece of work at a time, the next taken from the key after the last
    one served among those with work waiting. Thread-safe; `submit` returns a concurrent Future, as any Executor's
    (cancelled while it waits: never run)."""

    def __init__(self, executor: ThreadPoolExecutor) -> None:
        self._executor = executor
        self._waiting: OrderedDict[str, deque] = OrderedDict()  # key -> its work, keys in round-robin order
        self._lock = threading.Lock()
        self._busy = False  # a piece of work is on the thread

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        with self._lock:
            self._waiting.setdefault(current_key.get(), deque()).append((future, fn, args, kwargs))
            if self._busy:
                return future
            self._busy = True
        self._next()
        return future

    @property
    def waiting(self) -> int:
        """Pieces of work waiting for the thread."""
        with self._lock:
            return sum(len(work) for work in self._waiting.values())

    def _next(self) -> None:
        """Puts the next piece of work that was not cancelled on the thread, or marks the thread idle."""
        while True:
            with self._lock:
                if not self._waiting:
                    self._busy = False
                    return
                key, work = self._waiting.popitem(last=False)
                future, fn, args, kwargs = work.popleft()
                if work:
                    self._waiting[key] = work  # back at the end of the round
            if future.set_running_or_notify_cancel():
                break
        try:
            running = self._executor.submit(fn, *args, **kwargs)
        except BaseException as error:  # the pool shut down
            future.set_exception(error)
            self._next()
            return
        running.add_done_callback(lambda done: self._finished(future, done))

    def _finished(self, future: Future, done: Future) -> None:
        if done.cancelled():  # the pool shut down before running it
            future.set_exception(CancelledError())
        elif done.exception() is not None:
            future.set_exception(done.exception())
        else:
            future.set_result(done.result())
        self._next()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if cancel_futures:
            with self._lock:
                waiting, self._waiting = self._waiting, OrderedDict()
            for work in waiting.values():
                for future, *_ in work:
                    future.cancel()
        self._executor.shutdown(wait=wait, cancel_futures=cancel_futures)
