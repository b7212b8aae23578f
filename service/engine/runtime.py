"""The engine as served: loaded in the background, run on one model thread, fed by the micro-batcher
and its queue, reloaded in place. Routes call this and nothing below it."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import gc
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from models.encoder import Tokens
from retrieval.compaction import FolderReplaced, compact
from retrieval.index_format import Manifest
from retrieval.searcher import Searcher
from retrieval.segment import Passage
from retrieval.write_log import LogUnwritable
from retrieval.writes import Writes
from service.engine.batcher import MicroBatcher, completed
from service.engine.fair_queue import FairExecutor
from service.engine.index_watch import IndexWatch
from service.engine.monitoring import Monitor, ServingState
from service.engine.search_engine import ReloadError, Run, SearchEngine, SearchPlan, SearchResult
from service.engine.tracing import Stage, Tracing
from service.engine.write_share import WriteShare
from service.errors import NotReady, NotServable, WritesUnavailable
from service.settings import ServiceSettings

log = logging.getLogger("service")
# A /rerank's share of the model thread before waiting batches get theirs: 16 full monoBERT pairs.
RERANK_SLICE_TOKENS = 8192
# A write's turn on the model thread before waiting searches get theirs: one passage at the usual 256-token
# limit (16 passages in one turn held searches 6.5x longer at p99: bench/writes.py); how often writes take a turn
# while searches wait is SEARCH_WRITE_SHARE's (service/engine/write_share.py).
WRITE_SLICE_TOKENS = 256
# A failed compaction is tried again after 30 s, then twice as long each time, up to an hour.
COMPACT_BACKOFF_MIN_S, COMPACT_BACKOFF_MAX_S = 30.0, 3600.0
# A write the log refused for a passing reason (not a full disk, nothing lasting): the Retry-After it is answered with.
WRITE_RETRY_AFTER_S = 5
STORAGE_FULL = (errno.ENOSPC, errno.EDQUOT)
STATS_WINDOW = 1000  # requests /stats takes its percentiles over; /metrics' histograms count every one


def _lower_priority(increment: int) -> None:
    """Adds `increment` to the calling thread's nice value, up to 19 (Linux keeps one per thread, and
    threads it starts inherit it: torch's OpenMP workers, started by the first forward pass on the model
    thread). Never raises: a pool whose initializer fails never runs anything, the index load included."""
    if not increment or sys.platform != "linux":
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + increment))
    except OSError as error:
        log.warning("thread %s keeps the process's priority: %s", threading.current_thread().name, error)


class Runtime:
    """What every request shares: the engine (once loaded), the one thread that runs the model, the
    queue in front of it, the metrics, and the traces (`tracing`: none by default)."""

    def __init__(self, settings: ServiceSettings, engine: SearchEngine | None, tracing: Tracing | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.tracing = tracing or Tracing()
        self.load_error: str | None = None
        self.reload_error: str | None = None  # why the last reload failed, until one succeeds (in /ready)
        self.reload_failed: Path | None = None  # the folder that reload was of
        # One model thread: torch already spreads a forward pass over the cores, and the
        # encoder is not re-entrant; concurrency comes from batching, not from threads. Its queue is
        # fair between keys (service/engine/fair_queue.py).
        self.executor = FairExecutor(ThreadPoolExecutor(max_workers=1, thread_name_prefix="model",
                                                        initializer=_lower_priority,
                                                        initargs=(settings.model_thread_nice,)))
        # Where a reload reads the new index beside the serving one: niced as the model thread is, so the
        # load, and the thread pool ONNX Runtime starts with a new encoder's session, yield to serving.
        self.loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reload",
                                         initializer=_lower_priority, initargs=(settings.model_thread_nice,))
        # Where a filter is parsed and evaluated before its search queues for the model: one thread, so a flood
        # of costly filters waits behind itself, not in front of plain searches or the event loop.
        self.filter_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="filter",
                                                initializer=_lower_priority, initargs=(settings.model_thread_nice,))
        # Where a sharded search waits for its shards' answers, so the model thread encodes on meanwhile
        # (threads start only when used: a service over one index never starts one).
        self.waiter = ThreadPoolExecutor(max_workers=min(32, settings.max_concurrent_requests),
                                         thread_name_prefix="shard-wait")
        self.monitor = Monitor(STATS_WINDOW)
        self.batcher = MicroBatcher(
            self._run, self.executor, settings.microbatch_window_ms / 1000, settings.microbatch_max,
            on_batch=self.monitor.observe_batch, max_tokens=settings.max_batch_tokens,
            on_drop=self.monitor.dropped.inc, embed_batch=self._embed, wait_executor=self.waiter,
        )
        self.monitor.queued.set_function(lambda: self.batcher.waiting)
        self.monitor.watch_state(self.serving_state)
        self.reload_lock = asyncio.Lock()
        self.watch = IndexWatch(settings.watch_interval_s, self.served_index, self.reload, self.served_again) \
            if settings.watch_index else None
        self.writes: Writes | None = None  # with SEARCH_WRITES, once the engine is loaded
        self.write_share = WriteShare(settings.write_share, lambda: self.batcher.busy)
        self.compacting: Future | None = None  # the last compaction started, on the loader thread
        self.compact_backoff_s, self.compact_not_before = COMPACT_BACKOFF_MIN_S / 2, 0.0  # after failed ones
        self.write_failure: str | None = None  # why the last write was not logged, until one is (in /ready)
        self.compact_failure: str | None = None  # why the last compaction failed, until one succeeds (in /ready)
        self.compactor: asyncio.Task | None = None  # starts one when the oldest write is SEARCH_COMPACT_AGE_S old
        if engine is not None:
            # On the model thread: torch's OpenMP workers spin after each call, and two threads that
            # both run torch fight over the cores, each slower than one alone.
            self.executor.submit(engine.warm_up).result()
            self._open_writes(engine)
            self._settle()

    def _run(self, queries: list[str], plan: SearchPlan, tokens: list[Tokens] | None) -> list[SearchResult] | Run:
        """On the model thread: the run to its end, or, where shards retrieve, sent (to wait for elsewhere)."""
        run = self.engine.start(queries, plan, tokens)
        return run if run.waits else run.complete()

    async def _run_apart(self, queries: list[str], plan: SearchPlan, tokens: list[Tokens]) -> list[SearchResult]:
        """A run of its own (a client's batch, or any search with SEARCH_MICROBATCH off), its shards
        waited for off the model thread as the micro-batcher does."""
        self.ready_engine()
        run = await self._on_model_thread(self._run, queries, plan, tokens)
        return await completed(run, self.executor, self.waiter) if isinstance(run, Run) else run

    def _embed(self, texts: list[str], tokens: list[Tokens]) -> np.ndarray:
        return self.engine.embed(texts, tokens)

    def ready_engine(self) -> SearchEngine:
        if self.engine is None:
            raise NotReady(self.load_error or "the index is still loading")
        return self.engine

    def start(self) -> None:
        """Loads the configured index in the background, unless an engine was given: /health answers
        meanwhile, and /ready says loading. With SEARCH_WATCH_INDEX, starts following the index folder."""
        if self.engine is None:
            asyncio.get_running_loop().run_in_executor(self.executor, self._load)
        if self.watch is not None:
            self.watch.start()
        if self.settings.writes:
            self.compactor = asyncio.get_running_loop().create_task(self._compact_on_age())

    async def close(self) -> None:
        if self.watch is not None:
            await self.watch.stop()
        if self.compactor is not None:
            self.compactor.cancel()
        if self.compacting is not None:
            await asyncio.wrap_future(self.compacting)  # the new generation swapped in, or not at all
        await self.batcher.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.loader.shutdown(wait=False, cancel_futures=True)
        self.filter_thread.shutdown(wait=False, cancel_futures=True)
        self.waiter.shutdown(wait=False, cancel_futures=True)
        if self.writes is not None:
            self.writes.close()
        await asyncio.to_thread(self.tracing.shutdown)  # exports the last spans: network I/O

    def _load(self) -> None:
        settings = self.settings
        try:
            engine = SearchEngine.served(settings)
            engine.warm_up()
            self._open_writes(engine)
            self._settle()  # before the engine is served, so no request waits for its collection
            self.engine = engine
            log.info("ready: %s", engine.describe())
        except Exception as error:  # noqa: BLE001 - reported by /ready; /health stays up
            self.load_error = f"loading {settings.index_dir} failed: {str(error) or type(error).__name__}"
            log.error(self.load_error)

    async def plan(self, make_plan: Callable[[], SearchPlan], filtered: bool) -> SearchPlan:
        """`make_plan()`'s plan; where the request has a filter, made on the filter thread with the filter
        evaluated there too (SearchEngine.evaluate_filter), off the event loop and the model thread."""
        if not filtered:
            return make_plan()

        def planned() -> SearchPlan:
            plan = make_plan()
            self.ready_engine().evaluate_filter(plan)
            return plan

        return await asyncio.get_running_loop().run_in_executor(self.filter_thread, planned)

    async def search(self, query: str, plan: SearchPlan, tokens: Tokens) -> SearchResult:
        """One query, micro-batched with others unless SEARCH_MICROBATCH is off; cancelling the call
        drops the query from the queue if it has not reached the model yet."""
        submitted = time.perf_counter()
        if self.settings.microbatch:
            result = await self.batcher.search(query, plan, tokens=tokens)
        else:
            result = _waited((await self._run_apart([query], plan, [tokens]))[0], submitted)
            self.monitor.observe_batch(1)
        self.monitor.observe_search(result.timings, plan.reranker)
        self.tracing.search(submitted, result, plan)
        return result

    async def search_batch(self, queries: Sequence[str], plan: SearchPlan,
                           tokens: Sequence[Tokens]) -> list[SearchResult]:
        """A client's batch: one run of its own, never fused with others."""
        submitted = time.perf_counter()
        results = [_waited(result, submitted) for result in await self._run_apart(list(queries), plan, list(tokens))]
        self.monitor.observe_batch(len(results))
        for result in results:
            self.monitor.observe_search(result.timings, plan.reranker)
        self.tracing.search(submitted, results[0], plan)
        return results

    async def embed(self, texts: Sequence[str], tokens: Sequence[Tokens]) -> np.ndarray:
        """The vectors of `texts`, in one forward pass with the texts of concurrent embeddings requests
        (unless SEARCH_MICROBATCH is off)."""
        engine = self.ready_engine()
        if not self.settings.microbatch:
            self.monitor.observe_batch(len(texts))
            return await self._traced("encode", {"search.batch_size": len(texts)}, engine.embed, list(texts), list(tokens))
        done = await self.batcher.embed(texts, tokens)
        self.tracing.stages([("queue", done.arrived, done.started), ("encode", done.started, done.finished)],
                            {"search.batch_size": done.batch_size})
        return done.vectors

    async def rescore(self, query: str, texts: Sequence[str], reranker: str | None,
                      pair_tokens: Sequence[int]) -> np.ndarray:
        """One score per text, scored in slices of at most RERANK_SLICE_TOKENS tokens (`pair_tokens`: each
        pair's, as the reranker counts them), each its own turn on the model thread: batches that queue
        meanwhile run between slices, so a long rerank delays a search by one slice, not by all of it.
        Cancelling the call (its client has gone) stops it at the next slice."""
        engine = self.ready_engine()
        attributes = {"search.reranker": reranker or engine.default_reranker or "", "search.depth": len(texts)}
        scores = []
        for start, end in slices(pair_tokens, RERANK_SLICE_TOKENS):
            scores.append(await self._traced("rerank", attributes, engine.rescore, query, list(texts[start:end]), reranker))
        return np.concatenate(scores) if scores else np.zeros(0, dtype=np.float32)

    def _open_writes(self, engine: SearchEngine) -> None:
        """With SEARCH_WRITES: the writes to the served index (its log replayed), served from now on."""
        if not self.settings.writes:
            return
        searcher = engine.searcher
        if not isinstance(searcher, Searcher):
            raise ValueError("SEARCH_WRITES takes writes to one index, not to shards (--ray)")
        if searcher.encoder.backend != searcher.manifest.encoder.backend:
            raise ValueError(f"SEARCH_WRITES needs the index's own encoder backend "
                             f"({searcher.manifest.encoder.backend}) to encode written passages as its others were, "
                             f"not {searcher.encoder.backend} (SEARCH_BACKEND)")
        self.writes = Writes.open(searcher, publish=engine.serve, max_scope_fields=self.settings.max_scope_fields)

    def ready_writes(self) -> Writes:
        self.ready_engine()
        if self.writes is None:
            raise NotServable("this instance takes no writes (start one with SEARCH_WRITES=true)")
        return self.writes

    async def check_upsert(self, items: Sequence[dict], scope: dict | None = None) -> list[Passage]:
        """`items` as passages inside `scope`, off the event loop (WriteError names the first item that is none)."""
        writes = self.ready_writes()
        return await asyncio.to_thread(functools.partial(writes.check_upsert, items, scope=scope))

    async def passage_tokens(self, passages: Sequence[Passage]) -> list[Tokens]:
        """Each passage tokenized as the index's encoder encodes passages (cut at its passage token limit)."""
        encoder = self.ready_writes().searcher.encoder
        return await asyncio.to_thread(lambda: [encoder.tokenize(passage.text, "passage") for passage in passages])

    async def upsert(self, passages: Sequence[Passage], tokens: Sequence[Tokens], scope: dict | None = None) -> int:
        """Encodes `passages` (`tokens`: theirs) on the model thread in slices of at most WRITE_SLICE_TOKENS tokens,
        each its own turn, paced while searches wait (SEARCH_WRITE_SHARE), then writes them: logged, fsynced and
        searched when this returns their sequence number."""
        writes = self.ready_writes()
        encoder = writes.searcher.encoder
        parts = []
        for start, end in slices([len(t.ids) for t in tokens], WRITE_SLICE_TOKENS):
            parts.append(await self.write_share.run(self._on_model_thread, encoder.encode_tokens,
                                                    list(tokens[start:end])))
        write = functools.partial(writes.upsert, list(passages), np.concatenate(parts), scope)
        with self._logging_writes():
            seq = await asyncio.to_thread(write)
        self._compact_when_due()
        return seq

    async def delete(self, ids: Sequence[str] | None, filter: dict | None,
                     scope: dict | None = None) -> tuple[int, int]:
        """(sequence number, passages deleted): see retrieval.writes.Writes.delete."""
        writes = self.ready_writes()
        loop = asyncio.get_running_loop()
        with self._logging_writes():
            done = await loop.run_in_executor(self.filter_thread, writes.delete, ids, filter, scope)
        self._compact_when_due()
        return done

    @contextlib.contextmanager
    def _logging_writes(self):
        """A write the log did not take as WritesUnavailable naming why, kept for /ready until a write is logged:
        answered as a ServiceError, so the client's connection stays open for its next request."""
        try:
            yield
        except LogUnwritable as error:
            self.monitor.write_log_failures.inc()
            full = error.errno in STORAGE_FULL
            advice = ("restart the writer" if error.lasting else "retry once space is freed on its disk" if full
                      else f"retry in {WRITE_RETRY_AFTER_S} s")
            self.write_failure = f"{error}; nothing of this write was kept; {advice}"
            log.error("write refused: %s", self.write_failure)
            raise WritesUnavailable(self.write_failure, full,
                                    None if error.lasting or full else WRITE_RETRY_AFTER_S) from None
        if self.writes.log.refused is None:  # a delete of nothing logs nothing, and mends no lasting refusal
            self.write_failure = None

    def serving_state(self) -> ServingState:
        """What /metrics tells of /ready's state."""
        engine = self.engine
        if engine is None:
            return ServingState(ready=False)
        manifest = engine.searcher.manifest
        return ServingState(True, engine.searcher.generation, manifest.built_at, self.reload_error is not None,
                            self.write_path_problems() is not None)

    def write_path_problems(self) -> str | None:
        """Why the write path is degraded (writes refused, compaction failing), for /ready: searches answer
        either way. None while both work."""
        problems = [] if self.write_failure is None else [f"the write path is degraded: {self.write_failure}"]
        if self.compact_failure is not None:
            wait = self.compact_not_before - time.monotonic()
            retry = ("not tried again until the writer is restarted" if wait == float("inf")
                     else f"next try in {wait:.0f} s" if wait > 0 else "next try when one is next due")
            problems.append(f"compaction failed: {self.compact_failure}; the writes stay logged and searched; {retry}")
        return "; ".join(problems) or None

    def _compact_when_due(self) -> None:
        """Starts a compaction (retrieval.compaction, on the loader thread, niced) when the segment holds
        SEARCH_COMPACT_PASSAGES changes past those its generation seals, or its oldest write is
        SEARCH_COMPACT_AGE_S old, and none runs."""
        writes, settings = self.writes, self.settings
        if writes is None or (self.compacting is not None and not self.compacting.done()):
            return
        if writes.log.refused is not None:  # its log gone: only a restart helps, and it replays what a log holds
            return
        if time.monotonic() < self.compact_not_before:  # a failed one: tried again once the backoff is over
            return
        since = writes.segment_since
        old = since is not None and time.monotonic() - since >= settings.compact_age_s
        searcher = writes.searcher
        if searcher.segment.size - searcher.sealed_size >= settings.compact_passages or old:
            self.compacting = self.loader.submit(self._compact)

    def _compact(self) -> None:
        try:
            report = compact(self.writes, merge_share=self.settings.merge_share)
        except FolderReplaced as error:  # lasting: tried again, it would fail the same way every time
            self.compact_failure, self.compact_not_before = str(error), float("inf")
            log.error("compaction failed; the writes stay logged and searched; not tried again: %s", error)
            return
        except Exception as error:  # noqa: BLE001 - the writes stay in the segment and the log; a later one tries again
            self.compact_backoff_s = min(2 * self.compact_backoff_s, COMPACT_BACKOFF_MAX_S)
            self.compact_not_before = time.monotonic() + self.compact_backoff_s
            self.compact_failure = str(error) or type(error).__name__
            log.exception("compaction failed; the writes stay logged and searched; next try in %.0f s",
                          self.compact_backoff_s)
            return
        self.compact_backoff_s, self.compact_not_before = COMPACT_BACKOFF_MIN_S / 2, 0.0
        self.compact_failure = None
        if report is not None:
            log.info(report.summary())

    async def _compact_on_age(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.settings.compact_age_s / 4))
            self._compact_when_due()

    async def reload(self, target: Path) -> dict:
        """Loads `target` beside the serving index (searches go on), warms it up on the model thread and
        swaps it in; ReloadError leaves the serving one in place, and its reason in `reload_error` until a
        reload succeeds. One reload at a time."""
        engine = self.ready_engine()
        if self.writes is not None:
            raise NotServable("this instance takes writes (SEARCH_WRITES): its index changes only through them")
        async with self.reload_lock:
            try:
                prepare = functools.partial(engine.prepare, target)
                candidate = await asyncio.get_running_loop().run_in_executor(self.loader, prepare)
                await self._on_model_thread(engine.install, candidate)
            except ReloadError as error:
                self.reload_error = f"reloading {target} failed, the previous index keeps serving: {error}"
                self.reload_failed = target
                raise
            self.reload_error = self.reload_failed = None
            await self._on_model_thread(self._settle, True)
        return engine.describe()

    def served_index(self) -> tuple[Path, Manifest] | None:
        """The folder and manifest of the one index served (None while loading, or over shards)."""
        return self.engine.followed() if self.engine is not None else None

    def served_again(self, folder: Path) -> None:
        """`folder` holds the generation served (a failed one replaced by it): a failed reload of `folder`
        no longer stands, so /ready stops reporting it."""
        if self.reload_failed == folder:
            self.reload_error = self.reload_failed = None

    def _settle(self, reloaded: bool = False) -> None:
        """With SEARCH_GC_FREEZE, everything alive once an index is in (model, tokenizer, index, imports)
        leaves the cyclic collector's generations: under load a full collection would otherwise walk
        every one of them with the GIL held, and every request waits (see docs/benchmarks.md,
        bench/overload.py). After a reload, unfrozen first, so what the replaced index held in reference
        cycles is collected rather than kept frozen; on a first load only what is not frozen yet is walked."""
        if self.settings.gc_freeze:
            if reloaded:
                gc.unfreeze()
            gc.collect()
            gc.freeze()

    async def _on_model_thread(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(function, *args))

    async def _traced(self, stage: str, attributes: dict, function, *args):
        """`function(*args)` on the model thread; with tracing, timed there into a `stage` span after
        a `queue` span for the wait for the thread."""
        if not self.tracing.enabled:
            return await self._on_model_thread(function, *args)
        marks = [time.perf_counter()]

        def timed():
            marks.append(time.perf_counter())
            result = function(*args)
            marks.append(time.perf_counter())
            return result

        result = await self._on_model_thread(timed)
        stages: list[Stage] = [("queue", marks[0], marks[1]), (stage, marks[1], marks[2])]
        self.tracing.stages(stages, attributes)
        return result


def slices(costs: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """(start, end) of consecutive runs of `costs` each summing to at most `budget` (one item over it
    alone), covering them all in order."""
    bounds, start, total = [], 0, 0
    for end, cost in enumerate(costs):
        if end > start and total + cost > budget:
            bounds.append((start, end))
            start, total = end, 0
        total += cost
    if start < len(costs):
        bounds.append((start, len(costs)))
    return bounds


def _waited(result: SearchResult, submitted: float) -> SearchResult:
    """`result` with the wait for the model thread since `submitted` as its queue time, and in its total
    (as the micro-batcher reports them): the latency a client saw, not only the run's."""
    waited = 1000 * max(0.0, result.timings.started_at - submitted)
    return replace(result, timings=replace(result.timings, queue=waited, total=result.timings.total + waited))
