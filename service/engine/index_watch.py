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
from typing import Awaitable, Callable

from pydantic import ValidationError

from retrieval.index_format import MANIFEST_FILE, Manifest
from service.engine.search_engine import ReloadError

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
    """Polls the served index's folder every `interval_s` while the service runs (`start`, `stop`).
    `served`: the folder and manifest of the one index served now (None while loading, after a failed
    load, or over shards); `reload`: loads a folder in its place (Runtime.reload); `served_again`: told
    that a folder holds the generation served again (Runtime.served_again)."""

    def __init__(self, interval_s: float, served: Callable[[], tuple[Path, Manifest] | None],
                 reload: Callable[[Path], Awaitable[dict]], served_again: Callable[[Path], None]) -> None:
        self.interval_s = interval_s
        self.served, self.reload, self.served_again = served, reload, served_again
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
                log.error("index watch: reloading failed, the previous index keeps serving: %s", error)
            except Exception:  # noqa: BLE001 - the watch goes on; the old index serves
                log.exception("index watch: looking for a new generation failed")

    async def poll(self) -> bool:
        """One look at the folder, and a reload where a new generation is in place: whether it reloaded.
        ReloadError where the new generation failed to load (the old one still serving)."""
        served = self.served()
        if served is None:
            return False
        folder, serving = served
        found = await asyncio.to_thread(read_generation, folder)
        if found is None:
            return False
        digest, manifest = found
        if manifest == serving:
            self.served_again(folder)
            return False
        if (folder, digest) == self.tried:
            return False
        self.tried = (folder, digest)
        log.info("index watch: a new generation of %s is in place; reloading", folder)
        described = await self.reload(folder)
        log.info("index watch: serving %s (%d passages, built %s)", folder, described["count"], described["built_at"])
        return True
