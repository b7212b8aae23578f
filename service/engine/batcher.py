"""Dynamic micro-batching: /search requests that arrive within a short window share one encoder
forward pass and one FAISS search, and /v1/embeddings requests one forward pass, so small requests
fill the model's batch (text-embeddings-inference's queue, in miniature)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from models.encoder import Tokens
from service.engine.search_engine import Run, SearchPlan, SearchResult
from service.errors import NotReady, ShardsUnavailable

# One result per query, e.g. SearchEngine.run; the tokens are None unless every query came with its own.
# Or a Run (SearchEngine.start) whose retrieval other processes do: waited for off the model thread.
RunBatch = Callable[[list[str], SearchPlan, list[Tokens] | None], list[SearchResult] | Run]
# One vector per text, e.g. SearchEngine.embed: the texts and their tokens, all of one input type.
EmbedBatch = Callable[[list[str], list[Tokens]], np.ndarray]


async def completed(run: Run, executor: Executor, wait_executor: Executor | None) -> list[SearchResult]:
    """A sent run's retrieval waited for on `wait_executor` (off the model thread, `executor`), then
    reranked on the model thread where its plan asks."""
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(wait_executor, run.wait)
    return await loop.run_in_executor(executor, run.finish) if run.reranks else run.finish()


@dataclass(frozen=True)
class SearchJob:
    query: str
    plan: SearchPlan
    tokens: Tokens | None  # tokenized where it was checked; its ids are its share of the token budget

    @property
    def key(self) -> tuple:
        return ("search", self.plan.fusing_key)

    @property
    def cost(self) -> int:
        return len(self.tokens.ids) if self.tokens is not None else 1


@dataclass(frozen=True)
class EmbedJob:
    texts: tuple[str, ...]
    tokens: tuple[Tokens, ...]  # one input type

    @property
    def key(self) -> tuple:
        return ("embed", self.tokens[0].input_type)

    @property
    def cost(self) -> int:
        return sum(len(text.ids) for text in self.tokens)


@dataclass(frozen=True)
class Embedded:
    """One embeddings request's vectors, and when it queued and ran (time.perf_counter())."""

    vectors: np.ndarray
    arrived: float
    started: float
    finished: float
    batch_size: int  # texts in the forward pass it shared


@dataclass
class _Pending:
    job: SearchJob | EmbedJob  # fuses only with jobs of the same key
    future: asyncio.Future  # cancelled when its client has gone: dropped before it reaches the model
    arrived: float
    behind: bool  # arrived while the model was running a batch

    @property
    def cost(self) -> int:
        return self.job.cost


class MicroBatcher:
    """Runs waiting requests as one batch (at most `max_batch`) on `executor` and hands each caller
    its own top-k. Requests that queued while the model was busy go at once, since waiting then
    would only idle the model. A request that finds no other waiting waits `window_s` for company
    only while traffic overlaps (the last batch was shared, or its request had queued): one client
    at a time pays it at most once, right after overlapping traffic, and a burst's first request
    goes while the rest queue.

    A batch holds at most `max_batch` requests and `max_tokens` query tokens (one request over the
    budget runs alone); the request that would overflow it heads the next batch. A request whose
    caller cancelled it (its client disconnected) is dropped from the queue unrun, and counted by
    `on_drop`. Searches run by `run_batch`, embeddings (requests of several texts each) by
    `embed_batch`, all the texts of the waiting requests in one call, which the encoder sorts by
    length into its own batches: the texts of many requests pad far less than each request's alone
    (Infinity's queue does the same); a batch of both kinds runs each kind apart.

    Where `run_batch` gives a Run (sharded serving), the model thread is free once the queries are
    encoded and sent: the batch's wait for the shards runs on `wait_executor` while the next batch
    encodes, so a slow or silent shard delays the requests that wait for it, not the queue behind them."""

    def __init__(
        self, run_batch: RunBatch, executor: Executor, window_s: float, max_batch: int,
        on_batch: Callable[[int], None] = lambda size: None, max_tokens: int | None = None,
        on_drop: Callable[[], None] = lambda: None, embed_batch: EmbedBatch | None = None,
        wait_executor: Executor | None = None,
    ) -> None:
        self._run_batch, self._embed_batch, self._executor = run_batch, embed_batch, executor
        self._wait_executor = wait_executor  # None: asyncio's default thread pool
        self._finishing: set[asyncio.Task] = set()  # batches waiting for their shards
        self._window_s, self._max_batch, self._on_batch = window_s, max_batch, on_batch
        self._max_tokens, self._on_drop = max_tokens, on_drop
        self._queue: asyncio.Queue[_Pending] | None = None
        self._held: _Pending | None = None  # took from the queue, but over the last batch's budget
        self._worker: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = 0  # batches on the model now (a retry alone may run beside the worker's)
        self._unanswered: set[asyncio.Future] = set()  # queued or running: close answers them 503
        self._overlapping = False  # did the last batch show concurrent traffic?

    @property
    def waiting(self) -> int:
        """Requests queued for the model (not yet in a running batch)."""
        return (self._queue.qsize() if self._queue is not None else 0) + (self._held is not None)

    @property
    def busy(self) -> bool:
        """Whether searches are queued for the model or running on it."""
        return bool(self.waiting or self._running)

    async def search(self, query: str, plan: SearchPlan, *, tokens: Tokens | None = None) -> SearchResult:
        """`query` run by `plan` (checked by SearchEngine.plan), in a batch with others of the same plan
        but for k; `tokens`: the query tokenized, so the model thread does not tokenize it again."""
        return await self._submit(SearchJob(query, plan, tokens))

    async def embed(self, texts: Sequence[str], tokens: Sequence[Tokens]) -> Embedded:
        """The vectors of `texts` (`tokens`: them tokenized, one input type), in one forward pass with
        the texts of other embeddings requests of that input type."""
        return await self._submit(EmbedJob(tuple(texts), tuple(tokens)))

    async def _submit(self, job: SearchJob | EmbedJob):
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first use, or a new event loop (test clients start one per session)
            self._loop, self._queue, self._held, self._unanswered = loop, asyncio.Queue(), None, set()
            self._running, self._overlapping = 0, False
            # In no request's context: its batches mix every key's requests (service/engine/fair_queue.py).
            self._worker = loop.create_task(self._serve(), context=contextvars.Context())
        future = loop.create_future()
        self._unanswered.add(future)
        future.add_done_callback(self._unanswered.discard)
        await self._queue.put(_Pending(job, future, time.perf_counter(), self._running > 0))
        return await future

    async def close(self) -> None:
        """Stops the worker and the shard waits; a request still queued or running (uvicorn lets
        in-flight requests end first, but a host may close the app under them) is answered 503
        rather than left waiting on a future nobody will set."""
        tasks = [*self._finishing, *([self._worker] if self._worker is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._worker = None
        for future in list(self._unanswered) if self._loop is asyncio.get_running_loop() else ():
            if not future.done():
                future.set_exception(NotReady("the service is shutting down"))

    async def _next(self) -> _Pending:
        """The next request whose caller still waits for it."""
        while True:
            item, self._held = self._held or await self._queue.get(), None
            if not item.future.cancelled():
                return item
            self._on_drop()

    async def _collect(self) -> list[_Pending]:
        """The first waiting request, plus the others waiting (up to max_batch and max_tokens); when it
        is alone while traffic overlaps, plus whatever arrives within the window. Sleeping then draining,
        rather than a timed get, can never drop a request on a timeout race."""
        batch = [await self._next()]
        tokens = batch[0].cost
        if self._window_s > 0 and self._max_batch > 1 and self._overlapping and self._queue.empty():
            await asyncio.sleep(self._window_s)
        while len(batch) < self._max_batch and not self._queue.empty():
            item = self._queue.get_nowait()
            if item.future.cancelled():
                self._on_drop()
                continue
            if self._max_tokens is not None and tokens + item.cost > self._max_tokens:
                self._held = item
                break
            batch.append(item)
            tokens += item.cost
        self._overlapping = len(batch) > 1 or batch[0].behind
        return batch

    async def _serve(self) -> None:
        while True:
            batch = await self._collect()
            groups: dict[tuple, list[_Pending]] = {}
            for item in batch:  # requests fuse only with their like
                groups.setdefault(item.job.key, []).append(item)
            for group in groups.values():
                await self._run(group)

    async def _run(self, batch: list[_Pending]) -> None:
        started = time.perf_counter()
        call = self._search_call(batch) if isinstance(batch[0].job, SearchJob) else self._embed_call(batch)
        loop = asyncio.get_running_loop()
        self._running += 1
        try:
            results = await loop.run_in_executor(self._executor, call)
        except Exception as error:  # noqa: BLE001
            results = error
        finally:
            self._running -= 1
        if isinstance(results, Exception):
            await self._failed(batch, results)
            return
        if isinstance(results, Run):  # the shards search it: waited for beside the next batches
            task = loop.create_task(self._complete(batch, results, started))
            self._finishing.add(task)
            task.add_done_callback(self._finishing.discard)
            return
        self._done(batch, results, started)

    async def _complete(self, batch: list[_Pending], run: Run, started: float) -> None:
        """A sent batch's retrieval waited for (off the model thread), then reranked on it where asked."""
        try:
            self._done(batch, await completed(run, self._executor, self._wait_executor), started)
        except Exception as error:  # noqa: BLE001
            await self._failed(batch, error)

    async def _failed(self, batch: list[_Pending], error: Exception) -> None:
        # One request must not fail its neighbours: run each alone, so only it fails. A shard that
        # did not answer fails them all alike, and each alone would wait for it again.
        if len(batch) > 1 and not isinstance(error, ShardsUnavailable):
            for item in batch:
                if not item.future.done():
                    await self._run([item])
            return
        for item in batch:
            if not item.future.done():
                item.future.set_exception(error)

    def _done(self, batch: list[_Pending], results: list, started: float) -> None:
        embeds = isinstance(batch[0].job, EmbedJob)
        self._on_batch(sum(len(item.job.texts) for item in batch) if embeds else len(batch))  # texts in the call
        finished = time.perf_counter()
        for item, result in zip(batch, results):
            if not item.future.done():
                item.future.set_result(self._finish(item, result, started, finished))

    def _search_call(self, batch: list[_Pending]) -> Callable[[], list[SearchResult]]:
        plan = batch[0].job.plan  # the batch's plans are equal (SearchPlan.fusing_key)
        tokens = [item.job.tokens for item in batch]
        return functools.partial(self._run_batch, [item.job.query for item in batch], plan,
                                 None if None in tokens else tokens)

    def _embed_call(self, batch: list[_Pending]) -> Callable[[], list[tuple[np.ndarray, int]]]:
        """All the batch's texts in one call (the encoder sorts them by length into its own batches),
        split back into one array per request, with the number of texts that ran together."""
        texts = [text for item in batch for text in item.job.texts]
        tokens = [text for item in batch for text in item.job.tokens]

        def call() -> list[tuple[np.ndarray, int]]:
            vectors = self._embed_batch(texts, tokens)
            ends = np.cumsum([len(item.job.texts) for item in batch])
            return [(part, len(texts)) for part in np.split(vectors, ends[:-1])]

        return call

    @staticmethod
    def _finish(item: _Pending, result, started: float, finished: float):
        if isinstance(item.job, EmbedJob):
            vectors, size = result
            return Embedded(vectors, item.arrived, started, finished, size)
        # Queued until its run began on the model thread (which other batches' reranks may hold too).
        queued = max(started, result.timings.started_at) - item.arrived
        timings = replace(result.timings, queue=1000 * queued, total=1000 * (finished - item.arrived))
        return replace(result, hits=result.hits[: item.job.plan.k], timings=timings)
