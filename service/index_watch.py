"""SEARCH_WATCH_INDEX: the served index folder watched, and reloaded when a new generation is in place.

Every SEARCH_WATCH_INTERVAL_S the manifest in the served index's folder (SEARCH_INDEX_DIR, or the folder
/admin/reload last loaded; a few kilobytes) is read and compared with the served index's. The writers (build, build --update, update, ann) swap a whole generation in by rename,
its manifest written last, so a manifest that differs stands for a finished generation. It is loaded by
`Runtime.reload`, the path /admin/reload takes: beside the serving index, warmed up, then swapped in; the
old index serves meanwhile and stays where the load fails, the reason logged and shown in /ready. A
generation that failed is not tried again until the manifest changes once more.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from retrieval.index_format import MANIFEST_FILE, Manifest
from service.engine import ReloadError, SearchEngine
from service.sharded_engine import ShardedEngine

if TYPE_CHECKING:
    from service.runtime import Runtime

log = logging.getLogger("service")


def read_generation(index_dir: Path) -> tuple[str, Manifest | None] | None:
    """(sha256 of the manifest's bytes, the manifest, or None where it does not parse) of the index at
    `index_dir`; None where there is no manifest to read just now (between the two renames of a swap on a
    file system that cannot exchange)."""
    try:
        raw = (index_dir / MANIFEST_FILE).read_bytes()
    except OSError:
        return None
    try:
        manifest = Manifest.model_validate_json(raw)
    except ValidationError:
        manifest = None  # a broken generation: its reload fails and says why
    return hashlib.sha256(raw).hexdigest(), manifest


class IndexWatch:
    """Polls the served index's folder while the service runs (`start`, `stop`)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.interval_s = runtime.settings.watch_interval_s
        self.tried: tuple[Path, str] | None = None  # the folder and manifest digest last loaded or tried
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="index-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll()
            except ReloadError as error:
                log.error("index watch: %s", self.runtime.reload_error or error)
            except Exception:  # noqa: BLE001 - the watch goes on; the old index serves
                log.exception("index watch: looking for a new generation failed")

    async def poll(self) -> bool:
        """One look at the folder, and a reload where a new generation is in place: whether it reloaded.
        ReloadError where the new generation failed to load (the old one still serving)."""
        engine = self.runtime.engine
        if not isinstance(engine, SearchEngine) or isinstance(engine, ShardedEngine):  # loading, failed, or shards
            return False
        folder = engine.searcher.index_dir
        found = await asyncio.to_thread(read_generation, folder)
        if found is None:
            return False
        digest, manifest = found
        if manifest == engine.searcher.manifest:
            self.runtime.served_again(folder)
            return False
        if (folder, digest) == self.tried:
            return False
        self.tried = (folder, digest)
        log.info("index watch: a new generation of %s is in place; reloading", folder)
        described = await self.runtime.reload(folder)
        log.info("index watch: serving %s (%d passages, built %s)", folder, described["count"], described["built_at"])
        return True
